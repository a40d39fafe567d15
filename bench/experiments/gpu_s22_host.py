"""Question (issues #20, #19; session 22): how much of the op's time, as `tilegen bench` times
it (do_bench: L2 flushed, then the call between two events), is the host (validation, plan
launch, tensor maps, launch), and which calls cost it? On the default workload (synthesized
capture, seed 0), for the bf16 default op and the 8-bit op as loaded:

    PYTHONPATH=$PWD python3 bench/experiments/gpu_s22_host.py --out $OUT/host.json

Rows: do_bench of the op (``return_lse=False``), of the bare launch, and of a CUDA-graph replay
of the op (no host work at all); the host's microseconds a call (30 calls queued, no sync);
the kernels of one call with their device times (torch.profiler); a cProfile of 30 calls (top
functions by own time, in the log). The table is printed last.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import time

import torch
from triton.testing import do_bench


def _ms(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=200))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quant", default="none,int8_fp8")
    args = ap.parse_args()
    import tilegen
    from tilegen import captures
    from tilegen.encodings import validate

    cap = captures.synthesize(seed=0, device="cuda")
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "ops": {}}
    table = []
    for mode in args.quant.split(","):
        spec = tilegen.Spec(quant=mode)
        op = tilegen.load(spec)
        r: dict = {"op": repr(op)}
        res["ops"][mode] = r
        call = functools.partial(op, q, k, v, idx, vbs, return_lse=False)
        call()
        torch.cuda.synchronize()
        r["ms_op"] = _ms(call)
        shapes = validate(op.spec, q, k, v, idx, vbs)
        out = (torch.empty_like(q), torch.empty((shapes.batch, shapes.heads, shapes.seq_len),
                                                dtype=torch.float32, device=q.device))
        try:
            r["ms_bare"] = _ms(functools.partial(op.launch, q, k, v, idx, vbs, shapes=shapes,
                                                 out=out, store_lse=False))
        except Exception as exc:  # noqa: BLE001
            r["ms_bare"] = float("nan")
            r["bare_error"] = f"{type(exc).__name__}: {exc}"
        # a CUDA graph of the call: the device's time with no host work between launches
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    call()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            r["ms_graph"] = _ms(graph.replay)
        except Exception as exc:  # noqa: BLE001
            r["ms_graph"] = float("nan")
            r["graph_error"] = f"{type(exc).__name__}: {exc}"
        # host microseconds a call, 30 queued (the GPU is busy for all of them)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(30):
            call()
        r["host_us_per_call"] = (time.perf_counter() - t0) / 30 * 1e6
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(30):
            call()
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        r["cprofile"] = buf.getvalue()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(3):
                call()
            torch.cuda.synchronize()
        kernels = {}
        for e in p.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA or getattr(
                    e, "self_device_time_total", 0) > 0:
                kernels[e.key[:90]] = {"us_each": e.self_device_time_total / max(e.count, 1),
                                       "count": e.count}
        r["kernels"] = kernels
        print(f"== {mode}: {r['op']}", flush=True)
        for name, kr in kernels.items():
            print(f"   kernel {kr['us_each']:9.1f} us x{kr['count']}  {name}", flush=True)
        print(r["cprofile"][:6000], flush=True)
        table.append((mode, r))
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    # the selection's kernels (mean_pool_topk on the capture's cubes)
    from torch.profiler import ProfilerActivity, profile

    from tilegen import sparsity

    topk = idx.shape[-1]
    sparsity.mean_pool_topk(q, k, vbs, topk)
    res["ms_select"] = _ms(lambda: sparsity.mean_pool_topk(q, k, vbs, topk))
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            sparsity.mean_pool_topk(q, k, vbs, topk)
        torch.cuda.synchronize()
    print(f"== select: {res['ms_select']:.3f} ms", flush=True)
    for e in p.key_averages():
        if getattr(e, "self_device_time_total", 0) > 0:
            print(f"   kernel {e.self_device_time_total / max(e.count, 1):9.1f} us x{e.count}  "
                  f"{e.key[:90]}", flush=True)
    print("\n| op | ms op | ms bare | ms graph | host us/call |\n|---|---|---|---|---|")
    for mode, r in table:
        print(f"| {mode} | {r['ms_op']:.3f} | {r['ms_bare']:.3f} | {r['ms_graph']:.3f} | "
              f"{r['host_us_per_call']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
