"""Issue #19, session 27: what each part of the 8-bit kernel costs, by removing it.

Sessions 16-22 cut instructions from the CUDA 8-bit kernel's consumer loop (3-10% of them at a
time) and each moved the one-consumer kernel by 2% or less; session 26 left it at ~5.2 ms on
the H200, where issue #19's 1.5x needs ~3.9. These probes take whole parts out of the kernel
(`QuantSoftmax` in templates/cuda/include/tilegen/cuda/sm90/softmax_8bit.cuh, the consumer and
producer in lut_attention_8bit.cuh), so their numbers are wrong by design and no check is run
on them: what is measured is how much time is left without the part, which bounds what any
rewrite of that part can buy. (The bulk probes were the exception: they moved the same bytes
another way, so their o was checked bit-equal to the shipped kernel's.)

    no_exp    the 64 exponentials a tile (MUFU.EX2) gone: p is the exponent's argument
    no_max    the row max gone (its FMNMX tree and quad shuffles): m stays 0 after the first tile
    no_sum    the row sums gone (64 FADD a tile)
    bare      all three: what is left is S, its conversion, one FFMA a score, the pack, P V and
              O's update, the ring and the loads
    no_pv     the P V MMAs gone (the accumulator keeps a stand-in dependence on P)
    no_mma    both MMAs gone (S a cheap stand-in from the stage index): the softmax on junk
    no_loads  the producer copies no K or V tile (only the key scales; the MMAs read stale
              shared memory): the L2 -> SM traffic gone; no_k_loads, no_v_loads: one of them
    and their combinations (bare_no_mma, bare_no_loads, ...). Session 27's bulk-copy probes
    (v_bulk, k_bulk: host-tiled copies through unused arguments) became the product's
    ``kv_copies="bulk"`` in session 28, before they ran; `--set bulk` now takes the probes
    above on that config (1c_bulk) beside the boxes' (1c).

Each probe is a text edit of the headers inside the variant's own source snapshot
(`CxxSource.headers`), so the shipped headers and their cache keys stay as they are.
Run 1 (the softmax probes, before `--set` existed; now `--set softmax`): at one and two
consumers a CTA; runs 2-3
(`--set parts`): the MMAs and the loads at one consumer; `--set bulk`: the same bytes in fewer,
larger copies.

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/gpu_s27_probe.py \
        --set parts --out $OUT/probe.json            (on the GPU; --prebuild: compile here)

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

SOFTMAX = "tilegen/cuda/sm90/softmax_8bit.cuh"
KERNEL = "tilegen/cuda/sm90/lut_attention_8bit.cuh"
#: the producer's copy of a K8 half and of a V^T half (a TMA box, or with kv_copies "bulk" since
#: session 28 one bulk copy from the pre-pass's tiles)
K_COPY = """if constexpr (T::kBulkKv)
              bulk_load(ring.k_tile(s) + u * T::kHalfBytes, half_tile(a.k8_tiles, key),
                        T::kHalfBytes, ring.k_full(s));
            else
              tma_load(ring.k_tile(s) + u * T::kHalfBytes, maps.k8, ring.k_full(s), rows.col,
                       rows.row0 + key);"""
V_COPY = """if constexpr (T::kBulkKv)
              bulk_load(ring.v_tile(s) + u * T::kHalfBytes, half_tile(a.vt_tiles, key_prev[u]),
                        T::kHalfBytes, ring.v_full(s));
            else
              tma_load(ring.v_tile(s) + u * T::kHalfBytes, maps.vt, ring.v_full(s),
                       key_prev[u], vt_row);"""
#: edit -> [(header, old text, new text)]; every old text must be in its header at least once
#: (every occurrence is replaced)
EDITS: dict[str, list[tuple[str, str, str]]] = {
    "no_exp": [(SOFTMAX, "f[i] = fast_exp2(fmaf(f[i], coef[h][key_half(i)], -shift[h]));",
                "f[i] = fmaf(f[i], coef[h][key_half(i)], -shift[h]);")],
    "no_max": [(SOFTMAX, "const float m_new = fmaxf(m[h], Fragment::quad_max(mx));",
                "const float m_new = kFirst ? 0.f : m[h];")],
    "no_sum": [(SOFTMAX, "sum[h] += f[i];", "")],
    "no_s": [(KERNEL, "Mma::qk(s, q_tile, ring.k_tile(kst));",
              "for (int i_ = 0; i_ < Mma::kSRegs; ++i_) "
              "asm volatile(\"mov.b32 %0, %1;\" : \"=r\"(s[i_]) : \"r\"(kst + i_));")],
    "no_pv": [(KERNEL, "Mma::template pv_part<kParts, decltype(part)::value>(acc, p_in, v_tile);",
               "acc[0] = __int_as_float(p_in[0] ^ v_tile);")],
    "no_k_loads": [
        (KERNEL, "barrier_expect_bytes(ring.k_full(s), T::kTileBytes + T::kScaleCopyBytes);",
         "barrier_expect_bytes(ring.k_full(s), T::kScaleCopyBytes);"),
        (KERNEL, K_COPY, ";"),
    ],
    "no_v_loads": [
        (KERNEL, "barrier_expect_bytes(ring.v_full(s), T::kTileBytes);",
         "barrier_expect_bytes(ring.v_full(s), 0);"),
        (KERNEL, V_COPY, ";"),
    ],
}
EDITS["no_loads"] = EDITS["no_k_loads"] + EDITS["no_v_loads"]
SOFTMAX_PARTS = ("no_exp", "no_max", "no_sum")
#: probe -> edits, by probe set
SETS: dict[str, dict[str, tuple[str, ...]]] = {
    "softmax": {"no_exp": ("no_exp",), "no_max": ("no_max",), "no_sum": ("no_sum",),
                "bare": SOFTMAX_PARTS},
    "parts": {"bare": SOFTMAX_PARTS, "no_pv": ("no_pv",), "no_mma": ("no_s", "no_pv"),
              "no_loads": ("no_loads",), "no_k_loads": ("no_k_loads",),
              "no_v_loads": ("no_v_loads",), "bare_no_pv": (*SOFTMAX_PARTS, "no_pv"),
              "bare_no_mma": (*SOFTMAX_PARTS, "no_s", "no_pv"),
              "bare_no_loads": (*SOFTMAX_PARTS, "no_loads"),
              "no_mma_no_loads": ("no_s", "no_pv", "no_loads"),
              "bare_no_mma_no_loads": (*SOFTMAX_PARTS, "no_s", "no_pv", "no_loads")},
    # session 28: the product's bulk copies (kv_copies "bulk", config 1c_bulk) beside the
    # boxes: what bare leaves (the load path) and what no_loads leaves (the consumer path)
    "bulk": {"bare": SOFTMAX_PARTS, "no_loads": ("no_loads",),
             "bare_no_loads": (*SOFTMAX_PARTS, "no_loads")},
}
CONFIGS: dict[str, dict] = {
    "1c": dict(wgmma.QUANT_DEFAULTS),
    "2c": {**wgmma.QUANT_DEFAULTS, "consumers": 2, "k_stages": 2, "v_stages": 1},
    "1c_bulk": {**wgmma.QUANT_DEFAULTS, "kv_copies": "bulk"},
}
SET_CONFIGS = {"softmax": ("1c", "2c"), "parts": ("1c",), "bulk": ("1c", "1c_bulk")}


def with_headers(source, change):
    """`source` as a CxxSource whose header snapshot is `change(headers)` (a dict of name ->
    bytes, changed in place): the kernel of a probe, or of another session's headers."""
    from tilegen.backends.cuda.nvcc import include_dir
    from tilegen.identity import CxxSource

    if not isinstance(source, CxxSource):
        source = CxxSource.including(source, include_dir())
    headers = dict(source.headers)
    change(headers)
    return dataclasses.replace(source, headers=tuple(sorted(headers.items())))


