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
from tilegen.prologue import NormRope
from tilegen.spec import Spec
from tilegen.targets import TARGET_NAMES, Target, detect_target, get_target

log = logging.getLogger("tilegen")

__all__ = ["AttentionOutput", "BlockSparseAttention", "block_sparse_attention",
           "block_sparse_attention_8bit", "block_sparse_attention_8bit_thw",
           "block_sparse_attention_varlen", "load",
           "resolve_config", "video_sparse_attention",
           "vsa_fine", "vsa_fine_op"]

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
    workload counts), else the target's `untuned_backend` family at its tuning base config
    when it builds the spec (sm_90: the CUDA wgmma kernel), else the Triton family's target
    default (logged). An 8-bit spec: the first family that computes it. With a `backend`, that
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
    if backend is None and spec.quant == "none" and target.untuned_backend != "triton":
        untuned = _untuned_default(spec, target)
        if untuned is not None:
            return untuned
    # an 8-bit spec has no Triton kernel: the first family that computes it
    name = backend or ("triton" if spec.quant == "none" or not names else names[0])
    for res in misses:
        if res.status == "stale" or name in res.message:
            _note_once(res.message, logging.WARNING)
            break
    return name, backends.get(name).default_config(spec, target), "default"


def _untuned_default(spec: Spec, target: Target) -> tuple[str, KernelConfig, str] | None:
    """The target's untuned family (target.toml ``untuned_backend``) at its tuning base config,
    when it builds `spec` (else None: the Triton default follows), logged once."""
    b = backends.get(target.untuned_backend)
    if spec.num_kv_heads is not None or b.spec_violations(spec, target):
        return None  # (GQA: K/V of their own shape, which not every family's kernel reads)
    cfg = b.tuning_base(spec, target)
    if b.violations(spec, target, cfg):
        return None
    _note_once(f"no tuned winner for spec {spec.short_hash} on this {target.name} GPU; using "
               f"the {b.name} family's untuned default {cfg.name} (targets/{target.name}/"
               "target.toml untuned_backend; run `tilegen tune` to tune it)", logging.WARNING)
    return b.name, cfg, "default"


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
        having = backends.with_quant(spec.quant)
        if not having:
            raise ValueError(f"Spec.quant={spec.quant!r}: no kernel family implements this 8-bit "
                             "recipe yet (issue #19); tilegen.quant.emulate computes it in "
                             "PyTorch")
        if backend is None:
            backend = _quant_family(spec, having, target)
        elif backend not in having:
            raise ValueError(f"backend={backend!r} has no quant={spec.quant!r} kernel; families "
                             f"with it: {having}")
        if _target_for(backends.get(backend), target) is None:
            # no target to check the 8-bit kernel against: refused, never a 16-bit stand-in
            where = [n for n in TARGET_NAMES if _quant_builds(spec, having, get_target(n))]
            raise ValueError(f"quant={spec.quant!r}: the 8-bit kernel needs a target with "
                             f"Hopper's wgmma ({where}): run on such a GPU, or pass one as "
                             "target= to build it here")
    return load_kernel_set(spec, config, target=target, backend=backend)


def _builds(name: str, spec: Spec, target: Target) -> bool:
    b = backends.get(name)
    return not b.spec_violations(spec, target) and not b.violations(
        spec, target, b.default_config(spec, target))


def _quant_builds(spec: Spec, having: list[str], target: Target) -> bool:
    return any(_builds(name, spec, target) for name in having)


def _quant_family(spec: Spec, having: list[str], target: Target | str | None) -> str:
    """The first family of `having` (by `Backend.quant_rank`) whose default config builds
    `spec` on its target (the CUDA 8-bit kernel takes head_dim 128 and BSHD; the Gluon one
    the rest), else the first (whose checks then say why it cannot)."""
    for name in having:
        tgt = _target_for(backends.get(name), target)
        if tgt is not None and _builds(name, spec, tgt):
            return name
    return having[0]


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


def _separate_kv(q: Any, k: Any, q_vbs: Any) -> bool:
    """A call whose K/V have their own shape, or that passes q_vbs."""
    return q_vbs is not None or (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                                 and k.shape != q.shape)


