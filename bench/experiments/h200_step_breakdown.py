"""Question: where does the training step's time go outside the two backward kernels, and do
the session-7 changes (issue #18) pay: the maps on the device (maps.py), the fp32 O by TMA
from the idle K ring (STORE_O32 2), the dQ kernel's output through its ring (4 stages now fit
two CTAs per SM), one dS^T staging slot, and packed query tiles in the Gluon dK/dV kernel
(dkdv_pack: partial query cubes of one size class side by side, 83% of the tiles at the
default workload)?

Part 1, small shapes: `h200_gluon_backward.check_small` (padding garbage, empty rows, the
unchosen cube, bad values; vbs 64/32/16/8) for the Gluon backward with and without dkdv_pack.

Part 2, the default workload (`captures.synthesize_for(Spec(), outlier=True)`):
- the forward: Gluon winner without lse, with lse, `forward_for_grad` with STORE_O32 2 (TMA)
  and 1 (`gl.store`; the kind forced), the two fp32 O compared bit for bit;
- the maps: the torch models against `device_maps`, plain and packed, equal and timed;
- backward candidates (`op.launch_backward`, maps per call; kernels with the maps prebuilt;
  per kernel from torch.profiler), gradients on the outlier, first and last heads;
- the training step (`block_sparse_attention` + `torch.autograd.grad`) of the default and of
  the best candidate, every kernel of one step from torch.profiler, and the reference step.

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=/tmp/tgc python3 bench/experiments/h200_step_breakdown.py

The JSON ($OUT/h200_step_breakdown.json) is rewritten after every part; the table is printed
last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from h200_backward_tune import per_kernel, timer  # noqa: E402
from h200_gluon_backward import check_small  # noqa: E402

from tilegen.backends.gluon import backward as gluon_bwd  # noqa: E402
from tilegen.backends.triton.backward import BackwardConfig  # noqa: E402

GD = BackwardConfig(gluon=True, ds_store=True)
GP = dataclasses.replace(GD, dkdv_pack=True)
#: (label, config, Gluon backward option overrides)
#: session 7's second question: the dK/dV launch longest lists first (an option then, removed
#: after this run: 1.5-3 ms slower), the dQ kernel's K boxes of exactly-partial KV cubes
#: (`dq_k_boxes`, the default since). The measured run: `..._s7_h200_step_breakdown_order_kboxes`.
CANDIDATES: list[tuple[str, BackwardConfig, dict]] = [
    ("dkdv_pack, full K boxes", GP, {"dq_k_boxes": False}),
    ("+ dQ K boxes (the default)", GP, {}),
    ("dQ K boxes, scratch 8 GiB", dataclasses.replace(GP, ds_scratch_mib=8192), {}),
    ("full K boxes again (noise)", GP, {"dq_k_boxes": False}),
    ("dQ K boxes again (noise)", GP, {}),
]
RESULTS: dict = {"small": {}, "forward": {}, "maps": {}, "candidates": {}, "step": {}}
JSON_PATH: list[Path] = []
BASE_DEFAULTS = dict(gluon_bwd.DEFAULTS)


def _dump() -> None:
    JSON_PATH[0].parent.mkdir(parents=True, exist_ok=True)
    JSON_PATH[0].write_text(json.dumps(RESULTS, indent=2, default=str) + "\n")


def use_options(overrides: dict, *ops) -> None:
    """The Gluon backward's option defaults for the next launches (the ops' cached kernels
    dropped): an experiment's switch, not an API."""
    gluon_bwd.DEFAULTS.clear()
    gluon_bwd.DEFAULTS.update({**BASE_DEFAULTS, **overrides})
    for op in ops:
        op._gluon_bwd.clear()


