"""`tilegen bench`: every variant and peer in one process, on the same inputs, side by side.

Variants (all on the same q, k, v, topk_idx, vbs of each capture):

- ``reference``: the contract's reference variant, ``tilegen.load(spec, reference_config(spec))``;
  the base of every speedup and the output every other variant is scored against (unless the
  capture bundles its own ``o_ref``). It is itself checked against the fp32 oracle on a subset of
  heads that includes the outlier head(s) (row ``reference-vs-fp32``).
- ``default``: the tuned default, ``tilegen.load(spec)`` (whatever backend its winner is), or the
  ``--config`` variant; also timed through ``tilegen.ops.block_sparse_attention``
  (``ms_custom_op``).
- one row per kernel family asked for with ``--backends``: ``tilegen.load(spec, backend=name)``.
- ``flex`` (peer): ``torch.nn.attention.flex_attention`` compiled with ``torch.compile``, with a
  BlockMask built from the LUT (`flex_block_mask`: full cubes as full blocks, partial cubes as
  partial blocks whose ``mask_mod`` hides the padding past ``vbs``), 64x64 kernel blocks.
- ``sdpa-cudnn``, ``sdpa-flash`` (peers): dense ``scaled_dot_product_attention`` pinned to one
  backend (BHSD). Dense attention attends every key, padding included: it computes a different
  function, so it is timed, never scored.

Timings are ``triton.testing.do_bench`` medians (warmed; L2 flushed between repetitions):

- ``ms_op``: the op as users call it, ``op(q, k, v, idx, vbs, return_lse=False)`` (host-side
  validation, error-flag bookkeeping and output allocation included);
- ``ms_custom_op`` (default variant): ``block_sparse_attention(q, k, v, idx, vbs)``;
- ``ms_bare``: the bare kernel, ``op.launch(..., shapes=<validated once>, out=<preallocated>,
  store_lse=False)``;
- ``ms_mask`` (flex): building the BlockMask from the LUT (not part of ``ms_op``).

Peers get contiguous BHSD copies of q, k, v made outside the timed region (their native layout).

FLOPs (`FLOPS_FORMULA`): ``4 * D * sum over (b, h, query row) of the real keys that row attends``.
Every one of the S query rows counts, padded rows included (the kernels compute them); the real
keys of KV cube ``c`` are ``vbs[c]``. ``tflops = flops / ms_op / 1e9``. ``tflops_slots`` counts
every key slot the kernel multiplies instead (TOPK x 64 per row; S per row for dense attention).

A variant that fails (compile error, unsupported spec, OOM, FlexAttention not compiling) never
stops the bench: its row carries the error and the bench goes on. The exit status is 0 when
every tilegen row (and the fp32 check) passed, 1 otherwise, 2 without a CUDA GPU. Peers never
change it.

Backward (``--backward``; issue #10 item 5), on the same captures, after the forward variants,
for the Triton family (the one with backward kernels); rows of ``kind`` "backward", dO random
(seeded by the capture's seed), timed with the same timer:

- ``fwd+bwd``: ``block_sparse_attention(q, k, v, idx, vbs)`` on requires_grad q, k, v, then
  ``torch.autograd.grad(o, (q, k, v), dO)``: the whole training step of the op;
- ``bwd kernels``: ``op.launch_backward(dO, q, k, v, o_acc, lse, idx, vbs, inverse=<prebuilt>,
  config=op.backward_config)`` with ``op = tilegen.load(spec, backend="triton")`` and (o_acc,
  lse) from ``op.forward_for_grad``: the three backward kernels alone;
- ``inverse map``: ``inverse_map(idx, None, NKV)`` alone (torch; part of every real backward);
- ``flex fwd+bwd`` (peer): the FlexAttention peer (same compiled function, same BlockMask) forward
  plus ``torch.autograd.grad``; a compile failure is recorded in the row, never fatal.

The dq, dk, dv of ``fwd+bwd``, ``bwd kernels`` (and flex) are scored with the gradient rule
(`captures.grad_score`: finite, per-head cosine >= 0.9999, max|Δ| <= 1e-2 max|ref|) against the
fp32 autograd reference (`tilegen.reference.attention_grads_fp32`) recomputed on the heads
`backward_heads` picks (outlier head(s), first, last), one head at a time.
FLOPs (`BACKWARD_FLOPS_FORMULA`): the backward is 2.5x the forward's real-key FLOPs, fwd+bwd
3.5x. Backward rows are in the table and the JSON, not in the plot.

The pure parts (argument parsing, FLOP counting, the BlockMask index tensors, rows, JSON, table,
plot) run on the CPU and are tested in tests/test_bench.py; `run_points` takes the timer and the
op loader as arguments so the whole loop runs on the CPU too.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tilegen import captures
from tilegen.config import KernelConfig, reference_config
from tilegen.encodings import call_args, lut_spec, reference_lut, validate
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
    "against 2, the nominal count; the split dQ | dK/dV kernels execute 7); fwd+bwd rows count "
    "3.5 * forward FLOPs; the inverse map counts none. TFLOP/s = FLOPs / ms / 1e9.")

#: the backward rows: label -> (FLOPs per forward FLOP or None, what is timed)
BACKWARD_ROWS: dict[str, tuple[float | None, str]] = {
    "fwd+bwd": (1.0 + BACKWARD_FLOPS_FACTOR,
                "block_sparse_attention(q, k, v, idx, vbs) with requires_grad q/k/v, then "
                "torch.autograd.grad(o, (q, k, v), dO); grads scored"),
    "bwd kernels": (BACKWARD_FLOPS_FACTOR,
                    "tilegen.load(spec, backend='triton').launch_backward(dO, ..., "
                    "inverse=<prebuilt>, config=op.backward_config); grads scored"),
    "inverse map": (None, "tilegen.backends.triton.backward.inverse_map(idx, None, NKV)"),
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
    if encoding != "sliding_tile":
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
    if spec.encoding == "sliding_tile":
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


# ============================================================================ FlexAttention


def lut_block_tensors(topk_idx: torch.Tensor, vbs: torch.Tensor, block: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LUT as FlexAttention block tensors: ``(kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices)``, ``(B, H, NQ)`` and ``(B, H, NQ, NKV)`` int32.

    Selected cubes with ``vbs == block`` are *full* blocks (no mask_mod work); selected partial
    cubes are *partial* blocks, where the mask_mod hides the padding. Each row lists its selected
    cubes first, in ascending id order, then the unselected ones (ignored past the count). No
    value checks and no host sync (the op's own checks guard the LUT)."""
    B, H, NQ, _ = topk_idx.shape
    nkv = vbs.shape[0]
    selected = torch.zeros((B, H, NQ, nkv), dtype=torch.bool, device=topk_idx.device)
    selected.scatter_(-1, topk_idx.long(), True)
    full = (vbs == block).to(selected.device)

    def ordered(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = m.sum(dim=-1, dtype=torch.int32)
        ind = torch.argsort(m.to(torch.int32), dim=-1, descending=True, stable=True)
        return num.contiguous(), ind.to(torch.int32).contiguous()

    kv_num, kv_idx = ordered(selected & ~full)
    full_num, full_idx = ordered(selected & full)
    return kv_num, kv_idx, full_num, full_idx


def padding_mask_mod(vbs: torch.Tensor, block: int, lut_mask: torch.Tensor | None = None
                     ) -> Callable:
    """FlexAttention mask_mod: key slot ``kv`` is real iff ``kv % block < vbs[kv // block]``.

    The compiled kernel only visits the blocks the BlockMask lists, so the padding test is all it
    needs. Eager FlexAttention (no torch.compile; a debugging path) ignores the block lists and
    applies the mask_mod to every pair: pass ``lut_mask`` (``(B, H, NQ, NKV)`` bool) to get the
    exact block-sparse function there too."""
    if lut_mask is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx % block) < vbs[kv_idx // block]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            cube = kv_idx // block
            return lut_mask[b, h, q_idx // block, cube] & ((kv_idx % block) < vbs[cube])
    return mask_mod


def flex_block_mask(topk_idx: torch.Tensor, vbs: torch.Tensor, block: int,
                    mask_mod: Callable | None = None, *, exact: bool = False) -> Any:
    """A `torch.nn.attention.flex_attention.BlockMask` for the LUT, `block` x `block` blocks:
    `lut_block_tensors` plus `padding_mask_mod` (``exact=True`` makes the mask_mod carry the LUT
    as well, for eager FlexAttention)."""
    from torch.nn.attention.flex_attention import BlockMask

    kv_num, kv_idx, full_num, full_idx = lut_block_tensors(topk_idx, vbs, block)
    if mask_mod is None:
        lut_mask = None
        if exact:
            B, H, NQ, _ = topk_idx.shape
            lut_mask = torch.zeros((B, H, NQ, vbs.shape[0]), dtype=torch.bool,
                                   device=topk_idx.device)
            lut_mask.scatter_(-1, topk_idx.long(), True)
        mask_mod = padding_mask_mod(vbs, block, lut_mask)
    seq = topk_idx.shape[2] * block
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(seq, vbs.shape[0] * block))


class FlexPeer:
    """FlexAttention, compiled once: the compiled function and the mask_mod (with its vbs
    buffer) are kept across sweep points, so a new LUT of the same shape does not recompile.
    A compile failure is remembered and reported for later points without another attempt."""

    def __init__(self, compile: bool = True) -> None:
        self.compile = compile
        self.failed: str | None = None
        self.failed_backward: str | None = None
        self._fn: Callable | None = None
        self._mask_mods: dict[tuple, tuple[torch.Tensor, Callable]] = {}

    def function(self) -> Callable:
        if self._fn is None:
            from torch.nn.attention.flex_attention import flex_attention

            self._fn = (torch.compile(flex_attention, dynamic=False, fullgraph=True)
                        if self.compile else flex_attention)
        return self._fn

    def mask_mod(self, vbs: torch.Tensor, block: int) -> Callable | None:
        if not self.compile:
            return None  # eager: flex_block_mask(exact=True) builds the exact one per LUT
        key = (str(vbs.device), block, vbs.shape[0])
        found = self._mask_mods.get(key)
        if found is None:
            buf = vbs.clone()
            found = self._mask_mods[key] = (buf, padding_mask_mod(buf, block))
        else:
            found[0].copy_(vbs)
        return found[1]

    def block_mask(self, topk_idx: torch.Tensor, vbs: torch.Tensor, block: int) -> Any:
        return flex_block_mask(topk_idx, vbs, block, self.mask_mod(vbs, block),
                               exact=not self.compile)

    def call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any,
             scale: float, block: int) -> torch.Tensor:
        """flex_attention on BHSD tensors, `block` x `block` kernel tiles (matching the mask)."""
        return self.function()(q, k, v, block_mask=block_mask, scale=scale,
                               kernel_options={"BLOCK_M": block, "BLOCK_N": block})


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
        if self.synthetic and s.encoding == "sliding_tile":
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
        lines.append("  check: reference variant vs the fp32 oracle on a subset of heads "
                     "(outlier head included)")
        if self.backward:
            lines.append(f"  backward ({len(self.backward_variants)} rows, Triton family, random "
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


def default_plot_path(json_path: str | Path) -> Path:
    return Path(json_path).with_suffix(".png")


def make_plan(spec: Spec, captures_dir: str = "synthetic", *, seeds: int = 1,
              config: KernelConfig | None = None, topk: Sequence[int] | None = None,
              sweep: bool = False, grid: Sequence[int] | None = None, heads: int | None = None,
              backends: Sequence[str] = (), flex: bool = True, dense: bool = True,
              json_path: str | Path = "bench_results.json", plot_path: str | Path | None = None,
              warmup_ms: int = DEFAULT_WARMUP_MS, rep_ms: int = DEFAULT_REP_MS,
              backward: bool = False, encoding: str | None = None,
              window: Sequence[int] | None = None) -> Plan:
    """Check the options and list what will run (no GPU needed). `encoding` / `window` bench
    another encoding (`encoding_spec`); for mask and sliding_tile a "lut" row runs the LUT op
    on the same pattern (`tilegen.encodings.reference_lut`), and FlexAttention's BlockMask is
    built from that pattern too."""
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
    if backward and spec.encoding != "lut":
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
    if spec.encoding != "lut":
        variants.append(Variant("lut", "tilegen", "auto",
                                "tilegen.load(LUT spec): op(q, k, v, idx, vbs, counts, "
                                "return_lse=False) on the same pattern, launch"))
    for name in backends:
        variants.append(Variant(name, "tilegen", name,
                                f"tilegen.load(spec, backend={name!r}): op(..., "
                                "return_lse=False), launch"))
    if flex:
        pattern = "LUT" if spec.encoding == "lut" else f"{spec.encoding} pattern"
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
                warmup_ms=warmup_ms, rep_ms=rep_ms, backward_variants=backward_variants)


