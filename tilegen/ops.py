"""The importable ops: `load(spec)` and the `tilegen::block_sparse_attention` custom op.

Validation happens here, at the boundary, before any kernel launch. Execution paths:

- CUDA / ROCm tensors: the generated Triton kernel, compiled by Triton's JIT.
- CPU tensors with TRITON_INTERPRET=1: the same generated kernel under Triton's interpreter.
  Triton 3.6's interpreter computes bf16 ``tl.dot`` wrongly (it multiplies raw bits) and
  truncates fp32 -> bf16 casts, so for bf16 the kernel is rendered with the ``interp_bf16``
  option (see `KernelConfig`); the op says so once in the log. fp16 runs the GPU text unchanged.
- CPU tensors otherwise: the fp32 PyTorch path (`tilegen.reference`), cast to the input dtype.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tilegen import config as cfgmod
from tilegen.config import KernelConfig
from tilegen.jit import interpreting, load_triton
from tilegen.reference import LOG2E, attention_fp32
from tilegen.render import render_triton
from tilegen.spec import Spec
from tilegen.targets import TARGET_NAMES, Target, detect_target

if TYPE_CHECKING:
    from tilegen.runtime.cuda import CudaBlockSparseAttention
    from tilegen.runtime.hip import HipBlockSparseAttention

log = logging.getLogger("tilegen")

SPEC_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
TORCH_DTYPES = {v: k for k, v in SPEC_DTYPES.items()}


@dataclass(frozen=True)
class Shapes:
    batch: int
    seq_len: int
    heads: int
    head_dim: int
    num_q_blocks: int
    num_kv_blocks: int
    topk: int


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def validate_inputs(
    spec: Spec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor,
    counts: torch.Tensor | None = None,
    *,
    check_values: bool = True,
) -> Shapes:
    """Check shapes, dtypes, devices and index ranges against `spec`; raise before any launch.

    Errors name the argument: TypeError for a wrong type or dtype, ValueError for the rest.
    ``check_values`` reads index ranges back from the device (one sync); the benchmark path
    turns it off after validating once.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("topk_idx", topk_idx), ("vbs", vbs)):
        _tensor(name, x)
    want = spec.torch_dtype
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != want:
            raise TypeError(f"{name} has dtype {x.dtype}, spec wants {want} (dtype={spec.dtype!r})")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D {spec.layout.upper()}, "
                             f"got shape {tuple(x.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must have one shape; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    device = q.device
    for name, x in (("k", k), ("v", v), ("topk_idx", topk_idx), ("vbs", vbs)):
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_contiguous():
            raise ValueError(f"{name} is not contiguous in {spec.layout.upper()}; pass "
                             f"{name}.contiguous() or use a spec with the layout it has")
    if spec.layout == "bshd":
        B, S, H, D = q.shape
    else:
        B, H, S, D = q.shape
    if D != spec.head_dim:
        raise ValueError(f"q has head dim {D}, spec wants head_dim={spec.head_dim}")
    if S % spec.block_q:
        raise ValueError(f"q has sequence length {S}, not a multiple of block_q={spec.block_q} "
                         "(pad to whole cubes: tilegen.layout.to_cubes)")
    nq = S // spec.block_q
    nkv = S // spec.block_kv
    if topk_idx.dtype != torch.int32:
        raise TypeError(f"topk_idx has dtype {topk_idx.dtype}, expected torch.int32")
    if topk_idx.dim() != 4 or tuple(topk_idx.shape[:3]) != (B, H, nq):
        raise ValueError(f"topk_idx must have shape (B, H, NQ, TOPK) = ({B}, {H}, {nq}, TOPK), "
                         f"got {tuple(topk_idx.shape)}")
    topk = topk_idx.shape[3]
    if topk < 1 or topk > nkv:
        raise ValueError(f"topk_idx has TOPK={topk}; need 1 <= TOPK <= NKV={nkv}")
    if not topk_idx.is_contiguous():
        raise ValueError("topk_idx must be contiguous")
    if vbs.dtype != torch.int32:
        raise TypeError(f"vbs has dtype {vbs.dtype}, expected torch.int32")
    if tuple(vbs.shape) != (nkv,):
        raise ValueError(f"vbs must have shape (NKV,) = ({nkv},), got {tuple(vbs.shape)}")
    if counts is not None:
        _tensor("counts", counts)
        if counts.dtype != torch.int32:
            raise TypeError(f"counts has dtype {counts.dtype}, expected torch.int32")
        if tuple(counts.shape) != (B, H, nq) or not counts.is_contiguous():
            raise ValueError(f"counts must be a contiguous (B, H, NQ) = ({B}, {H}, {nq}) tensor, "
                             f"got shape {tuple(counts.shape)}")
        if counts.device != device:
            raise ValueError(f"counts is on {counts.device} but q is on {device}")
    if check_values:
        if topk_idx.numel():
            lo, hi = int(topk_idx.min()), int(topk_idx.max())
            if lo < 0 or hi >= nkv:
                raise ValueError(f"topk_idx holds values in [{lo}, {hi}], outside [0, NKV={nkv})")
        lo, hi = int(vbs.min()), int(vbs.max())
        if lo < 1 or hi > spec.block_kv:
            raise ValueError(f"vbs holds values in [{lo}, {hi}], outside 1..{spec.block_kv}")
        if counts is not None and counts.numel():
            lo, hi = int(counts.min()), int(counts.max())
            if lo < 0 or hi > topk:
                raise ValueError(f"counts holds values in [{lo}, {hi}], outside 0..TOPK={topk}")
    return Shapes(B, S, H, D, nq, nkv, topk)


