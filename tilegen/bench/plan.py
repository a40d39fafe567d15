"""The bench plan: argument parsing, workload specs, the TOPK sweep, FLOP counts, variants."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tilegen import encoding_registry
from tilegen.config import KernelConfig
from tilegen.encodings import reference_lut
from tilegen.spec import Spec

#: the sparsity sweep of issue #8: 95%, 87.5% (the default spec), 80%, 70% and 50% of 624 cubes
SWEEP_TOPK: tuple[int, ...] = (31, 78, 125, 187, 312)

FLOPS_FORMULA = ("FLOPs = 4 * D * sum over (b, h, query row) of the real keys the row attends; "
                 "all S query rows count, padded ones included (the kernels compute them); the "
                 "real keys of KV cube c are vbs[c]. TFLOP/s = FLOPs / ms / 1e9. tflops_slots "
                 "counts every key slot multiplied instead (TOPK*block_kv per row; S for dense).")

#: backward FLOPs per forward FLOP (5 matmuls against 2: FlashAttention's nominal count)
BACKWARD_FLOPS_FACTOR = 2.5

BACKWARD_FLOPS_FORMULA = (
    "backward FLOPs = 2.5 * forward FLOPs (the forward's real-key count above: 5 matmuls "
    "against 2, the nominal count; the Triton split dQ | dK/dV kernels execute 7, the Gluon "
    "backward with the stored dS^T 5); fwd+bwd rows count "
    "3.5 * forward FLOPs; the inverse map counts none. TFLOP/s = FLOPs / ms / 1e9.")

#: the backward rows: label -> (FLOPs per forward FLOP or None, what is timed)
BACKWARD_ROWS: dict[str, tuple[float | None, str]] = {
    "fwd+bwd": (1.0 + BACKWARD_FLOPS_FACTOR,
                "block_sparse_attention(q, k, v, idx, vbs) with requires_grad q/k/v, then "
                "torch.autograd.grad(o, (q, k, v), dO); grads scored"),
    "fwd (grad)": (1.0, "block_sparse_attention(q, k, v, idx, vbs) with requires_grad q/k/v, "
                        "the forward alone (what autograd saves: lse and O's rounding residual)"),
    "reference fwd+bwd": (1.0 + BACKWARD_FLOPS_FACTOR,
                          "the reference training step: tilegen.load(spec, backend='triton') "
                          "with grad_forward_family='triton' and BackwardConfig() (the Triton "
                          "forward and backward kernels), op(q, k, v, idx, vbs) then "
                          "torch.autograd.grad; grads scored"),
    "bwd kernels": (BACKWARD_FLOPS_FACTOR,
                    "tilegen.load(spec, backend='triton').launch_backward(dO, ..., "
                    "inverse=<prebuilt>, config=op.backward_config); grads scored"),
    "inverse map": (None, "tilegen.backends.triton.backward.backward_maps(idx, None, vbs, NKV, "
                    "64, op.backward_config): the maps a backward builds per call"),
    "flex fwd+bwd": (1.0 + BACKWARD_FLOPS_FACTOR,
                     "the flex peer (same BlockMask, torch.compile) + torch.autograd.grad; "
                     "a failure is recorded, not fatal"),
}

#: dense SDPA peers: label -> torch.nn.attention.SDPBackend member
DENSE_PEERS: dict[str, str] = {"sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-flash": "FLASH_ATTENTION"}

NO_GPU_MESSAGE = ("tilegen bench needs a CUDA GPU; no GPU found (torch.cuda.is_available() is "
                  "False). `tilegen bench --dry-run` prints the plan.")

DEFAULT_WARMUP_MS = 25
DEFAULT_REP_MS = 100


# ============================================================================ argument parsing


def parse_int_list(text: str) -> list[int]:
    """``"31,78,125"`` -> ``[31, 78, 125]`` (positive ints, duplicates dropped, order kept)."""
    out: list[int] = []
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not an integer (in {text!r})") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value} must be a positive integer (in {text!r})")
        if value not in out:
            out.append(value)
    if not out:
        raise argparse.ArgumentTypeError(f"no integers in {text!r}")
    return out


def parse_grid(text: str) -> tuple[int, int, int]:
    """``"21,30,52"`` or ``"21x30x52"`` -> ``(21, 30, 52)``: the latent (T, H, W) grid."""
    parts = str(text).lower().replace("x", ",").replace(" ", "").split(",")
    try:
        values = tuple(int(p) for p in parts if p)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--grid wants T,H,W integers, got {text!r}") from None
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--grid wants three positive integers T,H,W, "
                                         f"got {text!r}")
    return values  # type: ignore[return-value]


def parse_backends(text: str) -> list[str]:
    """``"triton,gluon"`` -> ``["triton", "gluon"]``, checked against the backend registry."""
    from tilegen import backends

    names = [n for n in str(text).replace(" ", "").split(",") if n]
    known = backends.names()
    bad = [n for n in names if n not in known]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {bad}; known: {list(known)}")
    return list(dict.fromkeys(names))


def encoding_spec(spec: Spec, encoding: str | None = None,
                  window: Sequence[int] | None = None) -> Spec:
    """The spec with `--encoding` / `--window` applied (a window implies sliding_tile). Invalid
    combinations raise ValueError naming the field."""
    if encoding is None and window is None:
        return spec
    encoding = encoding or ("sliding_tile" if window is not None else spec.encoding)
    entry = encoding_registry.REGISTRY.get(encoding)
    if entry is None or not entry.needs_window:  # an unknown name: Spec.replace says so
        if window is not None:
            raise ValueError(f"--window applies to --encoding sliding_tile, not {encoding!r}")
        return spec.replace(encoding=encoding, window=None)
    return spec.replace(encoding=encoding, window=tuple(window) if window is not None
                        else spec.window)


def workload_spec(spec: Spec, grid: Sequence[int] | None = None,
                  heads: int | None = None) -> Spec:
    """The spec with `--grid` / `--heads` applied (workload fields only; the kernel is the
    same). Invalid combinations raise ValueError naming the field."""
    changes: dict[str, Any] = {}
    if grid is not None:
        changes["grid"] = tuple(grid)
    if heads is not None:
        changes["num_heads"] = heads
    if not changes:
        return spec
    if "grid" in changes and spec.topk > _num_cubes(spec, changes["grid"]):
        # the spec's own TOPK may not fit a smaller grid; clip it (the sweep sets it per point)
        changes["topk"] = _num_cubes(spec, changes["grid"])
    return spec.replace(**changes)


def _num_cubes(spec: Spec, grid: Sequence[int]) -> int:
    return math.prod(-(-g // c) for g, c in zip(grid, spec.cube, strict=True))


def sweep_topks(spec: Spec, topk: Sequence[int] | None = None, sweep: bool = False
                ) -> tuple[list[int], list[int]]:
    """The TOPK values to run: `topk` if given, else `SWEEP_TOPK` with `sweep`, else the spec's
    own. Returns (kept, dropped): values above the grid's NKV are dropped (ValueError if none
    is left)."""
    if not spec.encoding_info.has_lut_rows:
        if topk or sweep:
            raise ValueError("--topk and --sweep set the LUT width of lut and mask specs; a "
                             "sliding_tile spec attends its window (--window)")
        return [spec.topk], []  # one point: the window decides the pattern, TOPK is unused
    wanted = list(topk) if topk else list(SWEEP_TOPK) if sweep else [spec.topk]
    nkv = spec.num_cubes
    kept = [t for t in wanted if 1 <= t <= nkv]
    dropped = [t for t in wanted if t not in kept]
    if not kept:
        raise ValueError(f"no TOPK value in {wanted} fits the grid {spec.grid} "
                         f"(NKV = {nkv} cubes)")
    return kept, dropped


# ============================================================================ FLOPs


def real_key_flops(topk_idx: torch.Tensor, vbs: torch.Tensor, block_q: int, head_dim: int,
                   counts: torch.Tensor | None = None) -> float:
    """4 * D * sum over (b, h, query row) of the real keys attended: each of the block_q rows of
    query cube i attends vbs[c] keys of every cube c in its LUT row (the first counts[row]
    entries when counts is given; padded query rows count)."""
    keys = vbs.to(torch.float64)[topk_idx.long()]
    if counts is not None:
        slot = torch.arange(topk_idx.shape[-1], device=topk_idx.device)
        keys = keys * (slot < counts.long()[..., None])
    return float(4.0 * head_dim * block_q * keys.sum())


def slot_flops(topk_idx: torch.Tensor, block_q: int, block_kv: int, head_dim: int,
               counts: torch.Tensor | None = None) -> float:
    """4 * D * rows * TOPK * block_kv: every key slot the sparse kernel multiplies (the sum of
    counts instead of rows * TOPK when counts is given)."""
    B, H, NQ, K = topk_idx.shape
    cubes = float(counts.sum()) if counts is not None else float(B * H * NQ * K)
    return 4.0 * head_dim * block_q * cubes * block_kv


def dense_flops(batch: int, heads: int, seq_len: int, head_dim: int, vbs: torch.Tensor
                ) -> tuple[float, float]:
    """Dense attention: (real-key FLOPs, all-slot FLOPs). Every query row attends every real key
    (sum of vbs) - and every padding slot too, which only the second figure counts."""
    rows = batch * heads * seq_len
    return (4.0 * head_dim * rows * float(vbs.to(torch.float64).sum()),
            4.0 * head_dim * rows * seq_len)


def backward_flops(forward_flops: float, label: str = "bwd kernels") -> float | None:
    """FLOPs of a backward row (`BACKWARD_ROWS`): 2.5x the forward's for the backward kernels,
    3.5x for forward + backward, None for the inverse map."""
    factor = BACKWARD_ROWS[label][0]
    return None if factor is None else factor * forward_flops


def flops_of(cap: dict, spec: Spec) -> float:
    """Real-key FLOPs of a capture under the spec's encoding (`real_key_flops` of its
    `tilegen.encodings.reference_lut`); kept for `tilegen.tune`."""
    idx, counts = reference_lut(spec, cap)
    return real_key_flops(idx, cap["vbs"], spec.block_q, spec.head_dim, counts)


# ============================================================================ plan


@dataclass(frozen=True)
class Variant:
    label: str  # row name: "reference", "default", a family name, "flex", "sdpa-cudnn", ...
    kind: str  # "tilegen" (decides the exit status) or "peer"
    backend: str  # kernel family, or "flex" / "cudnn" / "flash"
    calls: str  # what is timed, for the plan and the JSON


@dataclass
class Plan:
    spec: Spec
    captures: str = "synthetic"
    seeds: int = 1
    topks: list[int] = field(default_factory=list)  # empty: capture files bring their own
    dropped_topks: list[int] = field(default_factory=list)
    variants: list[Variant] = field(default_factory=list)
    config: KernelConfig | None = None
    json_path: Path = Path("bench_results.json")
    plot_path: Path = Path("bench_results.png")
    warmup_ms: int = DEFAULT_WARMUP_MS
    rep_ms: int = DEFAULT_REP_MS
    backward_variants: list[Variant] = field(default_factory=list)  # empty: no --backward
    #: --quant auto: the 8-bit rows are those of the GPU the bench runs on (`resolve_quant`)
    quant_auto: bool = False

    def resolve_quant(self) -> None:
        """With --quant auto, add a row for each 8-bit mode a family computes on this GPU,
        after the bf16 rows of tilegen (so a dry run touches no GPU)."""
        if not self.quant_auto:
            return
        self.quant_auto = False
        at = max(i for i, v in enumerate(self.variants) if v.kind == "tilegen") + 1
        self.variants[at:at] = [quant_variant(m) for m in quant_modes_for(self.spec)]

    @property
    def backward(self) -> bool:
        return bool(self.backward_variants)

    @property
    def synthetic(self) -> bool:
        return self.captures == "synthetic"

    def describe(self) -> str:
        s = self.spec
        lines = [f"tilegen bench plan: spec {s.short_hash} ({s.encoding}, {s.dtype}, "
                 f"{s.layout}, D={s.head_dim}, blocks {s.block_q}x{s.block_kv}, cube {s.cube})",
                 f"  workload: batch {s.batch}, grid {s.grid} -> NKV {s.num_cubes} cubes, "
                 f"S {s.seq_len}, heads {s.num_heads}"]
        if self.synthetic and s.encoding_info.needs_window:
            seeds = f"seeds 0..{self.seeds - 1}" if self.seeds > 1 else "seed 0"
            lines.append(f"  captures: synthetic (seeded, with an outlier head), {seeds}; window "
                         f"{s.window}: {s.kv_per_query:g} KV cubes per query cube "
                         f"({100 * (1 - s.kv_per_query / s.num_cubes):.1f}% sparsity)")
        elif self.synthetic:
            spars = ", ".join(f"{t} ({100 * (1 - t / s.num_cubes):.1f}%)" for t in self.topks)
            seeds = f"seeds 0..{self.seeds - 1}" if self.seeds > 1 else "seed 0"
            lines.append(f"  captures: synthetic (seeded, with an outlier head), {seeds} x TOPK "
                         f"(sparsity) {spars}")
            if self.dropped_topks:
                lines.append(f"  dropped TOPK {self.dropped_topks}: above NKV={s.num_cubes}")
        else:
            lines.append(f"  captures: the .pt files in {self.captures} (each its own TOPK)")
        lines.append(f"  variants ({len(self.variants)}):")
        for v in self.variants:
            lines.append(f"    {v.label:18s} {v.kind:8s} {v.calls}")
        if self.quant_auto:
            lines.append("    + a quant-<mode> row for each 8-bit mode a kernel family computes "
                         "on the GPU the bench runs on (--quant auto)")
        lines.append("  check: reference variant vs the fp32 oracle on a subset of heads "
                     "(outlier head included)")
        if self.backward:
            lines.append(f"  backward ({len(self.backward_variants)} rows, the gradient op's "
                         "kernels (its BackwardConfig: Triton or Gluon), random "
                         "dO seeded per capture):")
            for v in self.backward_variants:
                lines.append(f"    {v.label:18s} {v.kind:8s} {v.calls}")
            lines.append("  backward check: dq, dk, dv vs tilegen.reference.attention_grads_fp32 "
                         "on the outlier head(s), the first and the last head (grad_score: "
                         "finite, cos >= 0.9999, max|d| <= 1e-2 max|ref|)")
        n_points = (len(self.topks) * self.seeds if self.synthetic
                    else len(list(Path(self.captures).glob("*.pt"))))
        extra = (f" + {len(self.backward_variants)} backward row(s)" if self.backward
                 else "")
        lines.append(f"  runs: {n_points} capture(s) x {len(self.variants)} variant(s){extra}; "
                     f"do_bench warmup {self.warmup_ms} ms, rep {self.rep_ms} ms, median")
        lines.append(f"  writes: {self.json_path}, {self.plot_path}")
        lines.append(f"  {FLOPS_FORMULA}")
        if self.backward:
            lines.append(f"  {BACKWARD_FLOPS_FORMULA}")
        return "\n".join(lines)


def quant_variant(mode: str) -> Variant:
    return Variant(f"quant-{mode}", "tilegen", "auto",
                   f"tilegen.load(spec.replace(quant={mode!r})): op(..., return_lse=False), "
                   "pre-pass included; quantized rule vs the fp32 oracle and "
                   "tilegen.quant.emulate (check 4), launch")


def quant_modes_for(spec: Spec, quant: Sequence[str] | str = "auto") -> list[str]:
    """The 8-bit modes a bench of `spec` adds rows for: "auto" is every mode a kernel family
    computes on this machine's GPU (`tilegen.backends.with_quant`, the family's spec rules on the
    detected target; none without a GPU tilegen has a target for); an explicit list is checked
    against `Spec.quant`'s modes and runs wherever it is asked (a row that cannot run fails)."""
    from tilegen import backends
    from tilegen.spec import QUANT_MODES
    from tilegen.targets import detect_target

    if spec.quant != "none":
        raise ValueError(f"the bench's spec has quant={spec.quant!r}; the 8-bit rows come from "
                         "--quant beside the bf16 ones: give a spec with quant 'none'")
    if quant == "auto":
        target = detect_target()
        if target is None:
            return []
        return [m for m in QUANT_MODES[1:] if any(
            name in target.backends
            and not backends.get(name).spec_violations(spec.replace(quant=m), target)
            for name in backends.with_quant(m))]
    modes = [quant] if isinstance(quant, str) else list(quant)
    bad = [m for m in modes if m not in QUANT_MODES[1:]]
    if bad:
        raise ValueError(f"--quant {bad}: not 8-bit modes; allowed values: "
                         f"{list(QUANT_MODES[1:])}, auto or none")
    return modes