# ============================================================================ rows


@dataclass
class Row:
    """One line of the bench: one variant on one capture (see the module docstring)."""

    capture: str
    variant: str
    kind: str  # "tilegen", "peer", "oracle" or "backward"
    backend: str
    config: str
    topk: int
    num_kv_blocks: int
    sparsity: float  # 1 - TOPK / NKV
    grid: list[int]
    heads: int
    batch: int
    seq_len: int
    head_dim: int
    seed: int | None = None
    config_source: str | None = None
    ms_op: float | None = None
    ms_bare: float | None = None
    ms_custom_op: float | None = None
    ms_mask: float | None = None
    first_call_s: float | None = None
    flops: float | None = None
    flops_slots: float | None = None
    tflops: float | None = None
    tflops_bare: float | None = None
    tflops_slots: float | None = None
    speedup: float | None = None
    speedup_bare: float | None = None
    passed: bool | None = None  # None: not scored (dense peers)
    scored_against: str | None = None
    finite: bool | None = None
    min_head_cos: float | None = None
    max_abs: float | None = None
    mean_abs: float | None = None
    score: str | None = None
    heads_checked: list[int] | None = None
    error: str | None = None
    note: str | None = None
    device: str | None = None
    torch: str | None = None
    triton: str | None = None
    date: str | None = None

    def set_score(self, s: captures.Score, against: str) -> None:
        self.passed, self.scored_against, self.finite = s.passed, against, s.finite
        self.min_head_cos, self.max_abs, self.mean_abs = s.min_head_cos, s.max_abs, s.mean_abs
        self.score = str(s)

    def set_flops(self, flops: float, flops_slots: float) -> None:
        self.flops, self.flops_slots = flops, flops_slots
        self.update_rates()

    def update_rates(self) -> None:
        if self.flops is not None and self.ms_op:
            self.tflops = self.flops / self.ms_op / 1e9
            self.tflops_slots = (self.flops_slots / self.ms_op / 1e9
                                 if self.flops_slots is not None else None)
        if self.flops is not None and self.ms_bare:
            self.tflops_bare = self.flops / self.ms_bare / 1e9

    def add_note(self, text: str) -> None:
        text = " ".join(str(text).split())[:1000]
        self.note = text if not self.note else f"{self.note}; {text}"

    def fail(self, exc: BaseException | str) -> None:
        """Record an error: the row failed (tilegen rows) or did not run (peers)."""
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        text = " ".join(text.split())[:2000]
        self.error = text if self.error is None else f"{self.error}; {text}"
        if not self.is_peer or self.passed is not None:
            self.passed = False

    @property
    def is_peer(self) -> bool:
        """Peers (forward, and the backward's flex row) never change the exit status."""
        return self.kind == "peer" or (self.kind == "backward" and self.backend == "flex")

    @property
    def ok(self) -> bool:
        """Counts toward the exit status: tilegen and oracle rows must pass, with no error;
        backward rows must have no error and not fail their score (the inverse map and a
        ``fwd+bwd`` that could not run this spec's kernel are timed only)."""
        if self.is_peer:
            return True
        if self.kind == "backward":
            return self.error is None and self.passed is not False
        return self.passed is True and self.error is None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def fill_speedups(rows: list[Row]) -> None:
    """speedup = the reference variant's ms / this row's ms, per capture (op and bare)."""
    refs = {r.capture: r for r in rows if r.variant == "reference" and r.kind == "tilegen"}
    for r in rows:
        if r.kind == "backward":
            continue  # the forward reference is no base for a backward timing
        ref = refs.get(r.capture)
        if ref is None:
            continue
        if r.ms_op and ref.ms_op:
            r.speedup = ref.ms_op / r.ms_op
        if r.ms_bare and ref.ms_bare:
            r.speedup_bare = ref.ms_bare / r.ms_bare