def _forward_op_for(q: Any, k: Any, q_vbs: Any, layout: str) -> Any:
    """The op of a call without gradients: the fastest family's, unless the call has K/V of
    their own shape (or a q_vbs) and that family addresses K/V by q's (the C++ families):
    then the Triton family's, which takes every such call."""
    op = _op_for(q, layout)
    if _separate_kv(q, k, q_vbs) and not getattr(op, "takes_separate_kv", False):
        op = _op_for(q, layout, "triton")
    return op


def _op_for(q: torch.Tensor, layout: str, backend: str | None = None) -> Any:
    """The op for q's dtype and head dim; errors name the argument, as validate_inputs does.
    With no backend, the fastest tuned family for the device (`load`); the gradient path (the
    train and backward ops) and calls of separate K/V (`_separate_kv`) ask for the Triton
    family by name: it is the family with backward kernels and separate K/V."""
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
    q_vbs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    extra = {"q_vbs": q_vbs} if q_vbs is not None else {}
    out = _forward_op_for(q, k, q_vbs, layout)(q, k, v, topk_idx, vbs, counts,
                                                sm_scale=sm_scale, return_lse=return_lse,
                                                **extra)
    if return_lse:
        return out
    return out, q.new_empty((0,), dtype=torch.float32)  # lse not computed


@_block_sparse_attention.register_fake
def _block_sparse_attention_fake(q, k, v, topk_idx, vbs, counts, layout, sm_scale,
                                 return_lse=True, q_vbs=None):
    if not return_lse:
        return torch.empty_like(q), q.new_empty((0,), dtype=torch.float32)
    if layout == "bshd":
        B, S, H, _ = q.shape
    else:
        B, H, S, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, H, S), dtype=torch.float32)


def _max_prob_op_for(q: torch.Tensor, k: Any, q_vbs: Any, layout: str) -> Any:
    """The op for a call with ``return_max_prob=True``: the fastest family's op (`_forward_op_for`);
    a family that does not write the signal is an error, not a silent switch to another family."""
    op = _forward_op_for(q, k, q_vbs, layout)
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
    q_vbs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse, max_prob, max_prob_cube) in one launch; lse is an empty tensor when
    return_lse=False. No autograd: `block_sparse_attention` calls it only for calls that need
    no gradients."""
    extra = {"q_vbs": q_vbs} if q_vbs is not None else {}
    out = _max_prob_op_for(q, k, q_vbs, layout)(q, k, v, topk_idx, vbs, counts,
                                                 sm_scale=sm_scale, return_lse=return_lse,
                                                 return_max_prob=True, **extra)
    lse = out.lse if out.lse is not None else q.new_empty((0,), dtype=torch.float32)
    return out.o, lse, out.max_prob, out.max_prob_cube


@_block_sparse_attention_max_prob.register_fake
def _block_sparse_attention_max_prob_fake(q, k, v, topk_idx, vbs, counts, layout, sm_scale,
                                          return_lse=True, q_vbs=None):
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
    q_vbs: torch.Tensor | None = None,
    o_lo: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `tilegen::block_sparse_attention` (the op's backward kernels); dk and
    dv have k's shape (GQA: summed over each group). ``o_lo``: o's rounding residual (the
    training forward's), for delta."""
    op = _op_for(q, layout, "triton")
    return op.backward(do, q, k, v, o, lse, topk_idx, vbs, counts, sm_scale=sm_scale, dlse=dlse,
                       q_vbs=op.query_vbs_of(q, k, vbs, q_vbs), o_lo=o_lo)


@_block_sparse_attention_backward.register_fake
def _block_sparse_attention_backward_fake(do, q, k, v, o, lse, topk_idx, vbs, counts, dlse,
                                          layout, sm_scale, q_vbs=None, o_lo=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, topk_idx, vbs, counts, layout, sm_scale, return_lse, q_vbs = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, None, lse, topk_idx, vbs, counts, q_vbs)
    ctx.layout, ctx.sm_scale, ctx.return_lse = layout, sm_scale, return_lse
    # an output without a gradient arrives as None, not as zeros: no dlse (the dQ kernels'
    # HAS_DSUM path) when the loss does not read lse
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dlse):
    q, k, v, o, o_lo, lse, topk_idx, vbs, counts, q_vbs = ctx.saved_tensors
    if not ctx.return_lse:
        # called directly with return_lse=False (the wrapper never does when grad is needed):
        # lse was not computed; run the forward again for it
        _, lse = torch.ops.tilegen.block_sparse_attention(q, k, v, topk_idx, vbs, counts,
                                                          ctx.layout, ctx.sm_scale, True, q_vbs)
        dlse = None
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = torch.ops.tilegen.block_sparse_attention_backward(
        do, q, k, v, o, lse, topk_idx, vbs, counts, dlse, ctx.layout, ctx.sm_scale, q_vbs, o_lo)
    return dq, dk, dv, None, None, None, None, None, None, None