def default_plot_path(json_path: str | Path) -> Path:
    return Path(json_path).with_suffix(".png")


def make_plan(spec: Spec, captures_dir: str = "synthetic", *, seeds: int = 1,
              config: KernelConfig | None = None, topk: Sequence[int] | None = None,
              sweep: bool = False, grid: Sequence[int] | None = None, heads: int | None = None,
              backends: Sequence[str] = (), flex: bool = True, dense: bool = True,
              json_path: str | Path = "bench_results.json", plot_path: str | Path | None = None,
              warmup_ms: int = DEFAULT_WARMUP_MS, rep_ms: int = DEFAULT_REP_MS,
              backward: bool = False, encoding: str | None = None,
              window: Sequence[int] | None = None, quant: Sequence[str] | str = "auto") -> Plan:
    """Check the options and list what will run (no GPU needed). `encoding` / `window` bench
    another encoding (`encoding_spec`); for mask and sliding_tile a "lut" row runs the LUT op
    on the same pattern (`tilegen.encodings.reference_lut`), and FlexAttention's BlockMask is
    built from that pattern too. `quant`: the 8-bit modes to bench beside the bf16 rows
    (``quant-<mode>`` rows, `tilegen.load(spec.replace(quant=mode))`, scored by the quantized
    rule), "auto" for every mode a kernel family computes (`quant_modes_for`), () for none."""
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    if warmup_ms < 1 or rep_ms < 1:
        raise ValueError(f"--warmup and --rep are positive milliseconds, got {warmup_ms}, {rep_ms}")
    synthetic = captures_dir == "synthetic"
    if not synthetic and (topk or sweep or grid is not None or heads is not None):
        raise ValueError("--topk, --sweep, --grid and --heads shape synthetic captures; capture "
                         f"files ({captures_dir}) bring their own workload")
    if not synthetic and not Path(captures_dir).is_dir():
        raise FileNotFoundError(f"--captures {captures_dir}: not a directory (or 'synthetic')")
    spec = workload_spec(encoding_spec(spec, encoding, window), grid, heads)
    if backward and not spec.encoding_info.takes_lut:
        raise ValueError(f"--backward times the LUT encoding's backward rows; spec encoding "
                         f"is {spec.encoding!r}")
    topks, dropped = sweep_topks(spec, topk, sweep) if synthetic else ([], [])
    default_calls = ("tilegen.load(spec, --config)" if config is not None else "tilegen.load(spec)")
    variants = [
        Variant("reference", "tilegen", "triton",
                "tilegen.load(spec, reference_config(spec)): op(..., return_lse=False), launch"),
        Variant("config" if config is not None else "default", "tilegen", "auto",
                f"{default_calls}: op(..., return_lse=False), block_sparse_attention(...), "
                "launch"),
    ]
    if not spec.encoding_info.takes_lut:
        variants.append(Variant("lut", "tilegen", "auto",
                                "tilegen.load(LUT spec): op(q, k, v, idx, vbs, counts, "
                                "return_lse=False) on the same pattern, launch"))
    quant_auto = quant == "auto"
    if quant_auto:
        if spec.quant != "none":
            quant_modes_for(spec, ())  # the same error as an explicit list
    else:
        variants += [quant_variant(m) for m in quant_modes_for(spec, quant)]
    for name in backends:
        variants.append(Variant(name, "tilegen", name,
                                f"tilegen.load(spec, backend={name!r}): op(..., "
                                "return_lse=False), launch"))
    if flex:
        pattern = "LUT" if spec.encoding_info.takes_lut else f"{spec.encoding} pattern"
        variants.append(Variant("flex", "peer", "flex",
                                "torch.compile(flex_attention)(BHSD, BlockMask from the "
                                f"{pattern}, "
                                f"kernel_options BLOCK_M/N={spec.block_q}/{spec.block_kv})"))
    if dense:
        for label, member in DENSE_PEERS.items():
            variants.append(Variant(label, "peer", label.split("-")[1],
                                    f"dense scaled_dot_product_attention (BHSD) under "
                                    f"sdpa_kernel(SDPBackend.{member}); timed, not scored"))
    backward_variants = []
    if backward:
        for label, (_, calls) in BACKWARD_ROWS.items():
            if label == "flex fwd+bwd" and not flex:
                continue
            backward_variants.append(Variant(label, "backward",
                                             "flex" if label.startswith("flex") else "triton",
                                             calls))
    json_path = Path(json_path)
    return Plan(spec=spec, captures=captures_dir, seeds=seeds, topks=topks, dropped_topks=dropped,
                variants=variants, config=config, json_path=json_path,
                plot_path=Path(plot_path) if plot_path else default_plot_path(json_path),
                warmup_ms=warmup_ms, rep_ms=rep_ms, backward_variants=backward_variants,
                quant_auto=quant_auto)


