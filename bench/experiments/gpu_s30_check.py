"""Issue #19, sessions 30-31: the CUDA 8-bit kernel of this checkout's working tree (session 30:
session 29's bookkeeping cut and Q quantized in the kernel, `q_in_kernel`; session 31: the
scale floors that keep padded query rows finite) against the shipped one (HEAD's tree, unpacked
into a directory by gpu_s30_prepare.sh), on the same GPU, in two processes.

    # the shipped kernel: its tree on PYTHONPATH, its own cache
    PYTHONPATH=.s28 TILEGEN_CACHE_DIR=.s28/.kcache python3 bench/experiments/gpu_s30_check.py \
        --role ref --dump /tmp/s30ref --out $OUT/ref.json
    # this checkout's, each config with Q from the pre-pass and with q_in_kernel
    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/gpu_s30_check.py \
        --role new --against /tmp/s30ref --out $OUT/check.json
    ... --prebuild      compile the role's cubins for sm_90a here (no GPU)

Per config and copy mode (TMA boxes, bulk copies): the ref process saves o and lse of the
user's call; the new one compares its o bit for bit with them (all rows, and the real rows
apart: padded query rows may differ where a change makes them finite), with and without
``q_in_kernel``, lse on the real rows bit for bit and its largest difference, and whether o is
finite everywhere; and, on partial cubes whose padded query rows hold inf and NaN, the op's call
against `from_quantized`. Both time, in rounds: the user's call (pre-pass included) without
lse and with it (the default call), and kernel + plan (`from_quantized`). The table is printed
last; the rows are also in the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import tilegen
from tilegen import captures
from tilegen.backends.cuda import wgmma
from tilegen.spec import Spec

BASE = dict(wgmma.QUANT_DEFAULTS)
#: config label -> wgmma knobs
CONFIGS: dict[str, dict] = {
    "1c K2 V3 (H200 winner)": {**BASE, "k_stages": 2, "v_stages": 3},
    "1c K3 V2 (default)": BASE,
    "2c K2 V1": {**BASE, "consumers": 2, "k_stages": 2, "v_stages": 1},
    "3c K2 V1 kv64": {**BASE, "consumers": 3, "k_stages": 2, "v_stages": 1, "kv_tile": 64},
}
COPIES = ("tma", "bulk")
#: small specs with partial cubes, whose padded query rows get inf and NaN (the pre-pass zeroes
#: them; the kernel's quantization must give the same Q8), in both 16-bit dtypes
PADDED = {dtype: Spec(quant="int8_fp8", grid=(6, 10, 14), num_heads=2, topk=8, dtype=dtype)
          for dtype in ("bf16", "fp16")}


def variants(role: str, only: str = ""):
    """(label, copies, q_in_kernel, config); the shipped tree has no q_in_kernel knob.
    ``only``: the configs whose label starts with it (a short call: the H200 winner's)."""
    for label, knobs in CONFIGS.items():
        if not label.startswith(only):
            continue
        for copies in COPIES:
            for qk in ((False,) if role == "ref" else (False, True)):
                extra = {"q_in_kernel": True} if qk else {}
                yield label, copies, qk, wgmma.config(**knobs, kv_copies=copies, **extra)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN included (torch.equal is False wherever both hold NaN, as the padded
    query rows of partial cubes do: bench/NOTES.md, session 30)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


def load(spec: Spec, cfg):
    return tilegen.load(spec, cfg, backend="cuda", target="sm_90")


def padded_configs():
    for copies in COPIES:
        yield copies, wgmma.config(**CONFIGS["1c K2 V3 (H200 winner)"], kv_copies=copies,
                                   q_in_kernel=True)


def prebuild(role: str) -> None:
    from tilegen.backends.cuda.nvcc import compile_cuda
    from tilegen.targets import get_target

    target = get_target("sm_90")
    spec = Spec(quant="int8_fp8")
    builds = [(spec, f"{label} {copies} q_in_kernel={qk}", cfg)
              for label, copies, qk, cfg in variants(role)]
    if role == "new":
        builds += [(pspec, f"padded {dtype} {copies}", cfg) for dtype, pspec in PADDED.items()
                   for copies, cfg in padded_configs()]
    for spec_, name, cfg in builds:
        op = load(spec_, cfg)
        for lse in (True, False):
            run = op._launch_for(lse)
            art = compile_cuda(run.source, target, None, run.digest)
        print(f"prebuilt {role} {name}: {art.registers} registers, spills {art.spill_bytes}",
              flush=True)


def padded_rows_check(res: dict) -> None:
    """Partial cubes whose padded query rows hold inf, -inf and NaN: the op's call (Q quantized
    in the kernel) against from_quantized (Q8 from the pre-pass, which zeroes those rows), o and
    lse bit-equal, in bf16 and fp16, boxes and bulk copies."""
    for dtype, spec in PADDED.items():
        cap = captures.synthesize_for(spec.replace(quant="none"), seed=1, device="cuda")
        q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
        pad = torch.arange(q.shape[1], device="cuda") % 64 >= vbs.repeat_interleave(64)
        q = q.clone()
        garbage = torch.tensor([float("inf"), float("-inf"), float("nan")], device="cuda")
        n = int(pad.sum()) * q.shape[2] * q.shape[3]
        q[:, pad] = garbage.repeat(n // 3 + 1)[:n].view(1, -1, *q.shape[2:]).to(q.dtype)
        for copies, cfg in padded_configs():
            op = load(spec, cfg)
            o1, lse1 = op(q, k, v, idx, vbs)
            o2, lse2 = op.from_quantized(op.quantize(q, k, v, vbs), idx, vbs)
            check = {"padded_rows": int(pad.sum()), "o_equal": same_bits(o1, o2),
                     "lse_equal": same_bits(lse1, lse2),
                     "o_real_finite": bool(torch.isfinite(o1[:, ~pad]).all()),
                     "o_finite": bool(torch.isfinite(o1).all())}
            res["checks"][f"padded {dtype} {copies}"] = check
            print(f"padded {dtype} {copies}: {check}", flush=True)


def key_of(label: str, copies: str) -> str:
    return f"{label} {copies}".replace(" ", "_").replace("(", "").replace(")", "")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("ref", "new"), required=True)
    ap.add_argument("--out", default="check.json")
    ap.add_argument("--dump", type=Path, help="ref: where o and lse go")
    ap.add_argument("--against", type=Path, help="new: the ref's --dump")
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--reps", type=int, default=2, help="rounds over all variants")
    ap.add_argument("--only", default="", help="configs whose label starts with this")
    args = ap.parse_args()
    if args.prebuild:
        prebuild(args.role)
        return 0
    from triton.testing import do_bench

    spec = Spec(quant="int8_fp8")
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=0, device="cuda")
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    inputs_sum = [float(t.float().sum()) for t in (q, k, v)] + [int(idx.long().sum())]
    res = {"role": args.role, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "tilegen_file": tilegen.__file__,
           "inputs_sum": inputs_sum, "rows": [], "checks": {}}
    ops = {(label, copies, qk): load(spec, cfg)
           for label, copies, qk, cfg in variants(args.role, args.only)}
    if args.role == "ref":
        args.dump.mkdir(parents=True, exist_ok=True)
        for (label, copies, _), op in ops.items():
            o, lse = op(q, k, v, idx, vbs)
            torch.save({"o": o.cpu(), "lse": lse.cpu()}, args.dump / f"{key_of(label, copies)}.pt")
        (args.dump / "inputs.json").write_text(json.dumps(inputs_sum))
    else:
        ref_inputs = json.loads((args.against / "inputs.json").read_text())
        res["inputs_equal"] = ref_inputs == inputs_sum
        print(f"inputs equal to the ref's: {res['inputs_equal']}", flush=True)
        padded_rows_check(res)
        # the real query rows (session 30's kernel wrote NaN in the padded ones, session 31's
        # finite values: compared apart)
        real = (torch.arange(q.shape[1]) % 64 < vbs.cpu().repeat_interleave(64))
        for (label, copies, qk), op in ops.items():
            ref = torch.load(args.against / f"{key_of(label, copies)}.pt")
            o, lse = op(q, k, v, idx, vbs)
            o, lse = o.cpu(), lse.cpu()
            fin = torch.isfinite(ref["lse"]) & real
            check = {"o_equal": same_bits(o, ref["o"]),
                     "o_real_equal": same_bits(o[:, real], ref["o"][:, real]),
                     "o_finite": bool(torch.isfinite(o).all()),
                     "o_padded_finite": bool(torch.isfinite(o[:, ~real]).all()),
                     "lse_real_equal": same_bits(lse[..., real], ref["lse"][..., real]),
                     "lse_max_abs_vs_ref": float((lse[fin] - ref["lse"][fin]).abs().max())}
            res["checks"][f"{label} {copies} q_in_kernel={qk}"] = check
            print(f"{label} {copies} q_in_kernel={qk}: {check}", flush=True)
    times = {key: {"op": [], "op_lse": [], "kernel": []} for key in ops}
    t0 = time.perf_counter()
    for rnd in range(args.reps):
        for key, op in ops.items():
            qi = op.quantize(q, k, v, vbs)
            t = times[key]
            t["op"].append(do_bench(lambda op=op: op(q, k, v, idx, vbs, return_lse=False),
                                    rep=200))
            t["op_lse"].append(do_bench(lambda op=op: op(q, k, v, idx, vbs), rep=200))
            t["kernel"].append(do_bench(
                lambda op=op, qi=qi: op.from_quantized(qi, idx, vbs, return_lse=False), rep=200))
            print(f"round {rnd} {key}: op {t['op'][-1]:.3f} ms, with lse {t['op_lse'][-1]:.3f}, "
                  f"kernel + plan {t['kernel'][-1]:.3f}", flush=True)
    for (label, copies, qk), t in times.items():
        res["rows"].append({"config": label, "copies": copies, "q_in_kernel": qk,
                            **{f"{n}_ms": t[n] for n in t},
                            **{f"best_{n}_ms": min(t[n]) for n in t}})
    Path(args.out).write_text(json.dumps(res, indent=2))
    if args.role == "ref":
        (args.dump / "ref.json").write_text(json.dumps(res, indent=2))
    ref_rows = {}
    if args.role == "new":
        ref_res = json.loads(Path(args.against / "ref.json").read_text())
        ref_rows = {(r["config"], r["copies"]): r for r in ref_res["rows"]}
    print(f"\n{res['device']} ({args.role}), {time.perf_counter() - t0:.0f} s, TOPK {spec.topk}, "
          f"{spec.num_heads} heads, best of {args.reps}")
    for name, check in res["checks"].items():
        print(f"{name}: {check}")
    print("| config | copies | q_in_kernel | op ms | op with lse ms | kernel + plan ms | op vs "
          "shipped | kernel + plan vs shipped |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        ref = ref_rows.get((r["config"], r["copies"]))
        vs = (f"{r['best_op_ms'] / ref['best_op_ms']:.3f} | "
              f"{r['best_kernel_ms'] / ref['best_kernel_ms']:.3f}") if ref else "- | -"
        print(f"| {r['config']} | {r['copies']} | {r['q_in_kernel']} | {r['best_op_ms']:.3f} | "
              f"{r['best_op_lse_ms']:.3f} | {r['best_kernel_ms']:.3f} | {vs} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