_block_sparse_attention.register_autograd(_backward, setup_context=_setup_context)


# torch.compile's AOTAutograd cache keys on the traced graph, not on the autograd code below:
# a change to what these ops save or hand their backward must change an op's name or schema, or
# a warm cache replays the old backward (the fp32-O version of this op was `..._train`)
@torch.library.custom_op("tilegen::block_sparse_attention_for_grad", mutates_args=())
def _block_sparse_attention_for_grad(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor,
    counts: torch.Tensor | None,
    layout: str,
    sm_scale: float | None,
    q_vbs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward of a call that needs gradients: (o, lse, o_lo), o_lo O's rounding residual
    in q's dtype, from which with o the backward's delta is computed
    (`BlockSparseAttention.forward_for_grad` with ``residual``: half the bytes of the fp32 O)."""
    from tilegen.backends.triton.op import residual_of

    o, lse, o_acc = _op_for(q, layout, "triton").forward_for_grad(
        q, k, v, topk_idx, vbs, counts, sm_scale=sm_scale, q_vbs=q_vbs, residual=True)
    return o, lse, residual_of(o, o_acc)


@_block_sparse_attention_for_grad.register_fake
def _block_sparse_attention_for_grad_fake(q, k, v, topk_idx, vbs, counts, layout, sm_scale,
                                          q_vbs=None):
    if layout == "bshd":
        B, S, H, _ = q.shape
    else:
        B, H, S, _ = q.shape
    return (torch.empty_like(q), q.new_empty((B, H, S), dtype=torch.float32),
            torch.empty_like(q))


def _setup_context_for_grad(ctx, inputs, output):
    q, k, v, topk_idx, vbs, counts, layout, sm_scale, q_vbs = inputs
    o, lse, o_lo = output
    ctx.save_for_backward(q, k, v, o, o_lo, lse, topk_idx, vbs, counts, q_vbs)
    ctx.layout, ctx.sm_scale, ctx.return_lse = layout, sm_scale, True
    # o_lo never has a gradient: without this, autograd would fill a zero tensor of its size
    # every step, and a zero dlse would take the dQ kernels' HAS_DSUM path
    ctx.set_materialize_grads(False)


def _backward_for_grad(ctx, do, dlse, _do_lo):
    return _backward(ctx, do, dlse)


_block_sparse_attention_for_grad.register_autograd(_backward_for_grad,
                                                   setup_context=_setup_context_for_grad)


def _gqa_repeat(q: Any, k: Any, v: Any, q_vbs: Any, layout: str) -> tuple[Any, Any]:
    """K and V for a GQA/MQA call of one length without gradients: repeated to q's heads when
    the fastest family reads one K/V head per query head (the C++ families, whose kernels then
    serve it: logged once); as they are when its kernels read each query head's KV head in
    place (the Triton and Gluon families). Calls that need gradients (the Triton family),
    cross-attention and q_vbs calls (`_forward_op_for`) always go in place."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return k, v
    axis = 2 if layout == "bshd" else 1 if layout == "bhsd" else None
    if (axis is None or q_vbs is not None or k.shape == q.shape or k.shape != v.shape
            or k.shape[3 - axis] != q.shape[3 - axis] or k.shape[axis] < 1
            or q.shape[axis] % k.shape[axis]):
        return k, v  # the op's own checks (or its in-place kernels) take the call
    op = _op_for(q, layout)
    if getattr(op, "takes_separate_kv", False):
        return k, v
    group = q.shape[axis] // k.shape[axis]
    family = getattr(op, "backend", type(op).__name__)
    _note_once(f"block_sparse_attention: GQA with groups of {group}; K and V heads are repeated "
               f"x{group} for the {family} kernels, which read one K/V head per query head")
    return k.repeat_interleave(group, dim=axis), v.repeat_interleave(group, dim=axis)


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor,
    counts: torch.Tensor | None = None,
    *,
    q_vbs: torch.Tensor | None = None,
    return_lse: bool = False,
    return_max_prob: bool = False,
    layout: str = "bshd",
    sm_scale: float | None = None,
):
    """Block-sparse attention with the default spec for q's dtype and head dim.

    Cross-attention: k and v may hold ``S_kv`` tokens where q holds ``S_q`` (both whole
    cubes); ``topk_idx`` then names KV cubes in ``[0, NKV)``, one row per query cube, ``vbs``
    is the KV cubes' real tokens and ``q_vbs`` (int32, (NQ,)) the query cubes' real rows:
    by default ``vbs`` when the lengths match, else every row real.

    GQA/MQA: k and v may have ``H_kv`` heads where q has ``g * H_kv`` (query head h reads KV
    head ``h // g``); the group is inferred from the head counts, ``topk_idx`` has one row per
    query head, and dK, dV come out summed over each group. The Triton kernels read the KV head
    of each query head in place (`tilegen.config.KernelConfig.separate_kv`); where the call's
    fastest kernels are the Gluon family's (a wgmma GPU), which read one K/V head per query
    head, K and V are repeated on the device first instead (logged once; on the H200 that is
    the faster of the two, bench/RESULTS.md).

    Cross-attention and calls with ``q_vbs`` run on the Triton family, whose kernels take K/V
    of their own shape.

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
    ``torch.ops.tilegen.block_sparse_attention_for_grad``, which also computes lse and keeps O's
    rounding residual for the backward's delta (see `BlockSparseAttention.forward_for_grad`).
    """
    grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    if not grad:
        k, v = _gqa_repeat(q, k, v, q_vbs, layout)
    if return_max_prob:
        if grad:
            o, lse, _ = torch.ops.tilegen.block_sparse_attention_for_grad(
                q, k, v, topk_idx, vbs, counts, layout, sm_scale, q_vbs)
            _, _, mp, mpc = torch.ops.tilegen.block_sparse_attention_max_prob(
                q.detach(), k.detach(), v.detach(), topk_idx, vbs, counts, layout, sm_scale,
                False, q_vbs)
        else:
            o, lse, mp, mpc = torch.ops.tilegen.block_sparse_attention_max_prob(
                q, k, v, topk_idx, vbs, counts, layout, sm_scale, return_lse, q_vbs)
        return AttentionOutput(o, lse if return_lse else None, mp, mpc)
    if grad:
        o, lse, _ = torch.ops.tilegen.block_sparse_attention_for_grad(q, k, v, topk_idx, vbs,
                                                                   counts, layout, sm_scale,
                                                                   q_vbs)
    else:
        o, lse = torch.ops.tilegen.block_sparse_attention(q, k, v, topk_idx, vbs, counts,
                                                          layout, sm_scale, return_lse, q_vbs)
    return (o, lse) if return_lse else o