def environment() -> dict[str, str]:
    import tilegen

    env = {"torch": torch.__version__, "tilegen": tilegen.__version__,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        env["triton"] = "missing"
    return env


def results_json(plan: Plan, rows: list[Row], env: dict[str, str],
                 command: str | None = None) -> dict[str, Any]:
    """The JSON document `tilegen bench` writes (schema "tilegen.bench/1")."""
    doc = {
        "schema": "tilegen.bench/1",
        "date": env.get("date"),
        "command": command,
        "device": env.get("device"),
        "torch": env.get("torch"),
        "triton": env.get("triton"),
        "tilegen": env.get("tilegen"),
        "spec": plan.spec.to_dict(),
        "captures": plan.captures,
        "topks": plan.topks,
        "seeds": plan.seeds,
        "flops_formula": FLOPS_FORMULA,
        "timing": {"timer": "triton.testing.do_bench", "return_mode": "median",
                   "warmup_ms": plan.warmup_ms, "rep_ms": plan.rep_ms},
        "variants": [dataclasses.asdict(v) for v in plan.variants],
        "passed": all(r.ok for r in rows),
        "rows": [r.to_dict() for r in rows],
    }
    if plan.backward:  # only with --backward: the JSON without it is unchanged
        doc["backward_flops_formula"] = BACKWARD_FLOPS_FORMULA
        doc["backward_variants"] = [dataclasses.asdict(v) for v in plan.backward_variants]
    return doc


def write_json(path: str | Path, doc: dict[str, Any]) -> Path:
    import json

    from tilegen.cache import atomic_write

    return atomic_write(path, json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")


# ============================================================================ table and plot


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _verdict(r: Row) -> str:
    if r.error:
        return ("ERROR " if r.passed is not None else "SKIPPED ") + r.error[:90]
    if r.passed is None:
        return "not scored"
    if r.passed:
        return "PASS"
    return ("FAIL " + ("non-finite " if not r.finite else "")
            + f"cos {_fmt(r.min_head_cos, '.6f')} max {_fmt(r.max_abs, '.1e')} "
              f"mean {_fmt(r.mean_abs, '.1e')}")


TABLE_COLUMNS = ("capture", "TOPK", "sparsity", "variant", "config", "ms op", "ms bare",
                 "TFLOP/s", "x ref", "result")


def _short_capture(r: Row) -> str:
    return f"seed{r.seed}" if r.capture.startswith("synthetic_seed") else r.capture


def table_cells(rows: list[Row]) -> list[tuple[str, ...]]:
    out = []
    for r in rows:
        ms_op = _fmt(r.ms_op, ".3f")
        if r.ms_custom_op is not None:
            ms_op += f" ({r.ms_custom_op:.3f})"
        out.append((_short_capture(r), str(r.topk), f"{100 * r.sparsity:.1f}%", r.variant,
                    r.config[:40], ms_op, _fmt(r.ms_bare, ".3f"), _fmt(r.tflops, ".1f"),
                    _fmt(r.speedup, ".2f"), _verdict(r)))
    return out


def format_table(rows: list[Row]) -> str:
    """The plain-text table (the rich one has the same cells)."""
    cells = [TABLE_COLUMNS, *table_cells(rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(TABLE_COLUMNS) - 1)]
    lines = []
    for n, c in enumerate(cells):
        lines.append("  ".join(x.ljust(w) if i in (0, 3, 4) else x.rjust(w)
                               for i, (x, w) in enumerate(zip(c, widths, strict=False)))
                     + "  " + c[-1])
        if n == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


TABLE_FOOTNOTE = ("ms op: the op as users call it (default: block_sparse_attention in brackets); "
                  "ms bare: op.launch with validated shapes, preallocated out, no lse; "
                  "x ref: the reference variant's ms op / this ms op; TFLOP/s on real keys")


BACKWARD_FOOTNOTE = ("backward rows: ms op is the timed call (fwd+bwd: the whole step; bwd "
                     "kernels: launch_backward, inverse map prebuilt), TFLOP/s nominal (2.5x the "
                     "forward's FLOPs per backward), result the grad rule on dq, dk, dv")


def print_table(rows: list[Row], file=None) -> None:
    file = file or sys.stdout
    backward = any(r.kind == "backward" for r in rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(rows), file=file)
        print(TABLE_FOOTNOTE, file=file)
        if backward:
            print(BACKWARD_FOOTNOTE, file=file)
        return
    console = Console(file=file, width=None if file.isatty() else 200)
    table = Table(*TABLE_COLUMNS, title="tilegen bench",
                  caption=TABLE_FOOTNOTE + ("; " + BACKWARD_FOOTNOTE if backward else ""))
    for c in table_cells(rows):
        style = ("red" if c[-1].startswith(("FAIL", "ERROR")) else
                 "green" if c[-1] == "PASS" else None)
        table.add_row(*c, style=style)
    console.print(table)


def plot_series(rows: list[Row]) -> dict[str, list[tuple[float, float, float | None]]]:
    """Per variant: sorted (sparsity %, median ms_op, median TFLOP/s) over the captures of each
    TOPK (rows with a timing only; backward rows are left out of the plot)."""
    groups: dict[str, dict[float, list[Row]]] = {}
    for r in rows:
        if r.ms_op is None or r.kind == "backward":
            continue
        groups.setdefault(r.variant, {}).setdefault(round(100 * r.sparsity, 3), []).append(r)
    out = {}
    for variant, by_x in groups.items():
        series = []
        for x in sorted(by_x):
            rs = by_x[x]
            tfl = [r.tflops for r in rs if r.tflops is not None]
            series.append((x, statistics.median(r.ms_op for r in rs),  # type: ignore[misc]
                           statistics.median(tfl) if tfl else None))
        out[variant] = series
    return out


def plot(rows: list[Row], path: str | Path, title: str = "") -> str:
    """Two panels, latency and TFLOP/s against sparsity, one line per variant. Returns a
    one-line message (the path written, or why nothing was: matplotlib is optional)."""
    series = plot_series(rows)
    if not series:
        return "plot: no timed rows, nothing to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import ScalarFormatter
    except ImportError:
        return "plot: skipped (matplotlib is not installed; pip install matplotlib)"
    ticks = {round(100 * r.sparsity, 3): r.topk for r in rows
             if r.ms_op is not None and r.kind != "backward"}
    fig, (ax_ms, ax_tf) = plt.subplots(1, 2, figsize=(13, 5))
    for variant, pts in series.items():
        style = "-" if variant in ("default", "config", "reference") else "--"
        ax_ms.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=variant)
        tf = [(p[0], p[2]) for p in pts if p[2] is not None]
        if tf:
            ax_tf.plot([p[0] for p in tf], [p[1] for p in tf], style, marker="o", label=variant)
    ax_ms.set(ylabel="median ms, the op as users call it", yscale="log",
              title="latency vs sparsity")
    ax_ms.yaxis.set_major_formatter(ScalarFormatter())
    ax_ms.yaxis.set_minor_formatter(ScalarFormatter())
    ax_tf.set(ylabel="TFLOP/s on real keys", title="throughput vs sparsity")
    for ax in (ax_ms, ax_tf):
        ax.set_xticks(sorted(ticks), [f"{x:g}%\nK={ticks[x]}" for x in sorted(ticks)])
        ax.set_xlabel("sparsity (share of KV cubes skipped), TOPK")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: wrote {path}"


# ============================================================================ progress


class Reporter:
    """A rich progress bar when rich is importable and stdout is a terminal, else plain lines."""

    def __init__(self, total: int, plain: bool | None = None, file=None) -> None:
        self.file = file or sys.stdout
        self.total, self.done = total, 0
        self._progress = self._task = None
        if plain is None:
            plain = not (hasattr(self.file, "isatty") and self.file.isatty())
        if not plain:
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                )
            except ImportError:
                plain = True
            else:
                self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                          MofNCompleteColumn(), TimeElapsedColumn(),
                                          console=Console(file=self.file))
        self.plain = plain

    def __enter__(self) -> Reporter:
        if self._progress is not None:
            self._progress.start()
            self._task = self._progress.add_task("tilegen bench", total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def status(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=text)

    def step(self, text: str) -> None:
        """One unit of work finished; `text` says what it gave."""
        self.done += 1
        if self._progress is not None:
            self._progress.update(self._task, advance=1)
            self._progress.console.print(text, highlight=False, markup=False)
        else:
            print(f"[{self.done}/{self.total}] {text}", file=self.file, flush=True)

    def log(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=self.file, flush=True)


# ============================================================================ the run


@dataclass
class Point:
    """One capture of the run: a synthetic (TOPK, seed), or a file (its workload read on load)."""

    name: str
    spec: Spec
    seed: int | None = None
    path: Path | None = None

    def load(self, device: str) -> tuple[dict, Spec]:
        """The capture on `device`, in the spec's layout, and the spec of its workload."""
        if self.path is None:
            return captures.synthesize_for(self.spec, self.seed or 0, device), self.spec
        cap = captures.load(self.path, device=device)
        spec = spec_for_capture(self.spec, cap)
        return captures.for_spec(cap, spec), spec


def spec_for_capture(spec: Spec, cap: dict) -> Spec:
    """The spec with a capture file's workload (batch, heads, TOPK; grid when the file names
    it). Capture files are BSHD."""
    B, _, H, _ = cap["q"].shape
    changes: dict[str, Any] = {"batch": B, "num_heads": H, "topk": cap["topk_idx"].shape[-1]}
    if cap.get("grid") is not None:
        changes["grid"] = tuple(cap["grid"])
    return spec.replace(**changes)


def iter_points(plan: Plan) -> list[Point]:
    if plan.synthetic:
        if plan.spec.encoding == "sliding_tile":
            w = plan.spec.window
            label = ("window" + "x".join(map(str, w))) if isinstance(w[0], int) else "windows"
            return [Point(f"synthetic_seed{seed}_{label}", plan.spec, seed=seed)
                    for seed in range(plan.seeds)]
        return [Point(f"synthetic_seed{seed}_topk{topk}", plan.spec.replace(topk=topk), seed=seed)
                for topk in plan.topks for seed in range(plan.seeds)]
    paths = sorted(Path(plan.captures).glob("*.pt"))
    if not paths:
        raise FileNotFoundError(f"no capture .pt files in {plan.captures}")
    return [Point(path.name, plan.spec, path=path) for path in paths]


def oracle_heads(heads: int, outlier_heads: Sequence[int] = ()) -> list[int]:
    """Heads the fp32 oracle checks: the outlier head(s), the first, the middle and the last."""
    return sorted({*(h for h in outlier_heads if 0 <= h < heads), 0, heads // 2, heads - 1})


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def do_bench_timer(warmup_ms: int, rep_ms: int) -> Callable[[Callable[[], Any]], float]:
    import triton

    def timer(fn: Callable[[], Any]) -> float:
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                             return_mode="median"))

    return timer


def _heads_of(t: torch.Tensor, layout: str, heads: list[int]) -> torch.Tensor:
    return t[:, :, heads] if layout == "bshd" else t[:, heads]


def _to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2).contiguous() if layout == "bshd" else t


