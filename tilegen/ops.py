"""The importable ops: `load(spec)` over the backend registry, and the
`tilegen::block_sparse_attention` custom op.

Every backend's op validates its inputs on the host (`tilegen.inputs`) before any launch; see
`tilegen.backends.triton.op` for where the default (Triton) op runs and how it checks values
without a host sync.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch

from tilegen import backends
from tilegen import config as cfgmod
from tilegen.backends.triton.op import BlockSparseAttention
from tilegen.config import KernelConfig
from tilegen.inputs import SPEC_DTYPES, _tensor
from tilegen.maxprob import AttentionOutput
from tilegen.spec import Spec
from tilegen.targets import TARGET_NAMES, Target, detect_target, get_target

log = logging.getLogger("tilegen")

__all__ = ["AttentionOutput", "BlockSparseAttention", "block_sparse_attention", "load",
           "resolve_config", "video_sparse_attention", "vsa_fine", "vsa_fine_op"]

_noted: set[str] = set()


def _note_once(message: str, level: int = logging.INFO) -> None:
    if message not in _noted:
        _noted.add(message)
        log.log(level, message)


def resolve_config(spec: Spec, target: Target | None, backend: str | None = None
                   ) -> tuple[str, KernelConfig, str]:
    """(backend, config, where it came from) for `spec` on this device.

    With `backend` None, the fastest current tuned winner among the target's families (the
    tuning DB, then the shipped winners; a winner of the same kernel on the nearest tuned
    workload counts), else the Triton family's target default (logged). With a `backend`, that
    family's winner or default. A machine with no tilegen target gets the reference config.
    """
    if target is None:
        if torch.cuda.is_available():  # a GPU tilegen has no target file for
            _note_once(f"no tilegen target for {torch.cuda.get_device_name()}; using the "
                       f"reference config {cfgmod.reference_config(spec).name} without target "
                       f"checks (targets: {', '.join(TARGET_NAMES)})", logging.WARNING)
        return backend or "triton", cfgmod.reference_config(spec), "reference"
    from tilegen.winners import find_winner

    names = [backend] if backend else [b.name for b in backends.for_target(target)
                                       if not b.spec_violations(spec, target)]
    best = None
    misses = []
    for name in names:
        res = find_winner(spec, target, backend=name)
        if not res.hit:
            misses.append(res)
            continue
        ms = res.median_ms if res.median_ms is not None else math.inf
        if best is None or ms < best[0]:
            best = (ms, name, res)
    if best is not None:
        _, name, res = best
        _note_once(res.message)
        return name, res.config, "winner"
    name = backend or "triton"
    for res in misses:
        if res.status == "stale" or name in res.message:
            _note_once(res.message, logging.WARNING)
            break
    return name, backends.get(name).default_config(spec, target), "default"


def _target_for(backend: backends.Backend, target: Target | str | None) -> Target | None:
    """The explicit target, else the current device's, else (for a backend that only one target
    lists) that target, so C++ sources can be built on a machine without the GPU."""
    if isinstance(target, str):
        return get_target(target)
    if target is not None:
        return target
    found = detect_target()
    if found is not None or backend.runs_on_cpu:
        return found
    listed = [get_target(n) for n in TARGET_NAMES if backend.name in get_target(n).backends]
    return listed[0] if len(listed) == 1 else None


def load(spec: Spec | None = None, config: KernelConfig | None = None, *,
         target: Target | str | None = None, backend: str | None = None) -> Any:
    """The block-sparse attention op for `spec` (default: the contract's workload spec).

    `config` pins a variant; otherwise the tuned winner for this device is used when the tuning
    DB or the shipped winners hold one (a winner of the same kernel on the nearest tuned
    workload counts), else the target's default config. Configs are checked against the
    target's and the backend's rules before anything is compiled.

    The op's arguments follow the spec's encoding: ``op(q, k, v, topk_idx, vbs, counts=None)``
    (lut), ``op(q, k, v, mask, vbs)`` (mask: `tilegen.encodings.MaskAttention`, the family's
    LUT op behind an on-device conversion) and ``op(q, k, v, vbs)`` (sliding_tile: the Triton
    and Gluon families; CUDA and HIP refuse it, naming why).

    `backend` names a kernel family of the registry (`tilegen.backends.names()`): "triton"
    (CUDA and ROCm GPUs, the interpreter, CPU), "gluon" (the warp-specialized kernel: wgmma on
    Hopper, tcgen05 on Blackwell, the latter built but never run),
    "cuda" (CK-style CUDA C++ through nvcc and the CUDA driver API) or "hip" (CK-style HIP C++
    through clang-19 and hip-python). None (the default) takes the family of the fastest tuned
    winner for this device, else "triton". A pinned `config` without a backend is a Triton
    config.
    """
    spec = spec or Spec()
    if not isinstance(spec, Spec):
        raise TypeError(f"spec must be a tilegen.Spec, got {type(spec).__name__}")
    if backend is not None and backend not in backends.names():
        # the tuned-only kernel sets (triton_bwd) are reached through their family
        raise ValueError(f"backend={backend!r} is not allowed; allowed values: "
                         f"{list(backends.names())}")
    if spec.quant != "none":
        # every device, the CPU too: a bf16 op must never stand in for an 8-bit spec
        if not backends.with_quant(spec.quant):
            raise ValueError(f"Spec.quant={spec.quant!r}: no kernel family implements the 8-bit "
                             "recipe yet (issue #19); tilegen.quant.emulate computes it in "
                             "PyTorch")
    return load_kernel_set(spec, config, target=target, backend=backend)


def load_kernel_set(spec: Spec, config: KernelConfig | None = None, *,
                    target: Target | str | None = None, backend: str | None = None) -> Any:
    """`load` for any registered kernel set, the tuned-only ones included (``triton_bwd``: the
    tuner's workers load it by name)."""
    if spec.encoding_info.converts:
        # the kernel encoding's op of the family (and its tuned winners) behind the encoding's
        # on-device conversion (mask: `tilegen.encodings.MaskAttention`)
        return spec.encoding_info.wrap_op(spec, load_kernel_set(
            spec.kernel_spec, config, target=target, backend=backend))
    if config is not None:
        if not isinstance(config, KernelConfig):
            raise TypeError(f"config must be a tilegen.KernelConfig, got {type(config).__name__}")
        backend = backend or "triton"
    impl = backends.get(backend or "triton")
    tgt = _target_for(impl, target)
    if config is not None:
        source = "explicit"
    elif tgt is None and not impl.runs_on_cpu:
        return impl.make_op(spec, None, None, "default")  # resolved at the first call
    else:
        backend, config, source = resolve_config(spec, tgt, backend)
        impl = backends.get(backend)
    if tgt is not None:
        impl.check(spec, tgt, config)
    else:
        problems = [p for p in (cfgmod.tiles_divide_cubes(spec, None, config),  # type: ignore[arg-type]
                                cfgmod.tiles_fit_mma(spec, None, config)) if p]  # type: ignore[arg-type]
        if problems:
            raise ValueError(f"config {config.name} is invalid: " + "; ".join(problems))
    return impl.make_op(spec, config, tgt, source)


# -- torch.library custom op --------------------------------------------------------------------
#: one loaded op per (dtype, head dim, layout), looked up without building a Spec per call
_ops: dict[tuple[torch.dtype, int, str, str], Any] = {}


def _op_for(q: torch.Tensor, layout: str, backend: str | None = None) -> Any:
    """The op for q's dtype and head dim; errors name the argument, as validate_inputs does.
    With no backend, the fastest tuned family for the device (`load`); the gradient path (the
    train and backward ops) asks for the Triton family by name: it is the family with backward
    kernels."""
    _tensor("q", q)
    key = (q.dtype, q.shape[-1] if q.dim() else 0, layout, backend)
    op = _ops.get(key)
    if op is not None:
        return op
    if q.dtype not in SPEC_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; block_sparse_attention takes "
                        f"{[str(d) for d in SPEC_DTYPES]}")
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout={layout!r} is not allowed; allowed values: ['bshd', 'bhsd']")
    if q.dim() != 4 or q.shape[-1] not in (64, 128):
        raise ValueError(f"q must be 4-D {layout.upper()} with head dim 64 or 128, "
                         f"got shape {tuple(q.shape)}")
    spec = Spec(head_dim=q.shape[-1], dtype=SPEC_DTYPES[q.dtype], layout=layout)
    op = _ops[key] = load(spec, backend=backend)
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
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = _op_for(q, layout)(q, k, v, topk_idx, vbs, counts, sm_scale=sm_scale,
                             return_lse=return_lse)
    if return_lse:
        return out
    return out, q.new_empty((0,), dtype=torch.float32)  # lse not computed


@_block_sparse_attention.register_fake
def _block_sparse_attention_fake(q, k, v, topk_idx, vbs, counts, layout, sm_scale,
                                 return_lse=True):
    if not return_lse:
        return torch.empty_like(q), q.new_empty((0,), dtype=torch.float32)
    if layout == "bshd":
        B, S, H, _ = q.shape
    else:
        B, H, S, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, H, S), dtype=torch.float32)