def block_sparse_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor,
    cu_cubes_q: torch.Tensor,
    cu_cubes_kv: torch.Tensor,
    counts: torch.Tensor | None = None,
    *,
    q_vbs: torch.Tensor | None = None,
    return_lse: bool = False,
    sm_scale: float | None = None,
    check_values: bool = False,
):
    """Block-sparse attention over a packed batch of variable-length sequences, in one launch.

    ``q (total_q, H, D)``, ``k, v (total_kv, H_kv, D)``: the sequences' tokens packed, each
    starting on a cube boundary and padded to whole cubes. ``cu_cubes_q``, ``cu_cubes_kv``
    (int32, ``(N + 1,)``, from 0): cumulative cube counts per sequence. ``topk_idx
    (H, NQ_total, TOPK)`` int32 holds KV-cube ids local to each row's sequence; ``counts
    (H, NQ_total)`` optional; ``vbs (NKV_total,)`` the KV cubes' real tokens and ``q_vbs
    (NQ_total,)`` the query cubes' (default: ``vbs`` when q and k have one length, else every
    row real). GQA as in `block_sparse_attention`. Definitions in `tilegen.varlen`.

    Returns o ``(total_q, H, D)``, or (o, lse) with lse ``(H, total_q)`` base-2. Differentiable
    in q, k, v. No host sync on a GPU: the LUT is made global on the device and a local id
    outside its sequence poisons its row like any bad index (raised on a later call);
    ``check_values=True`` (always on the CPU) checks the offsets and ids first, with one sync.
    """
    from tilegen import varlen

    for name, t in (("q", q), ("k", k), ("v", v), ("topk_idx", topk_idx)):
        _tensor(name, t)
        if t.dim() != 3:
            dims = "H, NQ_total, TOPK" if name == "topk_idx" else "total, heads, D"
            raise ValueError(f"{name} must be 3-D ({dims}) in a packed batch, got shape "
                             f"{tuple(t.shape)}")
    if counts is not None and (not isinstance(counts, torch.Tensor) or counts.dim() != 2):
        raise ValueError("counts must be a (H, NQ_total) tensor or None")
    varlen.validate_offsets(cu_cubes_q, cu_cubes_kv, q.device)
    nq, nkv = topk_idx.shape[1], vbs.numel() if isinstance(vbs, torch.Tensor) else 0
    if check_values or q.device.type == "cpu":
        if topk_idx.dtype != torch.int32:
            raise TypeError(f"topk_idx has dtype {topk_idx.dtype}, expected torch.int32")
        varlen.check_offsets(cu_cubes_q, cu_cubes_kv, topk_idx, counts, nq, nkv)
    lut = varlen.global_lut(topk_idx, cu_cubes_q, cu_cubes_kv)
    out = block_sparse_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), lut, vbs,
                                 None if counts is None else counts.unsqueeze(0).contiguous(),
                                 q_vbs=q_vbs, return_lse=return_lse, sm_scale=sm_scale)
    if return_lse:
        return out[0][0], out[1][0]
    return out[0]