def _from_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2) if layout == "bshd" else t


def steps_per_point(plan: Plan) -> int:
    """Progress units per capture: the capture, each variant, the fp32 check, each backward
    row."""
    return len(plan.variants) + 2 + len(plan.backward_variants)


def run_points(plan: Plan, *, device: str = "cuda", timer: Callable | None = None,
               loader: Callable | None = None, flex: FlexPeer | None = None,
               reporter: Reporter | None = None, env: dict[str, str] | None = None) -> list[Row]:
    """Run every variant of `plan` on every capture and return the rows (no table, no files).

    `timer(fn) -> ms` defaults to do_bench with the plan's warmup and rep; `loader` to
    `tilegen.load`; both are parameters so that tests run the loop on the CPU."""
    from tilegen.ops import load

    timer = timer or do_bench_timer(plan.warmup_ms, plan.rep_ms)
    loader = loader or load
    flex = flex or FlexPeer(compile=device.startswith("cuda"))
    env = env or environment()
    points = iter_points(plan)
    reporter = reporter or Reporter(len(points) * steps_per_point(plan), plain=True)
    rows: list[Row] = []
    with torch.no_grad():
        for point in points:
            rows += _run_point(plan, point, device, timer, loader, flex, reporter, env)
            _free(device)
    fill_speedups(rows)
    return rows