def _max_prob_op_for(q: torch.Tensor, layout: str) -> Any:
    """The op for a call with ``return_max_prob=True``: the fastest family's op; a family that
    does not write the signal is an error, not a silent switch to another family."""
    op = _op_for(q, layout)
    if not getattr(op, "provides_max_prob", False):
        family = getattr(op, "backend", type(op).__name__)
        raise ValueError(f"return_max_prob: the {family} family does not write the "
                         "softmax-normalizer signal; pass backend='triton' to tilegen.load")
    return op


@torch.library.custom_op("tilegen::block_sparse_attention_max_prob", mutates_args=())
def _block_sparse_attention_max_prob(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor,
    counts: torch.Tensor | None,
    layout: str,
    sm_scale: float | None,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse, max_prob, max_prob_cube) in one launch; lse is an empty tensor when
    return_lse=False. No autograd: `block_sparse_attention` calls it only for calls that need
    no gradients."""
    out = _max_prob_op_for(q, layout)(q, k, v, topk_idx, vbs, counts, sm_scale=sm_scale,
                                      return_lse=return_lse, return_max_prob=True)
    lse = out.lse if out.lse is not None else q.new_empty((0,), dtype=torch.float32)
    return out.o, lse, out.max_prob, out.max_prob_cube


@_block_sparse_attention_max_prob.register_fake
def _block_sparse_attention_max_prob_fake(q, k, v, topk_idx, vbs, counts, layout, sm_scale,
                                          return_lse=True):
    if layout == "bshd":
        B, S, H, _ = q.shape
    else:
        B, H, S, _ = q.shape
    nq = topk_idx.shape[2]
    lse = q.new_empty((B, H, S) if return_lse else (0,), dtype=torch.float32)
    return (torch.empty_like(q), lse, q.new_empty((B, H, S), dtype=torch.float32),
            q.new_empty((B, H, nq), dtype=torch.float32))


@torch.library.custom_op("tilegen::block_sparse_attention_backward", mutates_args=())
def _block_sparse_attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor,
    counts: torch.Tensor | None,
    dlse: torch.Tensor | None,
    layout: str,
    sm_scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `tilegen::block_sparse_attention` (the op's backward kernels)."""
    return _op_for(q, layout, "triton").backward(do, q, k, v, o, lse, topk_idx, vbs, counts,
                                                 sm_scale=sm_scale, dlse=dlse)


