"""Question (issue #18, session 8): how much of the training step is not kernel time, and do
side streams recover it: the backward's maps built beside the delta pass (`op.OVERLAP_MAPS`, in
the first call only: it measured no gain and left the op),
and the Gluon backward's head groups on two streams (`group_streams`: one group's dQ and the
next one's dK/dV fill each other's launch tails)?

Part 1, the default workload (`captures.synthesize_for(Spec(), outlier=True)`), the training
step (`block_sparse_attention` + `torch.autograd.grad`) per candidate: median step time, the
gradients on the outlier, first and last heads against fp32 autograd, and from one
torch.profiler run of 3 steps: the kernels' busy time per step (their union on the GPU), the
idle gaps, and the host's enqueue time. The chrome trace of the default's steps goes to $OUT.

Part 2 (``--ncu``): one forward + backward on 4 heads of the same workload, for Nsight
Compute to read the two Gluon backward kernels (`-k regex:tilegen_gluon_bwd --launch-count 2`).

    PYTHONPATH=$PWD python3 bench/experiments/h200_s8_overlap.py
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
from h200_backward_tune import timer  # noqa: E402
from h200_step_breakdown import step_kernels, use_options  # noqa: E402

#: (label, OVERLAP_MAPS, Gluon backward option overrides, scratch MiB or None). The first
#: call's list (`..._s8_h200_overlap`): default, maps beside delta, 2 group streams, both, both
#: with 8 GiB, 8 GiB alone, default again. The second adds the key-sized matmuls of the small
#: KV cubes (`dkdv_kv_small`).
#: the second call's list added the key-sized matmuls of the small KV cubes (`dkdv_kv_small`),
#: the third the row statistics a tile ahead (`dkdv_stats_ahead`): both measured no gain and
#: left the template (commits adfd455 and a88d7c2 have them). The fourth: how many lanes (1-4,
#: 2 with 8 GiB). The fifth: the dQ kernel reading only a small KV cube's dS^T rows
#: (`dq_ds_rows`, commits 669d274 and 5f6dbef): its dQ came out wrong on the first small case
#: and it left the template untimed. The last call: the shipped default's small checks.
CANDIDATES: list[tuple[str, bool, dict, int | None]] = [
    ("default (2 lanes)", False, {}, None),
    ("1 lane", False, {"group_streams": 1}, None),
]
#: Gluon backward options whose small-shape checks run first (`--small`)
SMALL_CHECKS: list[dict] = [{}]
RESULTS: dict = {"candidates": {}}


def gpu_timeline(step, reps: int = 3) -> dict:
    """Busy time (the union of kernel intervals), gaps over 10 us and the host's time per step,
    from one torch.profiler run (CPU and CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    host = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name)
                   for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, gaps, end = 0.0, [], None
    for s, t, name in spans:
        if end is None or s > end:
            if end is not None and s - end > 10:
                gaps.append((round(s - end, 1), name[:40]))
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    first, last = spans[0][0], max(t for _, t, _ in spans)
    return {"busy_ms_per_step": round(busy / reps / 1e3, 3),
            "first_to_last_ms_per_step": round((last - first) / reps / 1e3, 3),
            "host_enqueue_ms": [round(h, 3) for h in host],
            "gaps_us": sorted(gaps, reverse=True)[:12], "n_gaps": len(gaps),
            "_prof": prof}