def _new_row(point: Point, spec: Spec, env: dict[str, str], variant: str, kind: str,
             backend: str, config: str = "") -> Row:
    return Row(capture=point.name, variant=variant, kind=kind, backend=backend, config=config,
               topk=round(spec.kv_per_query), num_kv_blocks=spec.num_cubes,
               sparsity=1.0 - spec.kv_per_query / spec.num_cubes, grid=list(spec.grid),
               heads=spec.num_heads, batch=spec.batch, seq_len=spec.seq_len,
               head_dim=spec.head_dim, seed=point.seed, device=env.get("device"),
               torch=env.get("torch"), triton=env.get("triton"), date=env.get("date"))


def _run_point(plan: Plan, point: Point, device: str, timer: Callable, loader: Callable,
               flex: FlexPeer, reporter: Reporter, env: dict[str, str]) -> list[Row]:
    rows: list[Row] = []

    def finish(row: Row) -> None:
        row.update_rates()
        rows.append(row)
        reporter.step(_summary(row))
        if row.error:
            reporter.log(f"  ! {row.capture} {row.variant}: {row.error[:400]}")
        elif row.note and "failed" in row.note:
            reporter.log(f"  ! {row.capture} {row.variant}: {row.note[:400]}")

    reporter.status(f"{point.name}: loading capture")
    t0 = time.perf_counter()
    try:
        cap, spec = point.load(device)
        _sync(device)
    except Exception as exc:  # noqa: BLE001 - one bad capture must not stop the bench
        reporter.step(f"{point.name}: capture failed: {type(exc).__name__}: {exc}")
        for v in plan.variants:
            row = _new_row(point, point.spec, env, v.label, v.kind, v.backend)
            row.fail(f"capture: {type(exc).__name__}: {exc}")
            finish(row)
        row = _new_row(point, point.spec, env, "reference-vs-fp32", "oracle", "fp32")
        row.fail(f"capture: {type(exc).__name__}: {exc}")
        finish(row)
        for v in plan.backward_variants:
            row = _new_row(point, point.spec, env, v.label, v.kind, v.backend)
            row.fail(f"capture: {type(exc).__name__}: {exc}")
            finish(row)
        _free(device)
        return rows
    reporter.step(f"{point.name}: capture ready in {time.perf_counter() - t0:.1f}s "
                  f"(TOPK {spec.topk}, outlier heads {cap.get('outlier_heads', [])})")
    layout = spec.layout
    args = call_args(spec, cap)
    idx, counts = reference_lut(spec, cap)  # the pattern as a LUT: lut row, flex, oracle
    lut_args = (cap["q"], cap["k"], cap["v"], idx, cap["vbs"], counts)
    sparse_flops = (real_key_flops(idx, cap["vbs"], spec.block_q, spec.head_dim, counts),
                    slot_flops(idx, spec.block_q, spec.block_kv, spec.head_dim, counts))
    all_flops = dense_flops(spec.batch, spec.num_heads, spec.seq_len, spec.head_dim, cap["vbs"])
    o_ref = cap.get("o_ref")
    against = "bundled o_ref" if o_ref is not None else "reference variant"
    peer_inputs: tuple[torch.Tensor, ...] | None = None

    for variant in plan.variants:
        reporter.status(f"{point.name}: {variant.label}")
        row = _new_row(point, spec, env, variant.label, variant.kind, variant.backend)
        row.set_flops(*(all_flops if variant.label in DENSE_PEERS else sparse_flops))
        oracle: Row | None = None
        try:
            if variant.kind == "tilegen":
                if variant.label == "lut":
                    out = _run_tilegen(plan, variant, lut_spec(spec, idx.shape[-1]), lut_args,
                                       loader, timer, row, device)
                else:
                    out = _run_tilegen(plan, variant, spec, args, loader, timer, row, device)
                if variant.label == "reference":
                    if o_ref is None:
                        o_ref = out
                        row.set_score(captures.score(out, out, layout=layout),
                                      "itself (it is the reference)")
                    else:
                        row.set_score(captures.score(out, o_ref, layout=layout), against)
                    oracle = _oracle_row(spec, cap, lut_args, out,
                                         _new_row(point, spec, env, "reference-vs-fp32",
                                                  "oracle", "fp32"))
                elif o_ref is None:
                    row.fail("no reference output to score against (the reference variant "
                             "failed)")
                else:
                    row.set_score(captures.score(out, o_ref, layout=layout), against)
                del out
            else:
                if peer_inputs is None:
                    peer_inputs = tuple(_to_bhsd(t, layout) for t in args[:3])
                if variant.backend == "flex":
                    _run_flex(spec, idx, cap["vbs"], peer_inputs, flex, timer, row, o_ref,
                              against, device)
                else:
                    _run_dense(spec, variant, peer_inputs, timer, row, device)
        except Exception as exc:  # noqa: BLE001 - a failing variant must not stop the bench
            row.fail(exc)
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                row.add_note("out of memory")
            _free(device)
        finish(row)
        if variant.label == "reference":
            if oracle is None:
                oracle = _new_row(point, spec, env, "reference-vs-fp32", "oracle", "fp32")
                oracle.fail("not run: the reference variant failed")
            finish(oracle)
    if plan.backward_variants:
        del peer_inputs
        _free(device)
        for row in _run_backward(plan, point, spec, cap, args, sparse_flops, device, timer,
                                 loader, flex, reporter, env):
            finish(row)
        del cap, args, o_ref
        return rows
    del cap, args, o_ref, peer_inputs
    return rows