@_block_sparse_attention_backward.register_fake
def _block_sparse_attention_backward_fake(do, q, k, v, o, lse, topk_idx, vbs, counts, dlse,
                                          layout, sm_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, topk_idx, vbs, counts, layout, sm_scale, return_lse = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, topk_idx, vbs, counts)
    ctx.layout, ctx.sm_scale, ctx.return_lse = layout, sm_scale, return_lse


def _backward(ctx, do, dlse):
    q, k, v, o, lse, topk_idx, vbs, counts = ctx.saved_tensors
    if not ctx.return_lse:
        # called directly with return_lse=False (the wrapper never does when grad is needed):
        # lse was not computed; run the forward again for it
        _, lse = torch.ops.tilegen.block_sparse_attention(q, k, v, topk_idx, vbs, counts,
                                                          ctx.layout, ctx.sm_scale, True)
        dlse = None
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = torch.ops.tilegen.block_sparse_attention_backward(
        do, q, k, v, o, lse, topk_idx, vbs, counts, dlse, ctx.layout, ctx.sm_scale)
    return dq, dk, dv, None, None, None, None, None, None


_block_sparse_attention.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("tilegen::block_sparse_attention_train", mutates_args=())
def _block_sparse_attention_train(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor,
    counts: torch.Tensor | None,
    layout: str,
    sm_scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward of a call that needs gradients: (o, lse, o_acc), o_acc the fp32 output the
    backward's delta is computed from (`BlockSparseAttention.forward_for_grad`)."""
    return _op_for(q, layout, "triton").forward_for_grad(q, k, v, topk_idx, vbs, counts,
                                                         sm_scale=sm_scale)


@_block_sparse_attention_train.register_fake
def _block_sparse_attention_train_fake(q, k, v, topk_idx, vbs, counts, layout, sm_scale):
    if layout == "bshd":
        B, S, H, _ = q.shape
    else:
        B, H, S, _ = q.shape
    return (torch.empty_like(q), q.new_empty((B, H, S), dtype=torch.float32),
            torch.empty_like(q, dtype=torch.float32))


def _setup_context_train(ctx, inputs, output):
    q, k, v, topk_idx, vbs, counts, layout, sm_scale = inputs
    _, lse, o_acc = output
    ctx.save_for_backward(q, k, v, o_acc, lse, topk_idx, vbs, counts)
    ctx.layout, ctx.sm_scale, ctx.return_lse = layout, sm_scale, True


def _backward_train(ctx, do, dlse, _do_acc):
    return _backward(ctx, do, dlse)


_block_sparse_attention_train.register_autograd(_backward_train,
                                                setup_context=_setup_context_train)


def _kv_heads_for(q: Any, k: Any, v: Any, layout: str) -> tuple[Any, Any]:
    """GQA/MQA (``H_q = g * H_kv``, query head h reads KV head h // g): K and V with their heads
    repeated g times, so the kernels see one K/V head per query head; autograd of the repeat sums
    dK and dV over each group. Tensors of one head count, and anything the op's own checks
    should reject, pass through unchanged."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return k, v
    axis = 2 if layout == "bshd" else 1 if layout == "bhsd" else None
    if axis is None or k.shape[axis] == q.shape[axis]:
        return k, v
    hq, hk = q.shape[axis], k.shape[axis]
    if v.shape[axis] != hk:
        raise ValueError(f"k has {hk} heads and v {v.shape[axis]}: GQA needs one KV head count")
    if hk == 0 or hq % hk:
        raise ValueError(f"k has {hk} heads, which does not divide q's {hq}: GQA/MQA needs "
                         "H_q = g * H_kv")
    group = hq // hk
    _note_once(f"block_sparse_attention: GQA with groups of {group}; K and V heads are "
               f"repeated x{group} for the kernels (they read one K/V head per query head)")
    return k.repeat_interleave(group, dim=axis), v.repeat_interleave(group, dim=axis)


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor,
    counts: torch.Tensor | None = None,
    *,
    return_lse: bool = False,
    return_max_prob: bool = False,
    layout: str = "bshd",
    sm_scale: float | None = None,
):
    """Block-sparse attention with the default spec for q's dtype and head dim.

    GQA/MQA: k and v may have ``H_kv`` heads where q has ``g * H_kv`` (query head h reads KV
    head ``h // g``); the group is inferred from the head counts, ``topk_idx`` has one row per
    query head, and dK, dV come out summed over each group. The kernels read one K/V head per
    query head: K and V are repeated ``g`` times on the device first (no host sync; the copy is
    in the time of the call).

    Returns o, or (o, lse) with ``return_lse=True``. With ``return_max_prob=True`` it returns
    ``AttentionOutput(o, lse, max_prob, max_prob_cube)`` (`tilegen.maxprob`; lse None unless
    ``return_lse``): the softmax-normalizer signal 1/l per row, fp32 (B, H, S), and its mean over
    each query cube's real rows, fp32 (B, H, NQ), from the same launch
    (``torch.ops.tilegen.block_sparse_attention_max_prob``). The signal has no gradient: in a
    call that needs gradients it comes from a second, gradient-free launch with the signal on
    (the differentiable forward is unchanged), so ask for it in inference calls. Every family
    writes it (triton, gluon, cuda, hip).

    A `torch.library` custom op (``torch.ops.tilegen.block_sparse_attention``) with a fake
    implementation and a registered backward (``torch.ops.tilegen.block_sparse_attention_backward``,
    the Triton backward kernels; autograd through the fp32 reference on the CPU PyTorch path),
    so ``torch.compile(fullgraph=True)`` traces forward and backward of models that call it.
    Differentiable in q, k and v (and through lse when returned); topk_idx, vbs and counts get
    no gradient. A call that needs gradients goes through
    ``torch.ops.tilegen.block_sparse_attention_train``, which also computes lse and keeps the
    fp32 output for the backward's delta (see `BlockSparseAttention.forward_for_grad`).
    """
    k, v = _kv_heads_for(q, k, v, layout)
    grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    if return_max_prob:
        if grad:
            o, lse, _ = torch.ops.tilegen.block_sparse_attention_train(q, k, v, topk_idx, vbs,
                                                                       counts, layout, sm_scale)
            _, _, mp, mpc = torch.ops.tilegen.block_sparse_attention_max_prob(
                q.detach(), k.detach(), v.detach(), topk_idx, vbs, counts, layout, sm_scale,
                False)
        else:
            o, lse, mp, mpc = torch.ops.tilegen.block_sparse_attention_max_prob(
                q, k, v, topk_idx, vbs, counts, layout, sm_scale, return_lse)
        return AttentionOutput(o, lse if return_lse else None, mp, mpc)
    if grad:
        o, lse, _ = torch.ops.tilegen.block_sparse_attention_train(q, k, v, topk_idx, vbs,
                                                                   counts, layout, sm_scale)
    else:
        o, lse = torch.ops.tilegen.block_sparse_attention(q, k, v, topk_idx, vbs, counts,
                                                          layout, sm_scale, return_lse)
    return (o, lse) if return_lse else o


# -- the full VSA forward (tilegen.vsa) ---------------------------------------------------------
_GRAD_BLOCK = Spec().block_kv  # block of tilegen::block_sparse_attention (module level: traced)


@functools.lru_cache(maxsize=16)
def vsa_fine_op(spec: Spec) -> Any:
    """The fine kernel of `video_sparse_attention` for a workload spec (`vsa.fine_spec`):
    `load(spec)`, the tuned winner for this device, the nearest tuned workload's or the target
    default (logged by load); loaded once per spec."""
    return load(spec)


def vsa_fine(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, idx: torch.Tensor,
             vbs: torch.Tensor, grid: tuple[int, int, int], cube: tuple[int, int, int],
             sm_scale: float | None, differentiable: bool = False) -> torch.Tensor:
    """The fine stage of `video_sparse_attention`, cube-major, in the input dtype: the tuned op
    for the workload (`vsa_fine_op`) without gradients; with them `block_sparse_attention` (the
    custom op with registered backward kernels), which takes the default 64-token cubes."""
    from tilegen import vsa

    if differentiable:
        if math.prod(cube) != _GRAD_BLOCK:
            raise ValueError(f"cube={cube}: gradients of video_sparse_attention need "
                             f"{_GRAD_BLOCK}-token cubes (the block of the differentiable "
                             f"op tilegen::block_sparse_attention)")
        return block_sparse_attention(qc, kc, vc, idx, vbs, sm_scale=sm_scale)
    op = vsa_fine_op(vsa.fine_spec(qc, grid, cube, idx.shape[-1]))
    return op(qc, kc, vc, idx, vbs, sm_scale=sm_scale, return_lse=False)


@torch.library.custom_op("tilegen::video_sparse_attention", mutates_args=())
def _video_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None,
    grid: list[int],
    topk: int,
    cube: list[int],
    sm_scale: float | None,
) -> torch.Tensor:
    from tilegen import vsa

    return vsa.forward(q, k, v, tuple(grid), topk, tuple(cube), gate, sm_scale, fine=vsa_fine)


@_video_sparse_attention.register_fake
def _video_sparse_attention_fake(q, k, v, gate, grid, topk, cube, sm_scale):
    return torch.empty_like(q)


def video_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int, int],
    topk: int | None = None,
    cube: tuple[int, int, int] = (4, 4, 4),
    gate: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """The full VSA forward on THW-ordered BSHD tokens ``(B, T*H*W, heads, D)``: reorder to
    cubes, coarse attention over mean-pooled cubes (coarse output + top-k selection), the tuned
    fine kernel, ``out = fine + gate * coarse`` (``gate=None``: a gate of 1), reorder back.
    Definitions in `tilegen.vsa`. ``topk=None`` takes the default spec's density (12.5%).

    Inputs are checked on the host before anything runs (TypeError/ValueError naming the
    argument). Without gradients it is one ``torch.library`` custom op
    (``torch.ops.tilegen.video_sparse_attention``, with a fake, so ``torch.compile(fullgraph=True)``
    traces it as one node); when q, k, v or gate need gradients it runs as a composite of torch
    ops and the differentiable ``tilegen::block_sparse_attention`` op, so autograd (and
    torch.compile) go through it: gradients reach q, k, v (fine and coarse paths) and gate; the
    top-k selection gets none.
    """
    from tilegen import vsa

    if topk is None:
        topk = vsa.default_topk(grid, cube)
    g, c, topk = vsa.check_args(q, k, v, grid, topk, cube, gate, sm_scale)
    tensors = (q, k, v) if gate is None else (q, k, v, gate)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return vsa.forward(q, k, v, g, topk, c, gate, sm_scale, fine=vsa_fine,
                           differentiable=True)
    return torch.ops.tilegen.video_sparse_attention(q, k, v, gate, list(g), topk, list(c),
                                                    sm_scale)
