"""Issue #19, session 34: what running the 8-bit op's pre-pass beside its kernel could save, an
upper bound before building it. The pre-pass (HBM-bound, 0.436 ms on an H100) and the kernel
(L2-to-SM and latency bound) run one after the other in the op; here they run on two streams
with no dependency between them (the kernel reads an earlier pass's outputs), so the time of
both together against their sum bounds what an overlap with per-head ready flags could take.

    git apply bench/experiments/s34_overlap_prepass.patch      (the knob: not landed)
    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/gpu_s34_overlap.py \
        --out $OUT/overlap.json

Measured on an H100 (bench/RESULTS.md, session 34): the bound is nothing (two streams +0.009 ms
against the sum) and the knob 4-6% slower, so it is not landed.

Rows (default workload, TOPK 78 unless --topk, the shipped winner of this card; best of the
rounds, each `triton.testing.do_bench`): the pass alone (`op.quantize(..., with_q=False)`, what
the op runs), the kernel + plan alone (`from_quantized`), both in one stream, both on two
streams (the pass's stream at high priority, then at low), and the op's call.

Then the built overlap (``overlap_prepass``: the pass as a grid of one wave counting each
head's work, the kernel by programmatic dependent launch waiting for its head's count) on one
consumer a CTA, K ring 2, V ring 3, the linear P (`ONE_CONSUMER`: the pass's programs, 128
registers each, leave room for one such CTA an SM; a two-consumer CTA takes the whole register
file), at `quant.READY_PROGRAMS_PER_SM` of 2, 4 and 8 (8 leaves the kernel no room: a
control): checked first (o and lse of ten calls bit-equal to the same config's without the
knob on the default workload, and the quantized rule on 4 heads), then timed beside the rows
above (and that config's op without the knob), with the ready pass alone.
``--prebuild``: the knob's cubins here (no GPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import tilegen
from tilegen import captures
from tilegen.spec import Spec

PER_SM = (2, 4, 8)
#: the config the knob is measured on (the H200 winner's rings and copies, the linear P)
ONE_CONSUMER = {"consumers": 1, "k_stages": 2, "v_stages": 3, "kv_tile": 128,
                "kv_copies": "bulk", "q_in_kernel": True, "p_exp": "linear", "row_sum": "mma"}


def overlap_config(cfg):
    from tilegen.backends.cuda import wgmma

    return wgmma.config(**{**dict(cfg.options), "overlap_prepass": True})


def one_consumer():
    from tilegen.backends.cuda import wgmma

    return wgmma.config(**ONE_CONSUMER)


def prebuild() -> None:
    from tilegen import winners
    from tilegen.backends.cuda.nvcc import compile_cuda
    from tilegen.paths import ROOT
    from tilegen.targets import get_target

    winners.SHIPPED_DIR = ROOT / "tuning_db"
    target = get_target("sm_90")
    spec = Spec(quant="int8_fp8")
    configs = {device: winners.find_winner(spec, target, backend="cuda",
                                           device_name=device).config
               for device in ("NVIDIA H200", "NVIDIA H100 80GB HBM3")}
    for name, cfg in {**configs, "one consumer": one_consumer()}.items():
        for knob in (False, True):
            op = tilegen.load(spec, overlap_config(cfg) if knob else cfg, backend="cuda",
                              target="sm_90")
            for lse in (True, False):
                run = op._launch_for(lse)
                art = compile_cuda(run.source, target, None, run.digest)
            print(f"prebuilt {name} (overlap_prepass {knob}): {art.registers} registers, "
                  f"spills {art.spill_bytes}", flush=True)


_EMULATED: dict = {}


def check(op, beside, spec) -> dict:
    """o and lse of ten calls of `beside` against the shipped op's, bit for bit, then the
    quantized rule on 4 heads (the outlier among them; the emulation computed once)."""
    from tilegen import quant
    from tilegen.reference import attention_fp32

    out: dict = {}
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=3, device="cuda")
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    o0, l0 = op(q, k, v, idx, vbs)
    same = 0
    for _ in range(10):
        o1, l1 = beside(q, k, v, idx, vbs)
        same += int(torch.equal(o0.view(torch.int16), o1.view(torch.int16))
                    and torch.equal(l0.view(torch.int32), l1.view(torch.int32)))
    out["bit_equal_calls"] = same
    small = Spec(quant="int8_fp8", num_heads=4)
    cap = captures.synthesize_for(small.replace(quant="none"), seed=1)
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    if not _EMULATED:
        qi = op.quantize(q.cuda(), k.cuda(), v.cuda(), vbs.cuda())
        cpu = type(qi)(**{f: (getattr(qi, f).cpu() if isinstance(getattr(qi, f), torch.Tensor)
                              else getattr(qi, f)) for f in qi.__dataclass_fields__})
        _EMULATED["o32"] = attention_fp32(q, k, v, idx, vbs)[0]
        _EMULATED["emul"] = quant.emulate(q, k, v, idx, vbs, quantized=cpu,
                                          p_exp=quant.p_exp_of(op))
    o32, emul = _EMULATED["o32"], _EMULATED["emul"]
    o, _ = beside(q.cuda(), k.cuda(), v.cuda(), idx.cuda(), vbs.cuda())
    s = captures.quant_score(o.cpu(), o32.to(q.dtype), emul, o32, vbs=vbs)
    out.update(score=str(s), passed=bool(s.passed))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="overlap.json")
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prebuild", action="store_true")
    args = ap.parse_args()
    if args.prebuild:
        prebuild()
        return 0
    from triton.testing import do_bench

    from tilegen import quant

    spec = Spec(quant="int8_fp8")
    if args.topk is not None:
        spec = spec.replace(topk=args.topk)
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=0, device="cuda")
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    op = tilegen.load(spec, backend="cuda")
    print(f"{torch.cuda.get_device_name()}: {op!r}", flush=True)
    qi = op.quantize(q, k, v, vbs)  # with Q: from_quantized takes Q8

    def prepass():  # the op's own pass (with_q=False: its kernel quantizes Q)
        return quant.quantize(q, k, v, vbs, with_q=False, **quant_layout_of(op))

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

    # the bound first, printed before anything of the knob runs (a hang there loses nothing)
    first = {"pass alone": prepass, "kernel + plan alone": kernel, "both, one stream": serial,
             "both, two streams (pass high)": beside(streams["pass high"])}
    print("bound: " + ", ".join(f"{n} {do_bench(fn, rep=200):.3f}" for n, fn in first.items()),
          flush=True)
    base_op = tilegen.load(spec, one_consumer(), backend="cuda", target="sm_90")
    beside_op = tilegen.load(spec, overlap_config(one_consumer()), backend="cuda",
                             target="sm_90")
    checks = {}
    for per_sm in PER_SM:
        quant.READY_PROGRAMS_PER_SM = per_sm
        checks[per_sm] = check(base_op, beside_op, spec)
        print(f"overlap_prepass, {per_sm} programs an SM: {checks[per_sm]}", flush=True)
    ready = torch.zeros(q.shape[0] * q.shape[2], dtype=torch.int32, device="cuda")

    def at(per_sm, fn):
        def run():
            quant.READY_PROGRAMS_PER_SM = per_sm
            return fn()
        return run

    rows = {"pass alone": prepass, "kernel + plan alone": kernel, "both, one stream": serial,
            **{f"both, two streams ({name})": beside(p) for name, p in streams.items()},
            "op": lambda: op(q, k, v, idx, vbs, return_lse=False),
            "op with lse": lambda: op(q, k, v, idx, vbs),
            "op 1c K2 V3 linear": lambda: base_op(q, k, v, idx, vbs, return_lse=False),
            "op 1c K2 V3 linear with lse": lambda: base_op(q, k, v, idx, vbs)}
    for per_sm in PER_SM:
        rows[f"ready pass alone, {per_sm} an SM"] = at(per_sm, lambda: quant.quantize(
            q, k, v, vbs, with_q=False, ready=ready, **quant_layout_of(op)))
        rows[f"op 1c overlap_prepass, {per_sm} an SM"] = at(
            per_sm, lambda: beside_op(q, k, v, idx, vbs, return_lse=False))
        rows[f"op 1c overlap_prepass with lse, {per_sm} an SM"] = at(
            per_sm, lambda: beside_op(q, k, v, idx, vbs))
    times: dict[str, list[float]] = {name: [] for name in rows}
    for rnd in range(args.reps):
        for name, fn in rows.items():
            times[name].append(do_bench(fn, rep=200))
        print(f"round {rnd}: " + ", ".join(f"{n} {t[-1]:.3f}" for n, t in times.items()),
              flush=True)
    best = {n: min(t) for n, t in times.items()}
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "op": repr(op), "topk": spec.topk, "times_ms": times, "best_ms": best,
           "checks": {str(k): v for k, v in checks.items()}}
    Path(args.out).write_text(json.dumps(res, indent=2))
    total = best["pass alone"] + best["kernel + plan alone"]
    print(f"\n{res['device']}, TOPK {spec.topk}, best of {args.reps} (ms)")
    print("| what | ms | vs pass + kernel |")
    print("|---|---|---|")
    for n, t in best.items():
        print(f"| {n} | {t:.3f} | {t - total:+.3f} |")
    for per_sm, c in checks.items():
        print(f"check, {per_sm} an SM: {c['bit_equal_calls']}/10 calls bit-equal, {c['score']}")
    return 0


def quant_layout_of(op) -> dict:
    from tilegen.backends.cuda.wgmma_op import quant_layout

    return quant_layout(dict(op.config.options).get("kv_copies") == "bulk")


if __name__ == "__main__":
    raise SystemExit(main())
