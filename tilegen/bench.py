"""Score and time kernels on captures: the op under test against the reference variant, with
dense PyTorch SDPA beside them as the peer a sparse kernel must beat.

Both run in the same process on the same inputs, so a noisy shared GPU affects them alike.
Timing is kernel-only: inputs are validated once, then `launch` is timed with
`triton.testing.do_bench` (CUDA events, warmed, median).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tilegen import captures
from tilegen.config import KernelConfig, reference_config
from tilegen.inputs import validate_inputs
from tilegen.ops import BlockSparseAttention, load
from tilegen.reference import attention_fp32
from tilegen.spec import Spec


@dataclass
class Row:
    capture: str
    variant: str
    config: str
    passed: bool
    score: str
    ms: float | None
    tflops: float | None


def iter_captures(spec: Spec, where: str, seeds: int, device: str) -> Iterator[tuple[str, dict]]:
    """Capture files from a directory, or `seeds` synthetic ones (each with an outlier head)."""
    if where == "synthetic":
        for seed in range(seeds):
            yield f"synthetic_seed{seed}", captures.synthesize_for(spec, seed, device)
        return
    paths = sorted(Path(where).glob("*.pt"))
    if not paths:
        raise FileNotFoundError(f"no capture .pt files in {where}")
    for path in paths:
        yield path.name, captures.for_spec(captures.load(path, device=device), spec)


def time_op(op: BlockSparseAttention, cap: dict) -> float:
    import triton

    args = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"])
    shapes = validate_inputs(op.spec, *args)
    out = (torch.empty_like(cap["q"]),
           torch.empty(shapes.batch, shapes.heads, shapes.seq_len, dtype=torch.float32,
                       device=cap["q"].device))
    return float(triton.testing.do_bench(lambda: op.launch(*args, shapes=shapes, out=out),
                                         warmup=100, rep=500, return_mode="median"))


def flops_of(cap: dict, spec: Spec) -> float:
    """Useful FLOPs: 4 * rows * (valid keys attended) * D, counting partial cubes exactly."""
    idx, vbs = cap["topk_idx"], cap["vbs"]
    keys = vbs.double()[idx.long()].sum()  # (B, H, NQ, TOPK) -> total keys over all rows
    return float(4.0 * keys * spec.block_q * spec.head_dim)


def compare(spec: Spec, cap: dict, variants: dict[str, BlockSparseAttention],
            name: str, fp32_check: bool = True) -> list[Row]:
    """Score every variant against the reference variant's bf16 output (or the bundled o_ref),
    and the reference variant itself against the fp32 oracle."""
    args = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"])
    ref_op = variants["reference"]
    o_ref = cap.get("o_ref")
    if o_ref is None:
        o_ref = ref_op(*args, return_lse=False)
    rows = []
    flops = flops_of(cap, spec)
    if fp32_check:
        o32, _ = attention_fp32(*args, layout=spec.layout, block=spec.block_kv)
        s = captures.score(ref_op(*args, return_lse=False), o32.to(cap["q"].dtype),
                           layout=spec.layout)
        rows.append(Row(name, "reference vs fp32", ref_op.config.name, s.passed, str(s),
                        None, None))
    for label, op in variants.items():
        o = op(*args, return_lse=False)
        s = captures.score(o, o_ref, layout=spec.layout)
        ms = time_op(op, cap) if cap["q"].is_cuda else None
        rows.append(Row(name, label, op.config.name, s.passed, str(s), ms,
                        flops / ms / 1e9 if ms else None))
    return rows


def table(rows: list[Row]) -> str:
    head = f"{'capture':22s} {'variant':18s} {'config':22s} {'ms':>8s} {'TFLOP/s':>8s}  score"
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = f"{r.ms:8.3f}" if r.ms is not None else f"{'-':>8s}"
        tf = f"{r.tflops:8.1f}" if r.tflops is not None else f"{'-':>8s}"
        lines.append(f"{r.capture:22s} {r.variant:18s} {r.config:22s} {ms} {tf}  {r.score}")
    return "\n".join(lines)


def dense_peer(spec: Spec, cap: dict, name: str) -> Row:
    """The dense baseline a sparse kernel has to beat: PyTorch SDPA (FlashAttention backend
    where available) over every token, on the same q, k, v. Timed only: it computes a different
    function (no sparsity, no vbs masking), so there is no score, and it never fails the run."""
    import torch.nn.functional as F
    import triton

    q, k, v = (t if spec.layout == "bhsd" else t.transpose(1, 2).contiguous()
               for t in (cap["q"], cap["k"], cap["v"]))
    ms = float(triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v),
                                       warmup=100, rep=500, return_mode="median"))
    B, H, S, D = q.shape
    flops = 4.0 * B * H * S * S * D
    return Row(name, "peer: dense SDPA", "torch", True, "timing only (dense attention)", ms,
               flops / ms / 1e9)


def run_bench(spec: Spec, where: str, config: KernelConfig | None, seeds: int = 1) -> int:
    if not torch.cuda.is_available():
        print("tilegen bench: no GPU found; bench times kernels on a CUDA/ROCm device",
              file=sys.stderr)
        return 2
    variants = {"reference": load(spec, reference_config(spec)), "tilegen": load(spec, config)}
    rows: list[Row] = []
    for name, cap in iter_captures(spec, where, seeds, "cuda"):
        rows += compare(spec, cap, variants, name)
        rows.append(dense_peer(spec, cap, name))
        del cap
        torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(table(rows))
    return 0 if all(r.passed for r in rows) else 1