#: the kernels' 64-token block: of tilegen::block_sparse_attention (its backward) and of the
#: 8-bit ops (module level: traced)
_BLOCK = Spec().block_kv


# -- the 8-bit forward (tilegen.quant's recipes, issue #19) --------------------------------------
def _quant_op_for(q: torch.Tensor, quant: str) -> Any:
    """The 8-bit op for q's dtype and head dim (`load` of ``Spec(quant=quant)``), once."""
    key = (q.dtype, q.shape[-1], "bshd", f"quant:{quant}")
    op = _ops.get(key)
    if op is None:
        spec = Spec(head_dim=q.shape[-1], dtype=SPEC_DTYPES[q.dtype], quant=quant)
        op = _ops[key] = load(spec)
    return op


@torch.library.custom_op("tilegen::block_sparse_attention_8bit", mutates_args=())
def _block_sparse_attention_8bit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 topk_idx: torch.Tensor, vbs: torch.Tensor,
                                 counts: torch.Tensor | None, quant: str,
                                 sm_scale: float | None) -> torch.Tensor:
    return _quant_op_for(q, quant)(q, k, v, topk_idx, vbs, counts, sm_scale=sm_scale,
                                   return_lse=False)


@_block_sparse_attention_8bit.register_fake
def _block_sparse_attention_8bit_fake(q, k, v, topk_idx, vbs, counts, quant, sm_scale):
    return torch.empty_like(q)


def _check_8bit_call(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What the 8-bit entry points refuse before anything loads: a call that needs gradients,
    and inputs that are not bf16/fp16 tensors."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(f"{name} computes the forward only: call it under torch.no_grad() (or "
                         "with inputs that do not require grad), or train with "
                         "block_sparse_attention")
    for arg, t in (("q", q), ("k", k), ("v", v)):
        _tensor(arg, t)
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"q has dtype {q.dtype}; the 8-bit kernels take bf16 or fp16 inputs")


