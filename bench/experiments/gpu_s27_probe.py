"""Issue #19, session 27: what each part of the 8-bit kernel's softmax costs, by removing it.

Sessions 16-22 cut instructions from the CUDA 8-bit kernel's consumer loop (3-10% of them at a
time) and each moved the one-consumer kernel by 2% or less; session 26 left it at ~5.2 ms on
the H200, where issue #19's 1.5x needs ~3.9. These probes take whole parts out of the loop
(`QuantSoftmax` in templates/cuda/include/tilegen/cuda/sm90/softmax_8bit.cuh), so their numbers
are wrong by design and no check is run on them: what is measured is how much time is left
without the part, which bounds what any rewrite of that part can buy.

    no_exp   the 64 exponentials a tile (MUFU.EX2) gone: p is the exponent's argument
    no_max   the row max gone (its FMNMX tree and quad shuffles): m stays 0 after the first tile
    no_sum   the row sums gone (64 FADD a tile)
    bare     all three: what is left is S, its conversion, one FFMA a score, the pack, P V and
             O's update, the ring and the loads

Each probe is a text edit of the header inside the variant's own source snapshot
(`CxxSource.headers`), so the shipped headers and their cache keys stay as they are. The probes
run at the 8-bit defaults (one consumer, 128-key tiles) and at two consumers a CTA.

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/gpu_s27_probe.py \
        --out $OUT/probe.json            (on the GPU; --prebuild: compile here, no GPU)

The table is printed last; the rows are also in the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path

import torch

import tilegen
from tilegen import captures
from tilegen.backends.cuda import wgmma
from tilegen.spec import Spec

HEADER = "tilegen/cuda/sm90/softmax_8bit.cuh"
#: probe -> (old text, new text) edits of HEADER; every old text must be found exactly once
EDITS: dict[str, tuple[str, str]] = {
    "no_exp": ("f[i] = fast_exp2(fmaf(f[i], coef[h][key_half(i)], -shift[h]));",
               "f[i] = fmaf(f[i], coef[h][key_half(i)], -shift[h]);"),
    "no_max": ("const float m_new = fmaxf(m[h], Fragment::quad_max(mx));",
               "const float m_new = kFirst ? 0.f : m[h];"),
    "no_sum": ("sum[h] += f[i];", ""),
}
PROBES: dict[str, tuple[str, ...]] = {
    "no_exp": ("no_exp",), "no_max": ("no_max",), "no_sum": ("no_sum",),
    "bare": ("no_exp", "no_max", "no_sum"),
}
CONFIGS: dict[str, dict] = {
    "1c": dict(wgmma.QUANT_DEFAULTS),
    "2c": {**wgmma.QUANT_DEFAULTS, "consumers": 2, "k_stages": 2, "v_stages": 1},
}


def probe_source(source, edits: tuple[str, ...]):
    """`source` as a CxxSource whose snapshot of HEADER has `edits` applied."""
    from tilegen.backends.cuda.nvcc import include_dir
    from tilegen.identity import CxxSource

    if not isinstance(source, CxxSource):
        source = CxxSource.including(source, include_dir())
    headers = dict(source.headers)
    text = headers[HEADER].decode()
    for name in edits:
        old, new = EDITS[name]
        if text.count(old) != 1:
            raise RuntimeError(f"probe {name}: {old!r} is not in {HEADER} exactly once")
        text = text.replace(old, new)
    headers[HEADER] = text.encode()
    return dataclasses.replace(source, headers=tuple(sorted(headers.items())))


def load(spec: Spec, config: str, probe: str | None):
    op = tilegen.load(spec, wgmma.config(**CONFIGS[config]), backend="cuda")
    if probe:
        for lse in (True, False):
            run = op._launch_for(lse)
            run.source = probe_source(run.source, PROBES[probe])
            run.digest = hashlib.sha256(f"{run.digest}|probe:{probe}".encode()).hexdigest()
    return op


def labels() -> list[tuple[str, str | None]]:
    return [(c, p) for c in CONFIGS for p in (None, *PROBES)]


def prebuild() -> None:
    from tilegen.backends.cuda.nvcc import compile_cuda
    from tilegen.targets import get_target

    target = get_target("sm_90")
    spec = Spec(quant="int8_fp8")
    for config, probe in labels():
        op = tilegen.load(spec, wgmma.config(**CONFIGS[config]), backend="cuda", target="sm_90")
        for lse in (True, False):
            run = op._launch_for(lse)
            source, digest = run.source, run.digest
            if probe:
                source = probe_source(source, PROBES[probe])
                digest = hashlib.sha256(f"{digest}|probe:{probe}".encode()).hexdigest()
            art = compile_cuda(source, target, None, digest)
            if not lse:
                print(f"prebuilt {config} {probe or 'shipped'}: {art.registers} registers, "
                      f"spills {art.spill_bytes}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe.json")
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--reps", type=int, default=2, help="rounds over all variants")
    args = ap.parse_args()
    if args.prebuild:
        prebuild()
        return 0
    from triton.testing import do_bench

    spec = Spec(quant="int8_fp8")
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=0, device="cuda")
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "tilegen": tilegen.__version__, "rows": []}
    ops = {(c, p): load(spec, c, p) for c, p in labels()}
    qi = ops[("1c", None)].quantize(q, k, v, vbs)
    times: dict[tuple[str, str | None], list[float]] = {key: [] for key in ops}
    t0 = time.perf_counter()
    for rnd in range(args.reps):  # rounds, so that a drift of the clocks shows as spread
        for key, op in ops.items():
            ms = do_bench(lambda op=op: op.from_quantized(qi, idx, vbs, return_lse=False),
                          rep=300)
            times[key].append(ms)
            print(f"round {rnd} {key[0]} {key[1] or 'shipped'}: {ms:.3f} ms", flush=True)
    for (c, p), ts in times.items():
        base = min(times[(c, None)])
        res["rows"].append({"config": c, "probe": p or "shipped", "kernel_plan_ms": ts,
                            "best_ms": min(ts), "vs_shipped": min(ts) / base})
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\n{res['device']}, {time.perf_counter() - t0:.0f} s, TOPK {spec.topk}, "
          f"{spec.num_heads} heads, kernel + plan (`from_quantized`), best of {args.reps}")
    print("| config | probe | best ms | all ms | vs shipped |")
    print("|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['config']} | {r['probe']} | {r['best_ms']:.3f} | "
              f"{', '.join(f'{t:.3f}' for t in r['kernel_plan_ms'])} | {r['vs_shipped']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