def _summary(r: Row) -> str:
    ms = f"{r.ms_op:.3f} ms" if r.ms_op is not None else "-"
    bare = f", bare {r.ms_bare:.3f} ms" if r.ms_bare is not None else ""
    custom = f", custom op {r.ms_custom_op:.3f} ms" if r.ms_custom_op is not None else ""
    return f"{r.capture} {r.variant} [{r.config}]: {ms}{custom}{bare} -> {_verdict(r)}"


def _run_tilegen(plan: Plan, variant: Variant, spec: Spec, args: tuple, loader: Callable,
                 timer: Callable, row: Row, device: str) -> torch.Tensor:
    """Load, run once (scored by the caller), then time the op, the custom op and the bare
    launch. Returns the op's output."""
    if variant.label == "reference":
        op = loader(spec, reference_config(spec))
    elif variant.label in ("default", "config", "lut"):
        op = loader(spec, plan.config)
    else:
        op = loader(spec, backend=variant.backend)
    row.backend = getattr(op, "backend", variant.backend)
    row.config_source = getattr(op, "config_source", None)
    t0 = time.perf_counter()
    o = op(*args, return_lse=False)
    _sync(device)
    row.first_call_s = time.perf_counter() - t0
    row.config = _config_name(op, args[0].device)
    # the call as users make it, then the bare kernel
    row.ms_op = timer(lambda: op(*args, return_lse=False))
    if variant.label in ("default", "config"):
        _time_custom_op(spec, args, timer, row)
    try:
        shapes = validate(op.spec if hasattr(op, "spec") else spec, *args)
        q = args[0]
        out = (torch.empty_like(q), torch.empty((shapes.batch, shapes.heads, shapes.seq_len),
                                                dtype=torch.float32, device=q.device))
        row.ms_bare = timer(lambda: op.launch(*args, shapes=shapes, out=out, store_lse=False))
    except Exception as exc:  # noqa: BLE001 - the op's timing stands without the bare one
        row.add_note(f"bare launch failed: {type(exc).__name__}: {exc}")
    if hasattr(op, "check"):
        op.check()  # a bad value met on the device (none expected) raises here
    return o


def _config_name(op: Any, device: torch.device) -> str:
    """The op's config name (the CUDA op resolves its config per device, at the first call)."""
    cfg = getattr(op, "config", None) or getattr(op, "_config", None)
    if cfg is None and hasattr(op, "kernel"):
        try:
            cfg = op.kernel(device, False)[1]
        except Exception:  # noqa: BLE001
            cfg = None
    return cfg.name if cfg is not None else "target default"


def _time_custom_op(spec: Spec, args: tuple, timer: Callable, row: Row) -> None:
    """block_sparse_attention(...) (the torch.library op users call), when its kernel is this
    spec's: it builds the default spec for q's dtype, head dim and layout."""
    from tilegen.ops import _op_for, block_sparse_attention

    plain = Spec(head_dim=spec.head_dim, dtype=spec.dtype, layout=spec.layout)
    if spec.encoding != "lut":
        row.add_note(f"block_sparse_attention not timed: it takes a LUT, not encoding "
                     f"{spec.encoding!r}")
        return
    if plain.kernel_dict() != spec.kernel_dict():
        row.add_note("block_sparse_attention not timed: it runs the default kernel fields, "
                     "not this spec's")
        return
    try:
        q = args[0]
        custom_cfg = _op_for(q, spec.layout).config.name
        block_sparse_attention(*args, layout=spec.layout)  # first call outside the timing
        row.ms_custom_op = timer(lambda: block_sparse_attention(*args, layout=spec.layout))
        if custom_cfg != row.config:
            row.add_note(f"block_sparse_attention ran config {custom_cfg}")
    except Exception as exc:  # noqa: BLE001
        row.add_note(f"block_sparse_attention failed: {type(exc).__name__}: {exc}")


def _oracle_row(spec: Spec, cap: dict, args: tuple, o_variant: torch.Tensor, row: Row) -> Row:
    """The reference variant against the fp32 oracle on a subset of heads (outlier included);
    the oracle's output is rounded to the op's dtype first, as the kernel's output is."""
    from tilegen.reference import attention_fp32

    heads = oracle_heads(spec.num_heads, cap.get("outlier_heads") or ())
    row.config = "tilegen.reference.attention_fp32"
    row.heads_checked = heads
    try:
        layout = spec.layout
        q, k, v = (_heads_of(t, layout, heads).contiguous() for t in args[:3])
        idx = args[3][:, heads].contiguous()
        vbs = args[4] if spec.variable_block_sizes else None
        counts = args[5][:, heads].contiguous() if len(args) > 5 and args[5] is not None else None
        o32, _ = attention_fp32(q, k, v, idx, vbs, counts, layout=layout, block=spec.block_kv)
        s = captures.score(_heads_of(o_variant, layout, heads), o32.to(q.dtype), layout=layout)
        row.set_score(s, f"fp32 oracle, heads {heads}")
        del q, k, v, idx, o32
    except Exception as exc:  # noqa: BLE001
        row.fail(exc)
    return row


def _run_flex(spec: Spec, idx: torch.Tensor, vbs: torch.Tensor, peer_inputs: tuple,
              flex: FlexPeer, timer: Callable, row: Row, o_ref: torch.Tensor | None,
              against: str, device: str) -> None:
    """FlexAttention with the BlockMask of the pattern `idx` (a LUT whose rows may repeat a
    cube past their count: scattered into a block mask, repeats collapse)."""
    row.config = (f"BlockMask {spec.block_q}x{spec.block_kv}, "
                  + ("torch.compile" if flex.compile else "eager"))
    if flex.failed:
        row.fail(f"skipped: FlexAttention failed earlier ({flex.failed[:300]})")
        return
    block = spec.block_kv
    bm = flex.block_mask(idx, vbs, block)
    row.ms_mask = timer(lambda: flex.block_mask(idx, vbs, block))
    q, k, v = peer_inputs

    def call() -> torch.Tensor:
        return flex.call(q, k, v, bm, spec.sm_scale, block)

    t0 = time.perf_counter()
    try:
        o = call()
        _sync(device)
    except Exception as exc:
        if not isinstance(exc, torch.cuda.OutOfMemoryError):
            flex.failed = f"{type(exc).__name__}: {exc}"
        raise
    row.first_call_s = time.perf_counter() - t0
    if o_ref is None:
        row.fail("no reference output to score against (the reference variant failed)")
    else:
        row.set_score(captures.score(_from_bhsd(o, spec.layout), o_ref, layout=spec.layout),
                      against)
    del o
    row.ms_op = timer(call)