def block_sparse_attention_8bit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor,
    counts: torch.Tensor | None = None,
    *,
    quant: str = "int8_fp8",
    sm_scale: float | None = None,
) -> torch.Tensor:
    """`block_sparse_attention` by an 8-bit recipe of `tilegen.quant` (``"int8_fp8"``: INT8
    Q.K, e4m3 P.V; the op of ``tilegen.load(Spec(quant=quant))`` for q's dtype and head dim):
    BSHD q, k, v of one shape in bf16 or fp16, o in q's dtype, no lse. Forward only: a call
    that needs gradients is refused (train with `block_sparse_attention`). The kernels are
    Hopper's (the CUDA family's, the Gluon one for what it does not build): elsewhere (a CPU,
    another GPU) the load raises and says why.

    A `torch.library` custom op (``torch.ops.tilegen.block_sparse_attention_8bit``) with a fake
    implementation, so ``torch.compile`` traces models that call it without a graph break."""
    _check_8bit_call("block_sparse_attention_8bit", q, k, v)
    return torch.ops.tilegen.block_sparse_attention_8bit(q, k, v, topk_idx, vbs, counts, quant,
                                                         sm_scale)


@torch.library.custom_op("tilegen::block_sparse_attention_8bit_thw", mutates_args=())
def _block_sparse_attention_8bit_thw(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     grid: list[int], cube: list[int], topk: int, quant: str,
                                     sm_scale: float | None,
                                     q_weight: torch.Tensor | None = None,
                                     k_weight: torch.Tensor | None = None,
                                     cos: torch.Tensor | None = None,
                                     sin: torch.Tensor | None = None,
                                     q_eps: float = 0.0, k_eps: float = 0.0) -> torch.Tensor:
    from tilegen import layout, prologue, sparsity

    g, c = tuple(grid), tuple(cube)
    norm_rope = None if q_weight is None else prologue.NormRope(q_weight, k_weight, q_eps,
                                                                k_eps, cos, sin)
    op = _quant_op_for(q, quant)  # first: where no kernel loads, the call says so before any work
    vbs = layout.vbs_for_grid(g, c, device=q.device)
    sparsity._check_topk(topk, vbs.numel())  # a bad topk refused before the pre-pass runs
    # the selection pools q and k from the pre-pass's read of them (`mean_pool_topk_thw`'s
    # selection up to fp32 summation order), not from a read of its own
    qi = op.quantize(q, k, v, vbs, sources=layout._sources_on(g, c, q.device), pool=True,
                     norm_rope=norm_rope)
    idx = sparsity.topk_of_means(qi.q_pool, qi.k_pool, topk)
    if getattr(op, "writes_token_order", False):  # the kernel stores o in THW order itself
        return op.from_quantized(qi, idx, vbs, sm_scale=sm_scale, return_lse=False,
                                 out_rows=layout._slot_tokens_on(g, c, q.device),
                                 out_len=q.shape[1])
    oc = op.from_quantized(qi, idx, vbs, sm_scale=sm_scale, return_lse=False)
    return layout.from_cubes(oc, g, c)


@_block_sparse_attention_8bit_thw.register_fake
def _block_sparse_attention_8bit_thw_fake(q, k, v, grid, cube, topk, quant, sm_scale,
                                          q_weight=None, k_weight=None, cos=None, sin=None,
                                          q_eps=0.0, k_eps=0.0):
    return torch.empty_like(q)