def check_sm_scale(sm_scale: object) -> None:
    """sm_scale is None (1/sqrt(D)) or a positive, finite number."""
    if sm_scale is None:
        return
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, int | float):
        raise TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be positive and finite, got {sm_scale!r}")


class BlockSparseAttention:
    """A loaded kernel: ``o, lse = op(q, k, v, topk_idx, vbs, counts=None)``."""

    def __init__(self, spec: Spec, config: KernelConfig, target: Target | None,
                 source: str = "default") -> None:
        self.spec = spec
        self.config = config
        self.target = target
        #: where the config came from: "explicit", "winner", "default" or "reference"
        self.config_source = source

    def __repr__(self) -> str:
        where = self.target.name if self.target else "cpu"
        return (f"BlockSparseAttention(spec={self.spec.short_hash}, config={self.config.name}, "
                f"target={where}, from={self.config_source})")

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        topk_idx: torch.Tensor,
        vbs: torch.Tensor,
        counts: torch.Tensor | None = None,
        *,
        sm_scale: float | None = None,
        return_lse: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """Validate, then run. Returns (o, lse), or o alone when return_lse=False."""
        shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts)
        check_sm_scale(sm_scale)
        if q.device.type == "cpu" and not interpreting():
            o, lse = attention_fp32(
                q, k, v, topk_idx, vbs if self.spec.variable_block_sizes else None, counts,
                layout=self.spec.layout, block=self.spec.block_kv, sm_scale=sm_scale)
            o = o.to(q.dtype)
        else:
            o, lse = self.launch(q, k, v, topk_idx, vbs, counts, shapes=shapes,
                                 sm_scale=sm_scale, store_lse=return_lse)
        return (o, lse) if return_lse else o

    def kernel_config(self, device: torch.device, store_lse: bool = True) -> KernelConfig:
        cfg = self.config.replace(store_lse=store_lse)
        if device.type == "cpu" and self.spec.dtype == "bf16":
            cfg = cfg.replace(interp_bf16=True)
        return cfg

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_idx: torch.Tensor,
               vbs: torch.Tensor, counts: torch.Tensor | None = None, *,
               shapes: Shapes | None = None, sm_scale: float | None = None,
               store_lse: bool = True,
               out: tuple[torch.Tensor, torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Launch the Triton kernel with no input checks (call `validate_inputs` once first)."""
        if shapes is None:
            shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                     check_values=False)
        cfg = self.kernel_config(q.device, store_lse)
        if cfg.interp_bf16:
            _note_once("Triton interpreter with bf16: rendering the kernel with interp_bf16 "
                       "(fp32 dots on bf16-rounded operands, output rounded by torch), since "
                       "Triton 3.6's interpreter gets bf16 tl.dot wrong and truncates "
                       "fp32->bf16 casts")
        kernel = load_triton(render_triton(self.spec, cfg))
        if out is None:
            o = torch.empty_like(q, dtype=torch.float32 if cfg.interp_bf16 else q.dtype)
            lse = torch.empty((shapes.batch, shapes.heads, shapes.seq_len), dtype=torch.float32,
                              device=q.device) if store_lse else o
        else:
            o, lse = out
        scale = sm_scale if sm_scale is not None else self.spec.sm_scale
        grid = (shapes.num_q_blocks * (self.spec.block_q // cfg.block_m),
                shapes.batch * shapes.heads)
        kernel[grid](
            q, k, v, topk_idx, counts if counts is not None else topk_idx, vbs, o, lse,
            shapes.seq_len, shapes.heads, shapes.num_q_blocks, shapes.topk, scale * LOG2E,
            HAS_COUNTS=counts is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if cfg.interp_bf16 and out is None:
            o = o.to(q.dtype)
        return o, (lse if store_lse else None)


_noted: set[str] = set()


def _note_once(message: str, level: int = logging.INFO) -> None:
    if message not in _noted:
        _noted.add(message)
        log.log(level, message)


def resolve_config(spec: Spec, target: Target | None) -> tuple[KernelConfig, str]:
    """The tuned winner for (spec, device) when the tuning DB has a current one, else the
    target's default (logged once), else the reference config on a CPU-only machine."""
    if target is None:
        if torch.cuda.is_available():  # a GPU tilegen has no target file for
            _note_once(f"no tilegen target for {torch.cuda.get_device_name()}; using the "
                       f"reference config {cfgmod.reference_config(spec).name} without target "
                       f"checks (targets: {', '.join(TARGET_NAMES)})", logging.WARNING)
        return cfgmod.reference_config(spec), "reference"
    from tilegen.winners import lookup_config

    found = lookup_config(spec, target)
    if found is not None:
        return found, "winner"
    return cfgmod.default_config(target, spec), "default"


BACKENDS = ("triton", "cuda", "hip")


def load(spec: Spec | None = None, config: KernelConfig | None = None, *,
         target: Target | str | None = None, backend: str = "triton"
         ) -> BlockSparseAttention | CudaBlockSparseAttention | HipBlockSparseAttention:
    """The block-sparse attention op for `spec` (default: the contract's workload spec).

    `config` pins a variant; otherwise the tuned winner for this device is used when the tuning
    DB holds one, else the target's default config. Configs are checked against the target's
    rules before anything is compiled.

    `backend` picks the kernel: "triton" (default; CUDA and ROCm GPUs, the interpreter, CPU),
    "cuda" (the CK-style CUDA C++ kernel via nvcc + the CUDA driver API, NVIDIA GPUs) or "hip"
    (the CK-style HIP kernel via clang-19 + hip-python, AMD GPUs).
    """
    spec = spec or Spec()
    if not isinstance(spec, Spec):
        raise TypeError(f"spec must be a tilegen.Spec, got {type(spec).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed; allowed values: {list(BACKENDS)}")
    if backend == "cuda":
        from tilegen.runtime.cuda import CudaBlockSparseAttention

        return CudaBlockSparseAttention(spec, config)
    if backend == "hip":
        return _load_hip(spec, config)
    if isinstance(target, str):
        from tilegen.targets import get_target

        target = get_target(target)
    elif target is None:
        target = detect_target()
    if config is not None:
        if not isinstance(config, KernelConfig):
            raise TypeError(f"config must be a tilegen.KernelConfig, got {type(config).__name__}")
        source = "explicit"
    else:
        config, source = resolve_config(spec, target)
    if target is not None:
        cfgmod.check(spec, target, config)
    else:
        problems = [p for p in (cfgmod.tiles_divide_cubes(spec, None, config),  # type: ignore[arg-type]
                                cfgmod.tiles_fit_mma(spec, None, config)) if p]  # type: ignore[arg-type]
        if problems:
            raise ValueError(f"config {config.name} is invalid: " + "; ".join(problems))
    return BlockSparseAttention(spec, config, target, source)


def _load_hip(spec: Spec, config: KernelConfig | None):
    from tilegen.compile.hip import build_hip, hip_violations
    from tilegen.paths import cache_dir
    from tilegen.runtime.hip import HipBlockSparseAttention
    from tilegen.targets import get_target

    _note_once("backend='hip' (gfx942): runs on a CPU executor of the HIP source with "
               "ISA-documented MFMA semantics; never run on an MI300")
    target = get_target("gfx942")
    cfg = config or cfgmod.default_config(target, spec)
    problems = cfgmod.violations(spec, target, cfg) + hip_violations(spec, cfg)
    if problems:
        raise ValueError(f"config {cfg.name} is invalid for the HIP backend: "
                         + "; ".join(problems))
    artifact = build_hip(spec, cfg, cache_dir() / "hip-build")
    return HipBlockSparseAttention(spec, cfg, artifact)


# -- torch.library custom op --------------------------------------------------------------------
_ops: dict[Spec, BlockSparseAttention] = {}


def _op_for(q: torch.Tensor, layout: str) -> BlockSparseAttention:
    """The op for q's dtype and head dim; errors name the argument, as validate_inputs does."""
    _tensor("q", q)
    if q.dtype not in SPEC_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; block_sparse_attention takes "
                        f"{[str(d) for d in SPEC_DTYPES]}")
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout={layout!r} is not allowed; allowed values: ['bshd', 'bhsd']")
    if q.dim() != 4 or q.shape[-1] not in (64, 128):
        raise ValueError(f"q must be 4-D {layout.upper()} with head dim 64 or 128, "
                         f"got shape {tuple(q.shape)}")
    spec = Spec(head_dim=q.shape[-1], dtype=SPEC_DTYPES[q.dtype], layout=layout)
    op = _ops.get(spec)
    if op is None:
        op = _ops[spec] = load(spec)
    return op


@torch.library.custom_op("tilegen::block_sparse_attention", mutates_args=())
def _block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor,
    counts: torch.Tensor | None,
    layout: str,
    sm_scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse = _op_for(q, layout)(q, k, v, topk_idx, vbs, counts, sm_scale=sm_scale)
    return o, lse


@_block_sparse_attention.register_fake
def _block_sparse_attention_fake(q, k, v, topk_idx, vbs, counts, layout, sm_scale):
    if layout == "bshd":
        B, S, H, _ = q.shape
    else:
        B, H, S, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, H, S), dtype=torch.float32)


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor,
    counts: torch.Tensor | None = None,
    *,
    return_lse: bool = False,
    layout: str = "bshd",
    sm_scale: float | None = None,
):
    """Block-sparse attention with the default spec for q's dtype and head dim.

    A `torch.library` custom op (``torch.ops.tilegen.block_sparse_attention``) with a fake
    implementation, so ``torch.compile(fullgraph=True)`` traces models that call it.
    """
    o, lse = torch.ops.tilegen.block_sparse_attention(q, k, v, topk_idx, vbs, counts, layout,
                                                      sm_scale)
    return (o, lse) if return_lse else o
