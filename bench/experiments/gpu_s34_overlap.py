"""Issue #19, session 34: what running the 8-bit op's pre-pass beside its kernel could save, an
upper bound before building it. The pre-pass (HBM-bound, 0.436 ms on an H100) and the kernel
(L2-to-SM and latency bound) run one after the other in the op; here they run on two streams
with no dependency between them (the kernel reads an earlier pass's outputs), so the time of
both together against their sum bounds what an overlap with per-head ready flags could take.

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/gpu_s34_overlap.py \
        --out $OUT/overlap.json

Rows (default workload, TOPK 78 unless --topk, the shipped winner of this card; best of the
rounds, each `triton.testing.do_bench`): the pass alone (`op.quantize(..., with_q=False)`, what
the op runs), the kernel + plan alone (`from_quantized`), both in one stream, both on two
streams (the pass's stream at high priority, then at low), and the op's call.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import tilegen
from tilegen import captures
from tilegen.spec import Spec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="overlap.json")
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from triton.testing import do_bench

    spec = Spec(quant="int8_fp8")
    if args.topk is not None:
        spec = spec.replace(topk=args.topk)
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=0, device="cuda")
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    op = tilegen.load(spec, backend="cuda")
    print(f"{torch.cuda.get_device_name()}: {op!r}", flush=True)
    qi = op.quantize(q, k, v, vbs)  # with Q: from_quantized takes Q8

    def prepass():
        return op.quantize(q, k, v, vbs, with_q=False)

    def kernel():
        return op.from_quantized(qi, idx, vbs, return_lse=False)

    def serial():
        prepass()
        kernel()

    lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") \
        else (0, -1)
    streams = {"pass high": (torch.cuda.Stream(priority=hi), torch.cuda.Stream(priority=lo)),
               "pass low": (torch.cuda.Stream(priority=lo), torch.cuda.Stream(priority=hi)),
               "same priority": (torch.cuda.Stream(), torch.cuda.Stream())}

    def beside(pair):
        s_pass, s_kernel = pair

        def run():
            cur = torch.cuda.current_stream()
            s_pass.wait_stream(cur)
            s_kernel.wait_stream(cur)
            with torch.cuda.stream(s_pass):
                prepass()
            with torch.cuda.stream(s_kernel):
                kernel()
            cur.wait_stream(s_pass)
            cur.wait_stream(s_kernel)
        return run

    rows = {"pass alone": prepass, "kernel + plan alone": kernel, "both, one stream": serial,
            **{f"both, two streams ({name})": beside(p) for name, p in streams.items()},
            "op": lambda: op(q, k, v, idx, vbs, return_lse=False)}
    times: dict[str, list[float]] = {name: [] for name in rows}
    for rnd in range(args.reps):
        for name, fn in rows.items():
            times[name].append(do_bench(fn, rep=200))
        print(f"round {rnd}: " + ", ".join(f"{n} {t[-1]:.3f}" for n, t in times.items()),
              flush=True)
    best = {n: min(t) for n, t in times.items()}
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "op": repr(op), "topk": spec.topk, "times_ms": times, "best_ms": best}
    Path(args.out).write_text(json.dumps(res, indent=2))
    total = best["pass alone"] + best["kernel + plan alone"]
    print(f"\n{res['device']}, TOPK {spec.topk}, best of {args.reps} (ms)")
    print("| what | ms | vs pass + kernel |")
    print("|---|---|---|")
    for n, t in best.items():
        print(f"| {n} | {t:.3f} | {t - total:+.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