def _run_dense(spec: Spec, variant: Variant, peer_inputs: tuple, timer: Callable, row: Row,
               device: str) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    member = DENSE_PEERS[variant.label]
    row.config = f"dense, SDPBackend.{member}"
    row.add_note("dense attention computes a different function (every key): timed, not "
                 "scored")
    q, k, v = peer_inputs
    with sdpa_kernel([getattr(SDPBackend, member)]):
        def call() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, scale=spec.sm_scale)

        t0 = time.perf_counter()
        o = call()
        _sync(device)
        row.first_call_s = time.perf_counter() - t0
        del o
        row.ms_op = timer(call)


# ============================================================================ backward


def backward_heads(heads: int, outlier_heads: Sequence[int] = ()) -> list[int]:
    """Heads the backward check recomputes fp32 gradients on: the outlier head(s), the first
    and the last."""
    return sorted({*(h for h in outlier_heads if 0 <= h < heads), 0, heads - 1})


def backward_do(q: torch.Tensor, seed: int | None) -> torch.Tensor:
    """The incoming gradient dO: standard normal, like q, seeded by the capture's seed."""
    g = torch.Generator(device=q.device).manual_seed(1_000_003 + (seed or 0))
    return torch.randn(q.shape, generator=g, device=q.device).to(q.dtype)


def _head_dim(layout: str) -> int:
    return 2 if layout == "bshd" else 1


