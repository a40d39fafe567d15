"""Question: Which padding variant of the backward is fastest at full size? (issue #10)

H200: the backward's padding variants (issue #10) against the current default, one run.

On the default workload (`captures.synthesize(seed, device="cuda")`: q/k/v (1, 39936, 40, 128)
bf16, TOPK 78, one outlier head), with the forward of the Triton family as `tilegen.load` picks
it (o in fp32 and lse, as autograd saves them), for each candidate `BackwardConfig` (the
current default first: the reference of the speedups):

1. gradients: ``op.launch_backward`` once; dq, dk, dv on the outlier head(s), the first and the
   last head against the fp32 autograd reference (`tilegen.bench.grad_reference`, one head at a
   time) with the gradient rule (`captures.grad_score`: finite, per-head cosine >= 0.9999,
   max|Δ| <= 1e-2 max|ref|), the same dO (`tilegen.bench.backward_do`) as the tuner's gate;
2. timing (`triton.testing.do_bench`, median): the backward as autograd runs it (delta, the
   maps built from the LUT, the kernels), the kernels with the maps prebuilt, the maps alone;
3. per-kernel times (torch.profiler) of the default and of the fastest passing candidate.

Every candidate is its own try/except (a failure is recorded, the run goes on); the JSON is
rewritten after each one ($OUT/h200_backward_tune.json, or --json). The table is printed last.

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=/tmp/tgc python3 bench/experiments/h200_backward_tune.py
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 bench/experiments/h200_backward_tune.py --small
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

from tilegen.backends.triton.backward import BackwardConfig

REQUIRED_MS, AIM_MS = 24.0, 19.0
D = BackwardConfig()  # the current default: the reference row
#: (label, config): the default first; <= 16 deliberate candidates
CANDIDATES: list[tuple[str, BackwardConfig]] = [
    ("default", D),
    ("dq_pack", dataclasses.replace(D, dq_pack=True)),
    ("dkdv_pack", dataclasses.replace(D, dkdv_pack=True)),
    ("both packs", dataclasses.replace(D, dq_pack=True, dkdv_pack=True)),
    ("both packs, dq 2 stages", dataclasses.replace(D, dq_pack=True, dkdv_pack=True,
                                                    dq_stages=2)),
    ("both packs, dq 4 stages", dataclasses.replace(D, dq_pack=True, dkdv_pack=True,
                                                    dq_stages=4)),
    ("both packs, dkdv 1 stage", dataclasses.replace(D, dq_pack=True, dkdv_pack=True,
                                                     dkdv_stages=1)),
    ("both packs, dkdv 3 stages", dataclasses.replace(D, dq_pack=True, dkdv_pack=True,
                                                      dkdv_stages=3)),
    ("dkdv_pack, dkdv 3 stages", dataclasses.replace(D, dkdv_pack=True, dkdv_stages=3)),
    ("dq_pack, dq 4 stages", dataclasses.replace(D, dq_pack=True, dq_stages=4)),
    ("dq 32-key steps (sub-tiles past vbs skipped)", dataclasses.replace(D, dq_block_n=32)),
    ("dq 32-key steps, 4 stages", dataclasses.replace(D, dq_block_n=32, dq_stages=4)),
    ("default again (noise)", D),
]
RESULTS: dict = {"candidates": {}, "errors": {}}
JSON_PATH: list[Path] = []


def _dump() -> None:
    if JSON_PATH:
        try:
            JSON_PATH[0].parent.mkdir(parents=True, exist_ok=True)
            JSON_PATH[0].write_text(json.dumps(RESULTS, indent=2, default=str) + "\n")
        except OSError as exc:
            print(f"could not write {JSON_PATH[0]}: {exc}", file=sys.stderr)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timer(device: str, rep: int):
    if device == "cuda":
        import triton

        return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=rep,
                                                        return_mode="median"))

    def once(fn):  # CPU check: one call, wall clock (not a measurement)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return once


def per_kernel(op, args, maps, cfg, device: str) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            op.launch_backward(*args, inverse=maps, config=cfg)
        _sync(device)
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us and "tilegen" in e.key:
            out[e.key[:60]] = round(us / 5 / 1000, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms) per timing")
    ap.add_argument("--small", action="store_true",
                    help="tiny workload with partial cubes (CPU under TRITON_INTERPRET=1: checks "
                    "the script and every candidate's gradients, times nothing real)")
    ap.add_argument("--only", default="", help="comma-separated candidate indices")
    a = ap.parse_args(argv)
    JSON_PATH.append(Path(a.json or Path(os.environ.get("OUT", "out")) / "h200_backward_tune.json"))

    import tilegen
    from tilegen import bench, captures
    from tilegen.backends.triton.backward import backward_maps

    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = (tilegen.Spec(grid=(5, 6, 8), num_heads=2, head_dim=64, topk=3) if a.small
            else tilegen.Spec())
    cap = captures.synthesize_for(spec, seed=a.seed, device=device, outlier=True)
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    heads = bench.backward_heads(spec.num_heads, cap.get("outlier_heads") or ())
    do = bench.backward_do(q, a.seed)
    RESULTS["workload"] = {"q": list(q.shape), "topk_idx": list(idx.shape), "heads": heads,
                           "seed": a.seed, "device": torch.cuda.get_device_name()
                           if device == "cuda" else "cpu", "torch": torch.__version__}
    op = tilegen.load(spec, backend="triton")
    RESULTS["forward_config"] = op.config.name
    nkv = idx.shape[2]
    t0 = time.time()
    _o, lse, o_acc = op.forward_for_grad(q, k, v, idx, vbs)
    ref = bench.grad_reference(spec, (q, k, v, idx, vbs), do, heads)
    _sync(device)
    RESULTS["reference_s"] = round(time.time() - t0, 1)
    print(f"fp32 reference gradients on heads {heads}: {RESULTS['reference_s']} s", flush=True)
    args = (do, q, k, v, o_acc, lse, idx, vbs)
    dim = 2 if spec.layout == "bshd" else 1
    sel = torch.tensor(heads, device=device)
    time_it = timer(device, a.rep)
    chosen = [int(i) for i in a.only.split(",") if i] or range(len(CANDIDATES))
    profiled = {}
    for i in chosen:
        label, cfg = CANDIDATES[i]
        key = f"{i:02d} {label}"
        row: dict = {"config": cfg.name}
        RESULTS["candidates"][key] = row
        t1 = time.time()
        print(f"== {key}: {cfg.name}", flush=True)
        try:
            grads = op.launch_backward(*args, config=cfg)
            _sync(device)
            scores = {n: captures.grad_score(g.index_select(dim, sel), r, layout=spec.layout)
                      for n, g, r in zip(("dq", "dk", "dv"), grads, ref, strict=True)}
            del grads
            row["passed"] = all(s.passed for s in scores.values())
            row["min_cos"] = min(s.min_head_cos for s in scores.values())
            row["max_rel"] = max(s.max_abs / s.ref_max if s.ref_max else 0.0
                                 for s in scores.values())
            row["scores"] = {n: str(s) for n, s in scores.items()}
            maps = backward_maps(idx, None, vbs, nkv, spec.block_kv, cfg.fit(spec))
            row["bwd_ms"] = time_it(lambda cfg=cfg: op.launch_backward(*args, config=cfg))
            row["kernels_ms"] = time_it(
                lambda cfg=cfg, maps=maps: op.launch_backward(*args, inverse=maps, config=cfg))
            row["maps_ms"] = time_it(
                lambda cfg=cfg: backward_maps(idx, None, vbs, nkv, spec.block_kv, cfg.fit(spec)))
            if device == "cuda" and (i == 0 or label == "both packs"):
                profiled[key] = per_kernel(op, args, maps, cfg, device)
                row["per_kernel_ms"] = profiled[key]
            del maps
        except Exception as exc:  # noqa: BLE001 - one candidate's failure is data
            row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
            traceback.print_exc()
            if device == "cuda":
                torch.cuda.empty_cache()
        row["s"] = round(time.time() - t1, 1)
        print(f"   {json.dumps({k2: v2 for k2, v2 in row.items() if k2 != 'scores'})}",
              flush=True)
        _dump()
    # the table, last
    rows = RESULTS["candidates"]
    base = next((r.get("bwd_ms") for r in rows.values() if r.get("bwd_ms")), None)
    lines = [f"backward variants, {RESULTS['workload']['device']}, q {tuple(q.shape)}, "
             f"forward {op.config.name}; gradients on heads {heads} "
             f"(required <= {REQUIRED_MS} ms, aim {AIM_MS})",
             f"{'candidate':<48} {'bwd ms':>8} {'kern ms':>8} {'maps ms':>8} {'vs def':>7} "
             f"{'grads':>5} {'min cos':>9} {'max rel':>8}"]
    for key, r in rows.items():
        if "error" in r:
            lines.append(f"{key:<48} ERROR {r['error'][:70]}")
            continue
        speed = f"{base / r['bwd_ms']:.2f}x" if base and r.get("bwd_ms") else "-"
        lines.append(f"{key:<48} {r.get('bwd_ms', float('nan')):8.3f} "
                     f"{r.get('kernels_ms', float('nan')):8.3f} "
                     f"{r.get('maps_ms', float('nan')):8.3f} {speed:>7} "
                     f"{'PASS' if r.get('passed') else 'FAIL':>5} {r.get('min_cos', 0):9.6f} "
                     f"{r.get('max_rel', 0):8.1e}")
    for key, per in profiled.items():
        lines.append(f"per kernel, {key}: " + ", ".join(f"{n.removeprefix('tilegen_bsa_bwd_')} "
                                                        f"{ms:.2f}" for n, ms in per.items()))
    RESULTS["table"] = lines
    _dump()
    print("\n".join(lines), flush=True)
    return 0 if all(r.get("passed") for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