def block_sparse_attention_8bit_thw(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: tuple[int, int, int],
    topk: int,
    *,
    cube: tuple[int, int, int] = (4, 4, 4),
    quant: str = "int8_fp8",
    sm_scale: float | None = None,
    norm_rope: NormRope | None = None,
) -> torch.Tensor:
    """Mean-pool block-sparse attention of THW-ordered tokens by an 8-bit recipe, for a model
    that keeps its tokens in THW order (a video DiT's attention processor): ``q``, ``k``, ``v``
    ``(B, T*H*W, H, D)`` bf16/fp16 over ``grid``; each query cube attends to the ``topk`` KV
    cubes of `tilegen.sparsity.mean_pool_topk_thw`'s selection; o ``(B, T*H*W, H, D)`` in q's
    dtype.

    The same numbers as ``to_cubes`` of q, k, v, `mean_pool_topk` and
    `block_sparse_attention_8bit`, then ``from_cubes``, without the three reorders: the 8-bit
    pre-pass reads each cube's tokens where they lie (`tilegen.quant.quantize(...,
    sources=..., pool=True)`) and pools q and k from that read, and `sparsity.topk_of_means`
    selects from those means (the cube means up to fp32 summation order).

    ``norm_rope`` (`tilegen.prologue.NormRope`): ``q`` and ``k`` are the projections before
    Wan's RMSNorm across heads and rotary embedding (``(B, T*H*W, H, D)`` views of them), and
    the pre-pass applies both as it reads them, with `tilegen.prologue.rms_norm_rope`'s
    arithmetic bit for bit: the result is this op's on ``rms_norm_rope(q, k, ...)``, without
    the normalized q and k ever written (a pass over them less; measured, it is slower than
    the prologue and the plain pass: 1.50-1.53 ms against 1.29 alone on the H100, +7.6 ms in the
    compiled Wan step on the H200, bench/NOTES.md session 26).

    Forward only; a custom op (``torch.ops.tilegen.block_sparse_attention_8bit_thw``), traced
    by ``torch.compile`` without a graph break."""
    from tilegen import layout

    _check_8bit_call("block_sparse_attention_8bit_thw", q, k, v)
    g, c = layout._triple(grid, "grid"), layout._triple(cube, "cube")
    if math.prod(c) != _BLOCK:
        raise ValueError(f"cube={c} holds {math.prod(c)} tokens; the 8-bit kernels take "
                         f"{_BLOCK}-token cubes")
    if k.shape != q.shape or v.shape != q.shape or q.dim() != 4 \
            or q.shape[1] != g[0] * g[1] * g[2]:
        raise ValueError(f"q, k, v must be one shape (B, T*H*W, H, D) with T*H*W="
                         f"{g[0] * g[1] * g[2]} for grid={g}; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if norm_rope is None:
        return torch.ops.tilegen.block_sparse_attention_8bit_thw(q, k, v, list(g), list(c),
                                                                int(topk), quant, sm_scale)
    norm_rope.check(q, k)
    return torch.ops.tilegen.block_sparse_attention_8bit_thw(
        q, k, v, list(g), list(c), int(topk), quant, sm_scale, norm_rope.q_weight,
        norm_rope.k_weight, norm_rope.cos, norm_rope.sin, float(norm_rope.q_eps),
        float(norm_rope.k_eps))


# -- the full VSA forward (tilegen.vsa) ---------------------------------------------------------


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
        if math.prod(cube) != _BLOCK:
            raise ValueError(f"cube={cube}: gradients of video_sparse_attention need "
                             f"{_BLOCK}-token cubes (the block of the differentiable "
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
    grid: tuple[int, int, int] | list[tuple[int, int, int]],
    topk: int | list[int] | None = None,
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

    A list of grids runs packed sequences (videos of different sizes) in one call: q, k, v
    ``(1, sum_s T_s*H_s*W_s, heads, D)``, the sequences' THW tokens one after another; ``topk``
    one int for all, one per grid, or None (each grid's default density); 64-token cubes. The
    reorder and coarse stages run per sequence, the fine stage is **one** launch over all of
    them (`tilegen.vsa.forward_varlen`: each row's cubes offset to its sequence), no host sync.
    It runs as a composite of torch ops and ``tilegen::block_sparse_attention`` (autograd goes
    through it).
    """
    from tilegen import vsa

    if vsa.is_grid_list(grid):
        gs, c, topks = vsa.check_varlen_args(q, k, v, grid, topk, cube, gate, sm_scale)
        tensors = (q, k, v) if gate is None else (q, k, v, gate)

        def packed_fine(qc, kc, vc, idx, vbs, counts):
            return block_sparse_attention(qc, kc, vc, idx, vbs, counts, sm_scale=sm_scale)

        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        return vsa.forward_varlen(q, k, v, gs, topks, c, gate, sm_scale, fine=packed_fine,
                                  differentiable=grad)
    if topk is None:
        topk = vsa.default_topk(grid, cube)
    g, c, topk = vsa.check_args(q, k, v, grid, topk, cube, gate, sm_scale)
    tensors = (q, k, v) if gate is None else (q, k, v, gate)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return vsa.forward(q, k, v, g, topk, c, gate, sm_scale, fine=vsa_fine,
                           differentiable=True)
    return torch.ops.tilegen.video_sparse_attention(q, k, v, gate, list(g), topk, list(c),
                                                    sm_scale)