def probe_source(source, edits: tuple[str, ...]):
    """`source` as a CxxSource whose header snapshot has `edits` applied."""
    def apply(headers: dict) -> None:
        for name in edits:
            for header, old, new in EDITS[name]:
                text = headers[header].decode()
                if old not in text:
                    raise RuntimeError(f"probe {name}: {old!r} is not in {header}")
                headers[header] = text.replace(old, new).encode()

    return with_headers(source, apply)


def probed(run, probe: str, edits: tuple[str, ...]):
    """`run`'s source with `edits` and its digest with the probe's name (its own cache key)."""
    source = probe_source(run.source, edits)
    return source, hashlib.sha256(f"{run.digest}|probe:{probe}".encode()).hexdigest()


def load(spec: Spec, config: str, probe: str | None, probes: dict):
    """The op of `config` with `probe`'s edits."""
    op = tilegen.load(spec, wgmma.config(**CONFIGS[config]), backend="cuda")
    if probe:
        for lse in (True, False):
            run = op._launch_for(lse)
            run.source, run.digest = probed(run, probe, probes[probe])
    return op


def labels(probe_set: str) -> list[tuple[str, str | None]]:
    return [(c, p) for c in SET_CONFIGS[probe_set] for p in (None, *SETS[probe_set])]


def prebuild(probe_set: str) -> None:
    from tilegen.backends.cuda.nvcc import compile_cuda
    from tilegen.targets import get_target

    target = get_target("sm_90")
    spec = Spec(quant="int8_fp8")
    probes = SETS[probe_set]
    for config, probe in labels(probe_set):
        op = tilegen.load(spec, wgmma.config(**CONFIGS[config]), backend="cuda", target="sm_90")
        for lse in (True, False):
            run = op._launch_for(lse)
            source, digest = run.source, run.digest
            if probe:
                source, digest = probed(run, probe, probes[probe])
            art = compile_cuda(source, target, None, digest)
            if not lse:
                print(f"prebuilt {config} {probe or 'shipped'}: {art.registers} registers, "
                      f"spills {art.spill_bytes}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe.json")
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--set", default="softmax", choices=sorted(SETS))
    ap.add_argument("--reps", type=int, default=2, help="rounds over all variants")
    args = ap.parse_args()
    if args.prebuild:
        prebuild(args.set)
        return 0
    from triton.testing import do_bench

    spec = Spec(quant="int8_fp8")
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=0, device="cuda")
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "tilegen": tilegen.__version__, "set": args.set, "rows": []}
    ops = {(c, p): load(spec, c, p, SETS[args.set]) for c, p in labels(args.set)}
    # each config's own pre-pass layout (the bulk copies read tiles)
    qis = {c: ops[(c, None)].quantize(q, k, v, vbs) for c in SET_CONFIGS[args.set]}
    times: dict[tuple[str, str | None], list[float]] = {key: [] for key in ops}
    t0 = time.perf_counter()
    for rnd in range(args.reps):  # rounds, so that a drift of the clocks shows as spread
        for key, op in ops.items():
            ms = do_bench(lambda op=op, qi=qis[key[0]]: op.from_quantized(qi, idx, vbs,
                                                                         return_lse=False),
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