def host_profile(step, out_dir: Path, reps: int = 20) -> int:
    """Where the host's time of a step goes: the time from the call to the forward's first
    launch (the GPU idles then in a timed step), the whole enqueue, a cProfile of `reps` steps;
    then `reps` steps back to back (the host runs ahead: GPU time only) against do_bench."""
    import cProfile
    import io
    import pstats

    from tilegen.backends.gluon import launch as gluon_launch

    marks: list[float] = []
    real = gluon_launch.run_prepass

    def marked(*args, **kwargs):
        marks.append(time.perf_counter())
        return real(*args, **kwargs)

    gluon_launch.run_prepass = marked
    out: dict = {"prefix_ms": [], "enqueue_ms": []}
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    for _ in range(reps):
        marks.clear()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out["prefix_ms"].append(round((marks[0] - t0) * 1e3, 3))
        out["enqueue_ms"].append(round((t1 - t0) * 1e3, 3))
    gluon_launch.run_prepass = real
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    st = pstats.Stats(prof, stream=text)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(30)
    (out_dir / "s8_host_profile.txt").write_text(text.getvalue())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    step()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    out["back_to_back_ms"] = round(start.elapsed_time(end) / reps, 3)
    out["do_bench_ms"] = timer("cuda", 600)(step)
    out["prefix_median_ms"] = sorted(out["prefix_ms"])[reps // 2]
    out["enqueue_median_ms"] = sorted(out["enqueue_ms"])[reps // 2]
    (out_dir / "s8_host.json").write_text(json.dumps(out, indent=2) + "\n")
    print(text.getvalue()[:9000])
    print(json.dumps(out), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--ncu-opts", default="{}", help="Gluon backward options of the --ncu run")
    ap.add_argument("--host", action="store_true", help="the host's time per step (cProfile)")
    ap.add_argument("--small", action="store_true",
                    help="first the small-shape gradient checks of SMALL_CHECKS")
    ap.add_argument("--small-only", action="store_true",
                    help="the small-shape checks alone; exit status 1 unless all pass")
    a = ap.parse_args(argv)
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    import tilegen
    from tilegen import bench, captures
    from tilegen.backends.triton.backward import BackwardConfig
    from tilegen.ops import _op_for, block_sparse_attention

    if a.small or a.small_only:
        from h200_gluon_backward import check_small

        RESULTS["small"] = {}
        for opts in SMALL_CHECKS:
            use_options(opts)
            for pack in (True, False):
                bcfg = BackwardConfig(gluon=True, ds_store=True, dkdv_pack=pack)
                for seed in (0, 1):
                    for head_dim in (64, 128):
                        key = f"{opts} pack={pack} seed {seed} d{head_dim}"
                        try:
                            RESULTS["small"][key] = check_small(bcfg, seed, head_dim)
                        except Exception as exc:  # noqa: BLE001 - a failure is data
                            traceback.print_exc()
                            RESULTS["small"][key] = {"passed": False, "error":
                                                     f"{type(exc).__name__}: {exc}"[:1500]}
                        print(key, json.dumps(RESULTS["small"][key]), flush=True)
        use_options({})
        # two lanes for real: batch 2 (4 b*h) in a 1 MiB scratch gives two groups of two heads
        # (192 KiB of dS^T per head), one per lane (written after the session's last GPU call:
        # not yet run)
        for pack in (True, False):
            bcfg = BackwardConfig(gluon=True, ds_store=True, dkdv_pack=pack, ds_scratch_mib=1)
            key = f"two lanes pack={pack} batch 2 d128"
            try:
                RESULTS["small"][key] = check_small(bcfg, 0, 128, batch=2)
            except Exception as exc:  # noqa: BLE001 - a failure is data
                traceback.print_exc()
                RESULTS["small"][key] = {"passed": False,
                                         "error": f"{type(exc).__name__}: {exc}"[:1500]}
            print(key, json.dumps(RESULTS["small"][key]), flush=True)
        small_ok = sum(r.get("passed", False) for r in RESULTS["small"].values())
        RESULTS["small_passed"] = f"{small_ok}/{len(RESULTS['small'])}"
        print("small cases passed:", RESULTS["small_passed"], flush=True)
        if a.small_only:
            (out_dir / "h200_s8_small.json").write_text(json.dumps(RESULTS, indent=2) + "\n")
            return 0 if small_ok == len(RESULTS["small"]) else 1

    spec = tilegen.Spec()
    cap = captures.synthesize_for(spec, seed=a.seed, device="cuda", outlier=True)
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    do = bench.backward_do(q, a.seed)
    if a.ncu:
        sub = dataclasses.replace(spec, num_heads=4)
        q, k, v, do = (t[:, :, :4].contiguous() for t in (q, k, v, do))
        idx = idx[:, :4].contiguous()
        op = tilegen.load(sub, backend="triton")
        use_options(json.loads(a.ncu_opts), op)
        o, lse, o_acc = op.forward_for_grad(q, k, v, idx, vbs)
        grads = op.launch_backward(do, q, k, v, o_acc, lse, idx, vbs)
        torch.cuda.synchronize()
        print("ncu run done", [float(g.float().norm()) for g in grads], flush=True)
        return 0

    heads = bench.backward_heads(spec.num_heads, cap.get("outlier_heads") or ())
    sel = torch.tensor(heads, device="cuda")
    time_it = timer("cuda", a.rep)
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    custom = _op_for(q, "bshd", "triton")
    base_cfg = custom.backward_config
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["torch"] = torch.__version__
    RESULTS["backward_config"] = base_cfg.name

    def step():
        o = block_sparse_attention(qg, kg, vg, idx, vbs)
        return torch.autograd.grad(o, (qg, kg, vg), do)

    if a.host:
        return host_profile(step, out_dir)
    ref = bench.grad_reference(spec, (q, k, v, idx, vbs), do, heads)

    for i, (label, overlap, opts, mib) in enumerate(CANDIDATES):
        key = f"{i:02d} {label}"
        row: dict = {"overlap_maps": overlap, "options": opts, "scratch_mib": mib}
        RESULTS["candidates"][key] = row
        try:
            if overlap:
                raise RuntimeError("OVERLAP_MAPS left the op after the first call")
            use_options(opts, custom)
            custom.backward_config = (dataclasses.replace(base_cfg, ds_scratch_mib=mib)
                                      if mib else base_cfg)
            grads = step()
            torch.cuda.synchronize()
            scores = {n: captures.grad_score(g.index_select(2, sel), r, layout="bshd")
                      for n, g, r in zip(("dq", "dk", "dv"), grads, ref, strict=True)}
            del grads
            row["passed"] = all(s.passed for s in scores.values())
            row["min_cos"] = min(s.min_head_cos for s in scores.values())
            row["scores"] = {n: str(s) for n, s in scores.items()}
            torch.cuda.reset_peak_memory_stats()
            row["step_ms"] = time_it(step)
            row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
            tl = gpu_timeline(step)
            prof = tl.pop("_prof")
            if i == 0:
                prof.export_chrome_trace(str(out_dir / "s8_step_trace.json"))
            row.update(tl)
            row["kernels"] = step_kernels(step)
        except Exception as exc:  # noqa: BLE001 - a failure is data
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
        print(key, json.dumps({k2: v2 for k2, v2 in row.items()
                               if k2 not in ("scores", "kernels")}), flush=True)
        (out_dir / "h200_s8_overlap.json").write_text(json.dumps(RESULTS, indent=2) + "\n")
    use_options({}, custom)
    custom.backward_config = base_cfg

    ref_op = tilegen.load(spec, backend="triton")
    ref_op.grad_forward_family = "triton"
    ref_op.backward_config = BackwardConfig().fit(spec)

    def ref_step():
        o = ref_op(qg, kg, vg, idx, vbs, return_lse=False)
        return torch.autograd.grad(o, (qg, kg, vg), do)

    RESULTS["reference_step_ms"] = time_it(ref_step)
    lines = [f"{'candidate':<32} {'step ms':>8} {'busy':>7} {'span':>7} {'gaps':>5} "
             f"{'host ms':>8} {'grads':>5} {'min cos':>9} {'peak GB':>7}"]
    for key, r in RESULTS["candidates"].items():
        if "error" in r:
            lines.append(f"{key:<32} ERROR {r['error'][:120]}")
            continue
        lines.append(f"{key:<32} {r['step_ms']:8.3f} {r['busy_ms_per_step']:7.3f} "
                     f"{r['first_to_last_ms_per_step']:7.3f} {r['n_gaps']:5d} "
                     f"{max(r['host_enqueue_ms']):8.3f} {'PASS' if r['passed'] else 'FAIL':>5} "
                     f"{r['min_cos']:9.6f} {r['peak_gb']:7.1f}")
    lines.append(f"reference step: {RESULTS['reference_step_ms']:.3f} ms")
    if "small_passed" in RESULTS:
        lines.append(f"small cases passed: {RESULTS['small_passed']}")
    for key, r in RESULTS["candidates"].items():
        lines.append(f"{key} kernels: " + ", ".join(
            f"{n.removeprefix('tilegen_')[:18]} {ms:.2f}"
            for n, ms in list(r.get("kernels", {}).items())[:4]))
    first = next(iter(RESULTS["candidates"].values()))
    lines.append("default gaps (us, next kernel): " + json.dumps(first.get("gaps_us")))
    lines.append("default kernels: " + ", ".join(
        f"{n[:34]} {ms:.3f}" for n, ms in list(first.get("kernels", {}).items())[:12]))
    RESULTS["table"] = lines
    (out_dir / "h200_s8_overlap.json").write_text(json.dumps(RESULTS, indent=2) + "\n")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