def step_kernels(step, reps: int = 3) -> dict[str, float]:
    """Every CUDA kernel of `step`, ms per step (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            out[e.key[:70]] = round(us / reps / 1000, 3)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--skip-forward", action="store_true")
    ap.add_argument("--skip-maps", action="store_true")
    a = ap.parse_args(argv)
    JSON_PATH.append(Path(os.environ.get("OUT", "out")) / "h200_step_breakdown.json")
    import tilegen
    from tilegen import bench, captures
    from tilegen.backends.gluon import render as gluon_render
    from tilegen.backends.gluon.backward import dq_plan, slots_of_order
    from tilegen.backends.triton.backward import backward_maps, inverse_map, packed_inverse_map
    from tilegen.backends.triton.maps import device_maps
    from tilegen.ops import _op_for, block_sparse_attention

    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["torch"] = torch.__version__
    t0 = time.time()
    if not a.skip_small:
        for label, bcfg in (("ds_store", GD), ("dkdv_pack", GP)):
            for seed in (0, 1, 2):
                for head_dim in (64, 128):
                    key = f"{label} seed {seed} d{head_dim}"
                    try:
                        RESULTS["small"][key] = check_small(bcfg, seed, head_dim)
                    except Exception as exc:  # noqa: BLE001 - a failure is data
                        traceback.print_exc()
                        RESULTS["small"][key] = {"passed": False,
                                                 "error": f"{type(exc).__name__}: {exc}"[:1500]}
                    print(key, json.dumps(RESULTS["small"][key]), flush=True)
        _dump()
    RESULTS["small_s"] = round(time.time() - t0, 1)

    spec = tilegen.Spec()
    cap = captures.synthesize_for(spec, seed=a.seed, device="cuda", outlier=True)
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    heads = bench.backward_heads(spec.num_heads, cap.get("outlier_heads") or ())
    do = bench.backward_do(q, a.seed)
    nkv = idx.shape[2]
    time_it = timer("cuda", a.rep)
    op = tilegen.load(spec, backend="triton")
    gop = tilegen.load(spec, backend="gluon")

    # the forward
    fwd = RESULTS["forward"]
    try:
        if a.skip_forward:
            raise RuntimeError("skipped (--skip-forward)")
        fast = op.grad_forward()
        fwd["grad_forward"] = f"{fast.backend} {fast.config.name} ({fast.config_source})"
        fwd["o32_kind"] = gluon_render.o32_store_kind(gluon_render.options_of(fast.config))
        fwd["gluon_no_lse_ms"] = time_it(lambda: gop.launch(q, k, v, idx, vbs, store_lse=False))
        fwd["gluon_lse_ms"] = time_it(lambda: gop.launch(q, k, v, idx, vbs, store_lse=True))
        fwd["for_grad_tma_ms"] = time_it(lambda: op.forward_for_grad(q, k, v, idx, vbs))
        o_t, lse_t, o32_t = op.forward_for_grad(q, k, v, idx, vbs)
        kind = gluon_render.o32_store_kind
        gluon_render.o32_store_kind = lambda opts: 1
        try:
            fwd["for_grad_gl_store_ms"] = time_it(lambda: op.forward_for_grad(q, k, v, idx, vbs))
            o_s, lse_s, o32_s = op.forward_for_grad(q, k, v, idx, vbs)
        finally:
            gluon_render.o32_store_kind = kind
        torch.cuda.synchronize()
        fwd["o32_equal"] = bool(torch.equal(o32_t, o32_s))
        fwd["o_equal"] = bool(torch.equal(o_t, o_s)) and bool(torch.equal(lse_t, lse_s))
        fwd["for_grad_tma_again_ms"] = time_it(lambda: op.forward_for_grad(q, k, v, idx, vbs))
        del o_s, lse_s, o32_s
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        fwd["error"] = f"{type(exc).__name__}: {exc}"[:1500]
    print("forward", json.dumps(fwd), flush=True)
    _dump()

    # the maps
    maps = RESULTS["maps"]
    try:
        if a.skip_maps:
            raise RuntimeError("skipped (--skip-maps)")
        def torch_maps():
            offsets, qcubes, order = inverse_map(idx, None, nkv, return_order=True)
            return offsets, qcubes, dq_plan(idx, None, vbs, nkv, slots_of_order(order))

        def torch_packed():
            packed, slot, row = packed_inverse_map(idx, None, vbs, nkv, 64, entry_tiles=True,
                                                   min_rows=8, exact=True)
            return packed, dq_plan(idx, None, vbs, nkv, slot, 64, row)

        t_off, t_q, (t_pos, t_meta) = torch_maps()
        (g_off, g_q), (g_pos, g_meta) = device_maps(idx, None, vbs, nkv)
        maps["equal"] = all(torch.equal(x, y) for x, y in ((t_off, g_off), (t_q, g_q),
                                                            (t_pos, g_pos), (t_meta, g_meta)))
        t_pk, (tp_pos, tp_meta) = torch_packed()
        g_pk, (gp_pos, gp_meta) = device_maps(idx, None, vbs, nkv, pack=True, min_rows=8,
                                              exact=True)
        maps["packed_equal"] = all(
            torch.equal(getattr(t_pk, f), getattr(g_pk, f))
            for f in ("offsets", "items", "tile_start", "tile_meta", "count")) and (
            torch.equal(tp_pos, gp_pos) and torch.equal(tp_meta, gp_meta))
        maps["pairs"] = int(g_off[-1])
        maps["packed_tiles"] = int(g_pk.count.sum())
        maps["torch_ms"] = time_it(torch_maps)
        maps["torch_packed_ms"] = time_it(torch_packed)
        maps["device_ms"] = time_it(lambda: device_maps(idx, None, vbs, nkv))
        maps["device_packed_ms"] = time_it(lambda: device_maps(
            idx, None, vbs, nkv, pack=True, min_rows=8, exact=True))
        maps["device_packed_kernels"] = step_kernels(
            lambda: device_maps(idx, None, vbs, nkv, pack=True, min_rows=8, exact=True))
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        maps["error"] = f"{type(exc).__name__}: {exc}"[:1500]
    print("maps", json.dumps(maps), flush=True)
    _dump()

    # backward candidates
    _o, lse, o_acc = op.forward_for_grad(q, k, v, idx, vbs)
    ref = bench.grad_reference(spec, (q, k, v, idx, vbs), do, heads)
    args = (do, q, k, v, o_acc, lse, idx, vbs)
    sel = torch.tensor(heads, device="cuda")
    best = None
    for i, (label, cfg, opts) in enumerate(CANDIDATES):
        key = f"{i:02d} {label}"
        row: dict = {"config": cfg.name, "options": opts}
        RESULTS["candidates"][key] = row
        t1 = time.time()
        try:
            use_options(opts, op)
            grads = op.launch_backward(*args, config=cfg)
            torch.cuda.synchronize()
            scores = {n: captures.grad_score(g.index_select(2, sel), r, layout="bshd")
                      for n, g, r in zip(("dq", "dk", "dv"), grads, ref, strict=True)}
            del grads
            row["passed"] = all(s.passed for s in scores.values())
            row["min_cos"] = min(s.min_head_cos for s in scores.values())
            row["max_rel"] = max(s.max_abs / s.ref_max if s.ref_max else 0.0
                                 for s in scores.values())
            row["scores"] = {n: str(s) for n, s in scores.items()}
            pre = backward_maps(idx, None, vbs, nkv, spec.block_kv, cfg.fit(spec))
            row["bwd_ms"] = time_it(lambda cfg=cfg: op.launch_backward(*args, config=cfg))
            row["kernels_ms"] = time_it(
                lambda cfg=cfg, pre=pre: op.launch_backward(*args, inverse=pre, config=cfg))
            row["per_kernel_ms"] = per_kernel(op, args, pre, cfg, "cuda")
            row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
            del pre
            if row["passed"] and i < len(CANDIDATES) - 1 and (
                    best is None or row["bwd_ms"] < RESULTS["candidates"][best]["bwd_ms"]):
                best = key
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
            traceback.print_exc()
            torch.cuda.empty_cache()
        row["s"] = round(time.time() - t1, 1)
        print(key, json.dumps({k2: v2 for k2, v2 in row.items() if k2 != "scores"}), flush=True)
        _dump()
    use_options({}, op)
    del ref

    # the training step: the shipped default, the best candidate, the reference
    step_rows = RESULTS["step"]
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    custom = _op_for(q, "bshd", "triton")

    def step():
        o = block_sparse_attention(qg, kg, vg, idx, vbs)
        return torch.autograd.grad(o, (qg, kg, vg), do)

    def fwd_only():
        return block_sparse_attention(qg, kg, vg, idx, vbs)

    try:
        step_rows["default_config"] = custom.backward_config.name
        step_rows["default_ms"] = time_it(step)
        step_rows["default_fwd_grad_ms"] = time_it(fwd_only)
        step_rows["default_kernels"] = step_kernels(step)
        if best is not None:
            label_cfg = CANDIDATES[int(best[:2])]
            saved = custom.backward_config
            use_options(label_cfg[2], custom)
            custom.backward_config = label_cfg[1]
            step_rows["best"] = best
            step_rows["best_ms"] = time_it(step)
            step_rows["best_kernels"] = step_kernels(step)
            custom.backward_config = saved
            use_options({}, custom)
        ref_op = tilegen.load(spec, backend="triton")
        ref_op.grad_forward_family = "triton"
        ref_op.backward_config = BackwardConfig().fit(spec)

        def ref_step():
            o = ref_op(qg, kg, vg, idx, vbs, return_lse=False)
            return torch.autograd.grad(o, (qg, kg, vg), do)

        step_rows["reference_ms"] = time_it(ref_step)
        step_rows["default_again_ms"] = time_it(step)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        step_rows["error"] = f"{type(exc).__name__}: {exc}"[:1500]
    _dump()

    small_ok = sum(r.get("passed", False) for r in RESULTS["small"].values())
    lines = [f"small cases: {small_ok}/{len(RESULTS['small'])} passed",
             f"forward: {json.dumps(fwd)}",
             f"maps: {json.dumps({k2: v2 for k2, v2 in maps.items() if 'kernels' not in k2})}",
             f"{'candidate':<40} {'bwd ms':>8} {'kern ms':>8} {'grads':>5} {'min cos':>9} "
             f"{'max rel':>8}  per kernel"]
    for key, r in RESULTS["candidates"].items():
        if "error" in r:
            lines.append(f"{key:<40} ERROR {r['error'][:100]}")
            continue
        per = ", ".join(f"{n.removeprefix('tilegen_')[:22]} {ms:.2f}"
                        for n, ms in r.get("per_kernel_ms", {}).items())
        lines.append(f"{key:<40} {r['bwd_ms']:8.3f} {r['kernels_ms']:8.3f} "
                     f"{'PASS' if r['passed'] else 'FAIL':>5} {r['min_cos']:9.6f} "
                     f"{r['max_rel']:8.1e}  {per}")
    for name in ("default_config", "default_ms", "default_fwd_grad_ms", "best", "best_ms",
                 "reference_ms", "default_again_ms", "error"):
        if name in step_rows:
            lines.append(f"step {name}: {step_rows[name]}")
    for name in ("default_kernels", "best_kernels"):
        if name in step_rows:
            lines.append(f"step {name}: " + ", ".join(
                f"{n[:40]} {ms:.3f}" for n, ms in list(step_rows[name].items())[:14]))
    RESULTS["table"] = lines
    _dump()
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