def grad_reference(spec: Spec, args: tuple, do: torch.Tensor, heads: Sequence[int]
                   ) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of the fp32 autograd reference on `heads` only (the heads selected with
    index_select, in the spec's layout), computed one head at a time to bound memory."""
    from tilegen.reference import attention_grads_fp32

    layout, dim = spec.layout, _head_dim(spec.layout)
    vbs = args[4] if spec.variable_block_sizes else None
    parts = []
    for h in heads:
        sel = torch.tensor([h], device=args[0].device)
        q, k, v, d = (t.index_select(dim, sel).contiguous() for t in (*args[:3], do))
        idx = args[3].index_select(1, sel).contiguous()
        parts.append(attention_grads_fp32(q, k, v, idx, vbs, None, d, layout=layout,
                                          block=spec.block_kv, sm_scale=spec.sm_scale))
        del q, k, v, d
    return tuple(torch.cat([p[i] for p in parts], dim=dim) for i in range(3))


def set_grad_score(row: Row, grads: Sequence[torch.Tensor], ref: Sequence[torch.Tensor],
                   layout: str, heads: list[int]) -> None:
    """Score (dq, dk, dv), restricted to `heads`, against the reference on those heads with
    `captures.grad_score`; the row passes iff all three pass."""
    sel = torch.tensor(heads, device=grads[0].device)
    scores = [captures.grad_score(g.index_select(_head_dim(layout), sel), r, layout=layout)
              for g, r in zip(grads, ref, strict=True)]
    row.passed = all(s.passed for s in scores)
    row.finite = all(s.finite for s in scores)
    row.min_head_cos = min(s.min_head_cos for s in scores)
    row.max_abs = max(s.max_abs for s in scores)
    row.score = "; ".join(f"{n}: {s}" for n, s in zip(("dq", "dk", "dv"), scores, strict=True))
    row.scored_against = f"fp32 autograd reference (attention_grads_fp32), heads {heads}"
    row.heads_checked = list(heads)


def _run_backward(plan: Plan, point: Point, spec: Spec, cap: dict, args: tuple,
                  sparse_flops: tuple[float, float], device: str, timer: Callable,
                  loader: Callable, flex: FlexPeer, reporter: Reporter,
                  env: dict[str, str]) -> list[Row]:
    """The backward rows of one capture (`BACKWARD_ROWS`); failures are recorded per row."""
    heads = backward_heads(spec.num_heads, cap.get("outlier_heads") or ())
    ref: tuple[torch.Tensor, ...] | None = None
    ref_error: str | None = None
    reporter.status(f"{point.name}: fp32 reference gradients on heads {heads}")
    try:
        do = backward_do(args[0], point.seed)
        with torch.enable_grad():
            ref = grad_reference(spec, args, do, heads)
    except Exception as exc:  # noqa: BLE001 - the timings stand without the check
        ref_error = f"{type(exc).__name__}: {exc}"
        do = backward_do(args[0], point.seed)
        _free(device)
    runners = {"fwd+bwd": _bwd_custom_op, "bwd kernels": _bwd_kernels,
               "inverse map": _bwd_inverse_map, "flex fwd+bwd": _bwd_flex}
    rows = []
    for variant in plan.backward_variants:
        reporter.status(f"{point.name}: backward, {variant.label}")
        row = _new_row(point, spec, env, variant.label, variant.kind, variant.backend)
        factor = BACKWARD_ROWS[variant.label][0]
        if factor is not None:
            row.set_flops(factor * sparse_flops[0], factor * sparse_flops[1])
        try:
            with torch.enable_grad():
                grads = runners[variant.label](spec, args, do, timer, row, device,
                                               loader=loader, flex=flex)
            if grads is not None:
                if ref is None:
                    row.fail(f"not scored: the fp32 reference gradients failed ({ref_error})")
                else:
                    set_grad_score(row, grads, ref, spec.layout, heads)
            del grads
        except Exception as exc:  # noqa: BLE001 - a failing row must not stop the bench
            row.fail(exc)
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                row.add_note("out of memory")
            _free(device)
        rows.append(row)
    del ref, do
    return rows


def _first_call(fn: Callable, row: Row, device: str) -> Any:
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    row.first_call_s = time.perf_counter() - t0
    return out


def _bwd_custom_op(spec: Spec, args: tuple, do: torch.Tensor, timer: Callable, row: Row,
                   device: str, **_: Any) -> tuple[torch.Tensor, ...] | None:
    """fwd+bwd: the custom op on requires_grad leaves, then torch.autograd.grad."""
    from tilegen.ops import _op_for, block_sparse_attention

    plain = Spec(head_dim=spec.head_dim, dtype=spec.dtype, layout=spec.layout)
    if plain.kernel_dict() != spec.kernel_dict():
        row.add_note("not run: block_sparse_attention runs the default kernel fields, not this "
                     "spec's (the bwd kernels row runs this spec's)")
        return None
    q, k, v = (t.detach().requires_grad_(True) for t in args[:3])
    idx, vbs = args[3], args[4]

    def step() -> tuple[torch.Tensor, ...]:
        o = block_sparse_attention(q, k, v, idx, vbs, layout=spec.layout, sm_scale=spec.sm_scale)
        return torch.autograd.grad(o, (q, k, v), do)

    grads = _first_call(step, row, device)
    row.config = _op_for(args[0], spec.layout, "triton").backward_config.name
    row.ms_op = timer(step)
    return grads


def _bwd_kernels(spec: Spec, args: tuple, do: torch.Tensor, timer: Callable, row: Row,
                 device: str, *, loader: Callable, **_: Any) -> tuple[torch.Tensor, ...]:
    """bwd kernels: op.launch_backward with the maps prebuilt (the inverse map, and the packed
    tiles of a config that packs; o_acc, lse from forward_for_grad, outside the timing)."""
    from tilegen.backends.triton.backward import backward_maps

    op = loader(spec, backend="triton")
    row.backend = getattr(op, "backend", "triton")
    q, k, v, idx, vbs = args
    _, lse, o_acc = op.forward_for_grad(q, k, v, idx, vbs)
    cfg = op.backward_config
    inv = backward_maps(idx, None, vbs, vbs.shape[0], spec.block_kv, cfg)
    row.config = cfg.name
    bargs = (do, q, k, v, o_acc, lse, idx, vbs)

    def call() -> tuple[torch.Tensor, ...]:
        return op.launch_backward(*bargs, inverse=inv, config=cfg)

    grads = _first_call(call, row, device)
    row.ms_op = timer(call)
    if hasattr(op, "check"):
        op.check()
    return grads


def _bwd_inverse_map(spec: Spec, args: tuple, do: torch.Tensor, timer: Callable, row: Row,
                     device: str, **_: Any) -> None:
    """inverse map: the CSR map of query cubes per KV cube, alone (timed, not scored)."""
    from tilegen.backends.triton.backward import inverse_map

    idx, nkv = args[3], args[4].shape[0]
    row.config = "torch: stable sort + bincount"
    _first_call(lambda: inverse_map(idx, None, nkv), row, device)
    row.ms_op = timer(lambda: inverse_map(idx, None, nkv))
    return None


def _bwd_flex(spec: Spec, args: tuple, do: torch.Tensor, timer: Callable, row: Row,
              device: str, *, flex: FlexPeer, **_: Any) -> tuple[torch.Tensor, ...] | None:
    """flex fwd+bwd: the flex peer's compiled function and BlockMask, forward + autograd.grad
    (BHSD leaves copied outside the timing); gradients returned in the spec's layout."""
    layout, block = spec.layout, spec.block_kv
    row.config = (f"BlockMask {spec.block_q}x{block}, "
                  + ("torch.compile" if flex.compile else "eager"))
    if flex.failed:
        row.fail(f"skipped: FlexAttention failed earlier ({flex.failed[:300]})")
        return None
    if flex.failed_backward:
        row.fail(f"skipped: FlexAttention's backward failed earlier "
                 f"({flex.failed_backward[:300]})")
        return None
    bm = flex.block_mask(args[3], args[4], block)
    q, k, v = (_to_bhsd(t, layout).detach().clone().requires_grad_(True) for t in args[:3])
    dob = _to_bhsd(do, layout)

    def step() -> tuple[torch.Tensor, ...]:
        o = flex.call(q, k, v, bm, spec.sm_scale, block)
        return torch.autograd.grad(o, (q, k, v), dob)

    try:
        grads = _first_call(step, row, device)
    except Exception as exc:
        if not isinstance(exc, torch.cuda.OutOfMemoryError):
            flex.failed_backward = f"{type(exc).__name__}: {exc}"
        raise
    row.ms_op = timer(step)
    return tuple(_from_bhsd(g, layout) for g in grads)


def run_bench(plan: Plan, *, command: str | None = None, device: str = "cuda",
              timer: Callable | None = None, file=None) -> int:
    """The `tilegen bench` command: run, print the table, write the JSON and the plot. Exit
    status: 0 when every tilegen row passed, 1 otherwise, 2 with no CUDA GPU. (`device` and
    `timer` other than the defaults are for tests: they run the command on the CPU.)"""
    file = file or sys.stdout
    if device == "cuda" and not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    env = environment()
    print(f"tilegen bench on {env['device']}: torch {env['torch']}, triton {env['triton']}, "
          f"tilegen {env['tilegen']}", file=file, flush=True)
    print(plan.describe(), file=file, flush=True)
    points = iter_points(plan)
    t0 = time.perf_counter()
    with Reporter(len(points) * steps_per_point(plan), file=file) as reporter:
        rows = run_points(plan, device=device, timer=timer, reporter=reporter, env=env)
    print(f"\nbench finished in {time.perf_counter() - t0:.0f}s", file=file, flush=True)
    print_table(rows, file=file)
    print(FLOPS_FORMULA, file=file)
    if plan.backward:
        print(BACKWARD_FLOPS_FORMULA, file=file)
    doc = results_json(plan, rows, env, command)
    print(f"json: wrote {write_json(plan.json_path, doc)}", file=file)
    s = plan.spec
    print(plot(rows, plan.plot_path,
               title=f"tilegen bench, {env['device']}: grid {s.grid}, {s.num_heads} heads, "
                     f"D={s.head_dim}, {s.dtype}; {env['date']}"), file=file)
    bad = [r for r in rows if not r.ok]
    if bad:
        print(f"{len(bad)} tilegen row(s) failed or errored: "
              + ", ".join(sorted({f"{r.variant} (TOPK {r.topk})" for r in bad})), file=file)
        return 1
    return 0


# ============================================================================ kept for tune


def time_op(op: Any, cap: dict, *, store_lse: bool = True, warmup: int = 100,
            rep: int = 500) -> float:
    """Median ms of the bare launch (inputs validated once, outputs preallocated), as
    `tilegen.tune` times trials."""
    args = call_args(op.spec, cap)
    shapes = validate(op.spec, *args)
    out = (torch.empty_like(cap["q"]),
           torch.empty(shapes.batch, shapes.heads, shapes.seq_len, dtype=torch.float32,
                       device=cap["q"].device))
    timer = do_bench_timer(warmup, rep)
    return timer(lambda: op.launch(*args, shapes=shapes, out=out, store_lse=store_lse))


def time_fn(fn: Callable[[], Any], *, warmup: int = 100, rep: int = 500) -> float:
    """Median ms of `fn` (`do_bench`, warmed), as `tilegen.tune` times a backward trial."""
    return do_bench_timer(warmup, rep)(fn)
