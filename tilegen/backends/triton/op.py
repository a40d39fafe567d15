"""The Triton backend's op: validate on the host, launch the generated kernel, no host sync.

Execution paths:

- CUDA / ROCm tensors: the generated Triton kernel, compiled by Triton's JIT. Index, vbs and
  count values are not read back: the kernel guards its loads, writes NaN into the rows a bad
  value touched and sets a device error word (`tilegen.inputs.DeviceErrorFlag`) that a later
  call, or `op.check()`, raises as a ValueError. ``check_values=True`` checks eagerly instead.
- CPU tensors with TRITON_INTERPRET=1: the same generated kernel under Triton's interpreter.
  Triton 3.6's interpreter computes bf16 ``tl.dot`` wrongly (it multiplies raw bits) and
  truncates fp32 -> bf16 casts, so for bf16 the kernel runs with the ``interp_bf16`` option (see
  `KernelConfig`; the kernel's constexpr INTERP_BF16); the op says so once in the log. fp16
  runs the GPU kernel unchanged.
- CPU tensors otherwise: the fp32 PyTorch path (`tilegen.reference`), cast to the input dtype.

Gradients flow to q, k and v on every path (`_Attention`, a `torch.autograd.Function`): the
backward kernels (`tilegen.backends.triton.backward`: delta preprocess, dQ over the LUT, dK/dV
over the inverse map) on GPUs and under the interpreter; the fp32 reference backward
(`tilegen.reference.attention_backward_fp32`, the same function as autograd through
`attention_fp32`) on the CPU PyTorch path. Padded query rows (past
vbs of their cube) are masked in the backward: garbage there in q, k, v or dO never reaches a
real gradient.

On the CPU the values are always checked eagerly.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from tilegen.backends.triton.backward import (
    BACKWARD_KERNELS,
    BACKWARD_PACKED,
    BackwardConfig,
    BackwardMaps,
    PackedTiles,
    backward_maps,
    finish_atomic_dq,
    grouped_lut,
    render_triton_backward,
)
from tilegen.backends.triton.jit import interpreting, load_triton
from tilegen.backends.triton.render import render_triton
from tilegen.config import KernelConfig
from tilegen.inputs import (
    DeviceErrorFlag,
    Shapes,
    check_sm_scale,
    needs_grad,
    query_vbs,
    validate_inputs,
    validate_sliding_tile_inputs,
)
from tilegen.maxprob import AttentionOutput, cube_mean, empty_buffers
from tilegen.reference import LOG2E, attention_backward_fp32, attention_fp32
from tilegen.spec import Spec
from tilegen.targets import Target

log = logging.getLogger("tilegen")

_noted: set[str] = set()


def note_once(message: str, level: int = logging.INFO) -> None:
    if message not in _noted:
        _noted.add(message)
        log.log(level, message)


def residual_of(o: torch.Tensor, o_acc: torch.Tensor) -> torch.Tensor:
    """O's rounding residual in o's dtype from `forward_for_grad`'s third output (the residual
    itself, or the fp32 O): o + residual carries O to ~16 bits for the backward's delta."""
    if o_acc.dtype == o.dtype:
        return o_acc
    return (o_acc - o.to(torch.float32)).to(o.dtype)


class _Attention(torch.autograd.Function):
    """Forward launch saving (o, lse) and the backward kernels: o and lse are differentiable
    outputs (a gradient of lse folds into delta); topk_idx, vbs and counts get none.
    ``max_prob_out`` (a pair of buffers or None) is filled by the same launch; the signal has no
    gradient."""

    @staticmethod
    def forward(ctx, op, q, k, v, topk_idx, vbs, counts, sm_scale, shapes, max_prob_out,
                q_vbs=None):
        o, lse, o_acc = op.forward_for_grad(q, k, v, topk_idx, vbs, counts, shapes=shapes,
                                            sm_scale=sm_scale, max_prob_out=max_prob_out,
                                            q_vbs=q_vbs, residual=True)
        o_lo = residual_of(o, o_acc)
        ctx.save_for_backward(q, k, v, o, o_lo, lse, topk_idx, vbs, counts, q_vbs)
        ctx.op, ctx.sm_scale = op, sm_scale
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, o_lo, lse, topk_idx, vbs, counts, q_vbs = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = ctx.op.backward(do, q, k, v, o, lse, topk_idx, vbs, counts,
                                     sm_scale=ctx.sm_scale, dlse=dlse, q_vbs=q_vbs, o_lo=o_lo)
        return None, dq, dk, dv, None, None, None, None, None, None, None


class BlockSparseAttention:
    """A loaded kernel: ``o, lse = op(q, k, v, topk_idx, vbs, counts=None)``."""

    backend = "triton"
    #: writes the softmax-normalizer signal (``return_max_prob=True``, `tilegen.maxprob`)
    provides_max_prob = True
    #: takes K/V of their own length and heads, and a q_vbs (`KernelConfig.separate_kv`)
    takes_separate_kv = True

    def __init__(self, spec: Spec, config: KernelConfig, target: Target | None,
                 source: str = "default") -> None:
        self.spec = spec
        self.config = config
        self.target = target
        #: where the config came from: "explicit", "winner", "default" or "reference"
        self.config_source = source
        self.errors = DeviceErrorFlag()
        # rendered and imported once per render-time variant: rendering on every call would
        # cost the op milliseconds of host time
        self._kernels: dict[KernelConfig, object] = {}
        self._bwd_kernels: dict[tuple[KernelConfig, BackwardConfig], dict[str, object]] = {}
        self._backward_config: BackwardConfig | None = None
        self._gluon_bwd: dict = {}
        self._full_vbs: dict = {}  # `query_vbs`'s full query cubes
        self._bwd_pinned = False  # set by assigning backward_config
        #: the family whose forward serves calls that need gradients (`grad_forward`)
        self.grad_forward_family = "gluon"
        self._grad_forward = None

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
        return_max_prob: bool = False,
        check_values: bool = False,
        q_vbs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | AttentionOutput:
        """Validate, then run. Returns (o, lse), or o alone when return_lse=False (lse is then
        never computed). ``check_values`` checks index, vbs and count values before launch (one
        host sync); on the CPU they are always checked.

        k and v may differ from q in length (cross-attention: ``S_kv`` tokens; topk_idx names
        KV cubes in ``[0, NKV)``, one row per query cube) and in head count (GQA/MQA:
        ``H_q = g * H_kv``, query head h reads KV head ``h // g``). ``vbs`` is the KV cubes'
        real tokens, ``q_vbs`` (int32, (NQ,)) the query cubes' real rows: by default ``vbs``
        when q and k/v have one length, else every row real. Such calls render the kernels
        with ``separate_kv`` (`tilegen.config.KernelConfig`).

        ``return_max_prob=True`` returns ``AttentionOutput(o, lse, max_prob, max_prob_cube)``
        (`tilegen.maxprob`; lse None when return_lse=False): the softmax-normalizer signal
        ``1 / l`` per row, fp32 (B, H, S), and its mean over each query cube's real rows, fp32
        (B, H, NQ), written by the same launch's epilogue."""
        on_cpu = q.device.type == "cpu"
        shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                 check_values=check_values or on_cpu, q_vbs=q_vbs,
                                 separate_kv=True)
        check_sm_scale(sm_scale)
        q_vbs = self.query_vbs(shapes, vbs, q_vbs)
        mp = self.max_prob_buffers(q, shapes) if return_max_prob else None
        if needs_grad(q, k, v):  # lse is computed (and saved) whatever return_lse says
            o, lse = _Attention.apply(self, q, k, v, topk_idx, vbs, counts, sm_scale, shapes, mp,
                                      q_vbs)
        else:
            o, lse = self._forward(q, k, v, topk_idx, vbs, counts, shapes, sm_scale, return_lse,
                                   mp, q_vbs)
        if mp is not None:
            return AttentionOutput(o, lse if return_lse else None, *mp)
        return (o, lse) if return_lse else o

    def max_prob_buffers(self, q: torch.Tensor, shapes: Shapes
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(max_prob, max_prob_cube) buffers for one call: the cube buffer is zeroed when
        programs of one cube add their shares atomically (block_m < block_q)."""
        split = self.spec.block_q // self.kernel_config(q.device).block_m > 1
        return empty_buffers(shapes.batch, shapes.heads, shapes.seq_len, shapes.num_q_blocks,
                             q.device, zero_cube=split)

    def query_vbs(self, shapes: Shapes, vbs: torch.Tensor, q_vbs: torch.Tensor | None
                  ) -> torch.Tensor | None:
        """The kernels' Q_VBS for a call of separate K/V (`tilegen.inputs.query_vbs`)."""
        return query_vbs(shapes, vbs, q_vbs, self.spec.block_q, self._full_vbs)

    def query_vbs_of(self, q: torch.Tensor, k: torch.Tensor, vbs: torch.Tensor,
                     q_vbs: torch.Tensor | None) -> torch.Tensor | None:
        """`query_vbs` from the tensors' shapes (no checks: the forward did them)."""
        axis = 1 if self.spec.layout == "bshd" else 2
        S, S_kv = q.shape[axis], k.shape[axis]
        shapes = Shapes(q.shape[0], S, q.shape[3 - axis], q.shape[3], S // self.spec.block_q,
                        S_kv // self.spec.block_kv, 0, S_kv, k.shape[3 - axis],
                        q_vbs is not None or k.shape != q.shape)
        return self.query_vbs(shapes, vbs, q_vbs)

    def _pytorch_path(self, device: torch.device) -> bool:
        return device.type == "cpu" and not interpreting()

    def _forward(self, q, k, v, topk_idx, vbs, counts, shapes, sm_scale, store_lse,
                 max_prob_out=None, q_vbs=None):
        if self._pytorch_path(q.device):
            o, lse = self._pytorch_forward(q, k, v, topk_idx, vbs, counts, sm_scale,
                                           max_prob_out, q_vbs)
            return o.to(q.dtype), lse
        self.errors.raise_pending(q.device)
        return self._launch(q, k, v, topk_idx, vbs, counts, shapes=shapes, sm_scale=sm_scale,
                            store_lse=store_lse, max_prob_out=max_prob_out, q_vbs=q_vbs)

    def _pytorch_forward(self, q, k, v, topk_idx, vbs, counts, sm_scale, max_prob_out=None,
                         q_vbs=None):
        """The CPU PyTorch path: the fp32 reference; the signal, when asked, from the same
        softmax (`attention_fp32(max_prob=True)`) and its cube mean over the real query rows
        (`tilegen.maxprob`)."""
        has_vbs = self.spec.variable_block_sizes
        vbs_ = vbs if has_vbs else None
        out = attention_fp32(q, k, v, topk_idx, vbs_, counts, layout=self.spec.layout,
                             block=self.spec.block_kv, sm_scale=sm_scale,
                             max_prob=max_prob_out is not None)
        if max_prob_out is not None:
            rows = (q_vbs if q_vbs is not None else vbs) if has_vbs else None
            max_prob_out[0].copy_(out[2])
            max_prob_out[1].copy_(cube_mean(out[2], rows, self.spec.block_q))
        return out[0], out[1]

    def forward_for_grad(self, q, k, v, topk_idx, vbs, counts=None, *,
                         shapes: Shapes | None = None, sm_scale: float | None = None,
                         max_prob_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                         q_vbs: torch.Tensor | None = None, residual: bool = False,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward of a call that needs gradients: (o, lse, o_acc), o_acc being o before
        its rounding to the input dtype (fp32), which the backward's delta = rowsum(dO * O)
        needs: with the rounded o, delta is off by ~2^-9 |dO||O| per row, and on a head whose
        softmax is nearly one-hot (the outlier head) dS = P (dP - delta) cancels to the size of
        that error (on the H200 default workload dQ's max error went from 0.46% to 0.92% of
        max|dQ|, against the rule's 1%). The kernel writes fp32 directly (Triton specialises
        the store on the output pointer's dtype); o is its rounding. On a GPU with wgmma the
        launch is the tuned Gluon forward's instead (`grad_forward`), which writes o, lse and
        the fp32 O in one pass. ``max_prob_out`` (see `launch`) is filled by the same launch.
        ``q_vbs``: a call of separate K/V (`query_vbs`), which this op's own kernel runs.
        ``residual`` asks for O's rounding residual ``o_acc - o`` in q's dtype instead, half the
        bytes (the Gluon forward writes it in the same launch where its config stores O by TMA;
        the backward takes it as ``o_lo`` beside o): the third output may still be the fp32 O,
        so callers pass it through `residual_of`."""
        if shapes is None:
            shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                     check_values=False, q_vbs=q_vbs, separate_kv=True)
            q_vbs = self.query_vbs(shapes, vbs, q_vbs)
        if self._pytorch_path(q.device):
            o_acc, lse = self._pytorch_forward(q, k, v, topk_idx, vbs, counts, sm_scale,
                                               max_prob_out, q_vbs)
            return o_acc.to(q.dtype), lse, o_acc
        fast = self.grad_forward() if q.device.type == "cuda" else None
        if fast is not None and (getattr(fast, "takes_separate_kv", False)
                                 or not shapes.separate_kv):
            extra = {"q_vbs": q_vbs} if shapes.separate_kv else {}
            if residual:
                extra["residual"] = True
            return fast.forward_for_grad(q, k, v, topk_idx, vbs, counts, shapes=shapes,
                                         sm_scale=sm_scale, max_prob_out=max_prob_out,
                                         errors=self.errors, **extra)
        self.errors.raise_pending(q.device)
        o_acc = torch.empty_like(q, dtype=torch.float32)
        lse = torch.empty((shapes.batch, shapes.heads, shapes.seq_len),
                          dtype=torch.float32, device=q.device)
        self._launch(q, k, v, topk_idx, vbs, counts, shapes=shapes, sm_scale=sm_scale,
                     out=(o_acc, lse), max_prob_out=max_prob_out, q_vbs=q_vbs)
        return o_acc.to(q.dtype), lse, o_acc

    def grad_forward(self):
        """The op whose forward serves calls that need gradients: the Gluon family's (its tuned
        winner, as `tilegen.load` resolves it) when this op's target is a wgmma GPU that the
        Gluon kernel can compute the spec on (BSHD, LUT, 64-token cubes); None otherwise (this
        op's own kernel, and for an op of an explicit config: it pins its variant).
        ``grad_forward_family = "triton"`` pins the Triton forward."""
        if self._grad_forward is None:
            self._grad_forward = False
            if (self.grad_forward_family == "gluon" and self.target is not None
                    and self.config_source != "explicit"
                    and "gluon" in self.target.backends):
                from tilegen.backends.gluon.backward import spec_problem

                if spec_problem(self.spec, self.target) is None:
                    # the family's winner, as `tilegen.load` resolves it (the registry and the
                    # winner lookup directly: the ops module imports this one)
                    from tilegen import backends
                    from tilegen.winners import lookup_config

                    impl = backends.get("gluon")
                    cfg = lookup_config(self.spec, self.target, backend="gluon")
                    source = "winner" if cfg is not None else "default"
                    cfg = cfg or impl.default_config(self.spec, self.target)
                    impl.check(self.spec, self.target, cfg)
                    self._grad_forward = impl.make_op(self.spec, cfg, self.target, source)
        return self._grad_forward or None

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, topk_idx: torch.Tensor, vbs: torch.Tensor,
                 counts: torch.Tensor | None = None, *, sm_scale: float | None = None,
                 dlse: torch.Tensor | None = None, q_vbs: torch.Tensor | None = None,
                 o_lo: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) given dO (and optionally d lse), from the forward's o and base-2 lse.
        ``o`` is best the fp32 ``o_acc`` of `forward_for_grad` (any float dtype is taken), or o
        in q's dtype with ``o_lo`` its rounding residual (`residual_of`).
        ``q_vbs``: as the forward's (`query_vbs`; K/V of their own shape), dk and dv then have
        k's shape (GQA: summed over each group).

        No input checks (the forward did them). Padded slots of dq, dk and dv come out zero.
        On the CPU PyTorch path: the fp32 reference backward (`attention_backward_fp32`)."""
        if self._pytorch_path(q.device):
            has_vbs = self.spec.variable_block_sizes
            dq, dk, dv = attention_backward_fp32(
                q, k, v, topk_idx, vbs if has_vbs else None, counts,
                do, dlse, layout=self.spec.layout, block=self.spec.block_kv, sm_scale=sm_scale,
                q_vbs=q_vbs if has_vbs else None)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        self.errors.raise_pending(q.device)
        return self.launch_backward(do, q, k, v, o, lse, topk_idx, vbs, counts,
                                    sm_scale=sm_scale, dlse=dlse, q_vbs=q_vbs, o_lo=o_lo)

    @property
    def backward_config(self) -> BackwardConfig:
        """Launch parameters and template options of the backward kernels: the tuned winner of
        the ``triton_bwd`` family for this device (resolved like the forward's: the tuning DB,
        then the shipped winners, the nearest tuned workload counting), else the target's
        default (`BackwardConfig.default_for`). Resolved at first use; assignable."""
        if self._backward_config is None:
            bcfg = BackwardConfig.default_for(self.target, self.spec)
            if self.target is not None:
                from tilegen.winners import lookup_config

                found = lookup_config(self.spec, self.target, backend="triton_bwd")
                if found is not None:
                    bcfg = BackwardConfig.from_kernel_config(found)
            self._backward_config = bcfg.fit(self.spec)
        return self._backward_config

    @backward_config.setter
    def backward_config(self, value: BackwardConfig) -> None:
        problems = value.violations(self.spec)
        if problems:
            raise ValueError(f"backward config {value.name} is invalid: " + "; ".join(problems))
        self._backward_config = value
        self._bwd_pinned = True

    def backward_kernels(self, device: torch.device, bwd: BackwardConfig | None = None,
                         separate_kv: bool = False) -> dict[str, object]:
        """The three backward kernels for `device` and the template options of `bwd` (default:
        the op's backward config), rendered and imported once."""
        cfg = self.kernel_config(device, separate_kv=separate_kv)
        opts = (bwd or self.backward_config).render_options()
        kernels = self._bwd_kernels.get((cfg, opts))
        if kernels is None:
            src = render_triton_backward(self.spec, cfg, self.target, opts)
            kernels = self._bwd_kernels[(cfg, opts)] = {
                k: load_triton(src, name) for k, name in BACKWARD_KERNELS.items()}
        return kernels

    def gluon_backward(self, device: torch.device, bwd: BackwardConfig,
                       separate_kv: bool = False):
        """The Gluon backward kernels (`tilegen.backends.gluon.backward.GluonBackward`) at the
        stages of `bwd`, for this op's target (a wgmma target with a CUDA device); with
        ``separate_kv``, GQA's (K and V of fewer heads)."""
        from tilegen.backends.gluon.backward import GluonBackward, options_for, spec_problem

        if device.type != "cuda" or self.target is None:
            raise ValueError(f"backward config {bwd.name}: the Gluon backward runs on CUDA "
                             f"devices with wgmma (sm_90); this call is on {device}")
        why = spec_problem(self.spec, self.target)
        if why:
            raise ValueError(f"backward config {bwd.name}: {why}")
        opts = options_for(bwd, self.spec)
        key = (tuple(sorted(opts.items())), separate_kv)
        run = self._gluon_bwd.get(key)
        if run is None:
            run = self._gluon_bwd[key] = GluonBackward(self.spec, self.target, opts,
                                                       separate_kv)
        return run

    def launch_backward(self, do, q, k, v, o, lse, topk_idx, vbs, counts=None, *,
                        sm_scale: float | None = None, dlse: torch.Tensor | None = None,
                        inverse: BackwardMaps | tuple[torch.Tensor, torch.Tensor] | None = None,
                        config: BackwardConfig | None = None,
                        q_vbs: torch.Tensor | None = None, o_lo: torch.Tensor | None = None):
        """Launch preprocess, dQ and dK/dV with no input checks; returns (dq, dk, dv). ``o``:
        the fp32 O, or O in q's dtype with ``o_lo`` its rounding residual (`backward`).
        ``inverse`` passes prebuilt maps (`backward_maps` for the config, or for a config
        without packing an `inverse_map`), e.g. shared by the layers of a step.

        ``q_vbs`` (`query_vbs`) runs the kernels of separate K/V. GQA alone (q's length and
        vbs) keeps a Gluon config's kernels, which read each query head's KV head and write dK
        and dV per query head, summed over each group here. Any other such call runs the Triton
        kernels whose dK/dV programs run per KV head over a grouped inverse map (`backward_maps`
        of `grouped_lut`, which ``inverse`` must then be), without the config's packing, atomic
        dQ and Gluon kernels (`BackwardConfig.for_separate_kv`)."""
        spec = self.spec
        separate = q_vbs is not None
        if spec.layout == "bshd":
            B, S, H, _ = q.shape
            S_kv, H_kv = k.shape[1], k.shape[2]
        else:
            B, H, S, _ = q.shape
            S_kv, H_kv = k.shape[2], k.shape[1]
        cfg = self.kernel_config(q.device, separate_kv=separate)
        bcfg = (config or self.backward_config).fit(spec)
        if bcfg.gluon and q.device.type != "cuda" and config is None and not self._bwd_pinned:
            # the target's default (or winner) names the Gluon kernels, which run on CUDA
            # devices only: a call on another device (the interpreter) takes the Triton ones
            bcfg = dataclasses.replace(bcfg, gluon=False, ds_store=False)
        # GQA alone on the Gluon kernels: per query head, as without GQA (ungrouped maps)
        gqa_gluon = separate and bcfg.gluon and S_kv == S and q_vbs is vbs
        if separate and not gqa_gluon:
            bcfg = bcfg.for_separate_kv()
        grouped = separate and not gqa_gluon
        problems = bcfg.violations(spec)
        if problems:
            raise ValueError(f"backward config {bcfg.name} is invalid: " + "; ".join(problems))
        kernels = self.backward_kernels(q.device, bcfg, separate_kv=separate)
        nq = S // spec.block_q
        nkv = S_kv // spec.block_kv
        # the kernel arguments of separate K/V (attention_macros.j2 `kv_layout`), or none
        q_vbs_arg: tuple = (q_vbs,) if separate else ()
        kv_len_arg: tuple = (S_kv,) if separate else ()
        kv_heads_arg: tuple = (H_kv,) if separate else ()
        if bcfg.gluon and (vbs is None or not spec.variable_block_sizes):
            # the Gluon kernels read vbs; a spec without variable block sizes has full cubes
            vbs = torch.full((nkv,), spec.block_kv, dtype=torch.int32, device=q.device)
        do = do.contiguous()
        if do.dtype != q.dtype:
            do = do.to(q.dtype)
        scale = sm_scale if sm_scale is not None else spec.sm_scale
        err = self.errors.buffer(q.device)
        delta = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
        consts, opts = bcfg.kernel_launch("preprocess")
        kernels["preprocess"][(S // consts["BLOCK_M"], B * H)](
            o, o_lo, do, delta, q_vbs if separate else vbs, S, H, HAS_O_LO=o_lo is not None,
            **consts, **opts)
        dsum = None
        if dlse is not None:  # d lse_2 / d s = log2(e) * P: fold it into delta
            dsum = (dlse.to(torch.float32) * LOG2E).contiguous()  # = sum_j dS_ij: the centring
            delta = delta - dsum
        if inverse is None:
            lut, lut_counts = (grouped_lut(topk_idx, counts, H_kv) if grouped
                               else (topk_idx, counts))
            maps = backward_maps(lut, lut_counts, vbs, nkv, spec.block_kv, bcfg)
        elif isinstance(inverse, BackwardMaps):
            maps = inverse
        else:
            maps = BackwardMaps(inverse)
        map_rows = B * (H_kv if grouped else H) * nkv + 1
        offsets_seen = (maps.inverse.offsets if isinstance(maps.inverse, PackedTiles)
                        else maps.inverse[0])
        if offsets_seen.numel() != map_rows:
            raise ValueError(f"inverse: the prebuilt map has {offsets_seen.numel()} offsets; "
                             f"this call needs {map_rows} (B * {'H_kv' if grouped else 'H'} "
                             "* NKV + 1: K/V of their own heads take backward_maps of "
                             "grouped_lut)")
        if bcfg.dkdv_pack != isinstance(maps.inverse, PackedTiles) or (
                bcfg.dq_pack and maps.lut is None):
            raise ValueError(f"inverse: the prebuilt maps do not fit backward config {bcfg.name} "
                             "(build them with backward_maps(..., config))")
        if isinstance(maps.inverse, PackedTiles):
            packed = maps.inverse
            offsets, qcubes = packed.offsets, packed.items
            dkdv_extra: tuple = (packed.tile_start, packed.tile_meta, packed.count)
        else:
            (offsets, qcubes), dkdv_extra = maps.inverse, (None,) * len(BACKWARD_PACKED["dkdv"])
        dq_extra: tuple = (None,) * len(BACKWARD_PACKED["dq"])  # constexpr None: no argument
        if bcfg.dq_pack:
            lut = maps.lut
            dq_extra = (lut.offsets, lut.items, lut.tile_start, lut.tile_meta, lut.count)
        buf = torch.float32 if cfg.interp_bf16 else q.dtype
        # GQA on the Gluon kernels: dK and dV per query head first
        dk = torch.empty_like(q if gqa_gluon else k, dtype=buf)
        dv = torch.empty_like(q if gqa_gluon else v, dtype=buf)
        dq = None if bcfg.dq_atomic else torch.empty_like(q, dtype=buf)

        def launch_dq() -> None:
            consts, opts = bcfg.kernel_launch("dq")
            tensors, scalars, flags = self.cursor_args(topk_idx, counts, H, q.device)
            kernels["dq"][(nq * (spec.block_q // consts["BLOCK_M"]), B * H)](
                q, k, v, do, lse, delta, dsum if dsum is not None else delta, *tensors, vbs,
                *q_vbs_arg, dq, err, *dq_extra, S, *kv_len_arg, H, *kv_heads_arg, nq, nkv,
                *scalars, scale * LOG2E, scale,
                HAS_DSUM=dsum is not None, **flags, **consts, INTERP_BF16=cfg.interp_bf16,
                **opts)

        if bcfg.gluon:
            if bcfg.ds_store and maps.dq_plan is None:
                raise ValueError(f"inverse: the prebuilt maps do not fit backward config "
                                 f"{bcfg.name} (build them with backward_maps(..., config))")
            self.gluon_backward(q.device, bcfg, separate_kv=gqa_gluon).run(
                q, k, v, do, lse, delta, dsum, topk_idx, vbs, maps.inverse, maps.dq_plan, dk,
                dv, err, scale, dq=dq, triton_dq=launch_dq)
            if gqa_gluon:  # the sum over each group of query heads (accumulated in fp32)
                from tilegen.backends.triton.group_sum import head_group_sum

                dk, dv = head_group_sum(dk, dv, H_kv)
        else:
            if bcfg.dq_atomic:
                dq_acc = torch.zeros_like(q, dtype=torch.float32)
                ds_sum = torch.zeros((B, H, S), dtype=torch.float32, device=q.device)
            else:
                dq_acc = ds_sum = delta  # not touched
                launch_dq()
            consts, opts = bcfg.kernel_launch("dkdv")
            kernels["dkdv"][(nkv * (spec.block_kv // consts["BLOCK_N"]),
                             B * (H_kv if separate else H))](
                q, k, v, do, lse, delta, offsets, qcubes, vbs, *q_vbs_arg, dk, dv, dq_acc,
                ds_sum, err, *dkdv_extra, S, *kv_len_arg, H, *kv_heads_arg,
                *((nq,) if separate else ()), nkv, scale * LOG2E, scale,
                ATOMIC_DQ=bcfg.dq_atomic,
                **consts, INTERP_BF16=cfg.interp_bf16, **opts)
        self.errors.after_launch(q.device)
        if bcfg.dq_atomic:
            dq = finish_atomic_dq(dq_acc, ds_sum, dsum, k, topk_idx,
                                  vbs if spec.variable_block_sizes else None, buf, spec.layout,
                                  spec.block_kv, scale)
        if cfg.interp_bf16:
            dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        return dq, dk, dv

    def check(self) -> None:
        """Wait for this op's launches and raise ValueError if any met a bad index, vbs or
        count (the explicit check of the no-sync path)."""
        self.errors.check()

    def kernel_config(self, device: torch.device, store_lse: bool = True,
                      store_max_prob: bool = False, separate_kv: bool = False) -> KernelConfig:
        cfg = self.config.replace(store_lse=store_lse, store_max_prob=store_max_prob,
                                  separate_kv=separate_kv)
        if device.type == "cpu" and self.spec.dtype == "bf16":
            cfg = cfg.replace(interp_bf16=True)
        return cfg

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_idx: torch.Tensor,
               vbs: torch.Tensor, counts: torch.Tensor | None = None, *,
               shapes: Shapes | None = None, sm_scale: float | None = None,
               store_lse: bool = True,
               out: tuple[torch.Tensor, torch.Tensor] | None = None,
               max_prob_out: tuple[torch.Tensor, torch.Tensor] | None = None,
               q_vbs: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Launch the Triton kernel with no input checks (call `validate_inputs` once first).
        K/V of their own shape take ``q_vbs`` (`query_vbs`: the call's, or its default).


        ``max_prob_out=(max_prob, max_prob_cube)``, fp32 (B, H, S) and (B, H, NQ) buffers
        (`max_prob_buffers`), renders the kernel with the signal and fills them; the cube buffer
        must be zero when block_m < block_q (its programs add their shares atomically).
        Without it the kernel is the one without the signal: no extra argument or store."""
        if shapes is None:
            shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                     check_values=False, q_vbs=q_vbs, separate_kv=True)
        return self._launch(q, k, v, topk_idx, vbs, counts, shapes=shapes, sm_scale=sm_scale,
                            store_lse=store_lse, out=out, max_prob_out=max_prob_out,
                            q_vbs=self.query_vbs(shapes, vbs, q_vbs))

    def cursor_args(self, topk_idx: torch.Tensor | None, counts: torch.Tensor | None,
                    heads: int, device: torch.device
                    ) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], dict[str, bool]]:
        """The kernel arguments of the encoding's cursor (attention_macros.j2 `cursor_params`,
        `cursor_scalars`, `cursor_constexprs`): LUT and counts, the LUT width, HAS_COUNTS."""
        return ((topk_idx, counts if counts is not None else topk_idx), (topk_idx.shape[-1],),
                {"HAS_COUNTS": counts is not None})

    def _launch(self, q, k, v, topk_idx, vbs, counts, *, shapes: Shapes,
                sm_scale: float | None = None, store_lse: bool = True,
                out: tuple[torch.Tensor, torch.Tensor] | None = None,
                max_prob_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                q_vbs: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        separate = q_vbs is not None
        cfg = self.kernel_config(q.device, store_lse, max_prob_out is not None, separate)
        if cfg.interp_bf16:
            note_once("Triton interpreter with bf16: running the kernel with interp_bf16 "
                      "(fp32 dots on bf16-rounded operands, output rounded by torch), since "
                      "Triton 3.6's interpreter gets bf16 tl.dot wrong and truncates "
                      "fp32->bf16 casts")
        kernel = self._kernels.get(cfg)
        if kernel is None:
            kernel = self._kernels[cfg] = load_triton(render_triton(self.spec, cfg, self.target))
        if out is None:
            o = torch.empty_like(q, dtype=torch.float32 if cfg.interp_bf16 else q.dtype)
            lse = torch.empty((shapes.batch, shapes.heads, shapes.seq_len), dtype=torch.float32,
                              device=q.device) if store_lse else o
        else:
            o, lse = out
        scale = sm_scale if sm_scale is not None else self.spec.sm_scale
        grid = (shapes.num_q_blocks * (self.spec.block_q // cfg.block_m),
                shapes.batch * shapes.heads)
        err = self.errors.buffer(q.device)
        tensors, scalars, flags = self.cursor_args(topk_idx, counts, shapes.heads, q.device)
        extra = () if max_prob_out is None else tuple(max_prob_out)
        sep = ((q_vbs,), (shapes.kv_seq_len,), (shapes.kv_heads,)) if separate else ((),) * 3
        kernel[grid](
            q, k, v, *tensors, vbs, *sep[0], o, lse, err, *extra,
            shapes.seq_len, *sep[1], shapes.heads, *sep[2], shapes.num_q_blocks,
            shapes.num_kv_blocks, *scalars, scale * LOG2E,
            **flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STORE_LSE=cfg.store_lse,
            INTERP_BF16=cfg.interp_bf16, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        self.errors.after_launch(q.device)
        if cfg.interp_bf16 and out is None:
            o = o.to(q.dtype)
        return o, (lse if store_lse else None)


class SlidingTileAttention(BlockSparseAttention):
    """A loaded sliding-tile kernel: ``o, lse = op(q, k, v, vbs)``. The kernel computes each
    query cube's window of KV cubes from coordinates (`Spec.window`, one per head or one for
    all; no index tensor). The window as a LUT (`tilegen.encodings.sliding_tile_lut`, built
    once per device and shape) serves the CPU PyTorch path and the backward's inverse map; the
    dQ kernel walks the window like the forward."""

    def __init__(self, spec: Spec, config: KernelConfig, target: Target | None,
                 source: str = "default") -> None:
        super().__init__(spec, config, target, source)
        self._tables: dict[tuple, object] = {}

    def __repr__(self) -> str:
        return "SlidingTile" + super().__repr__()

    def __call__(  # type: ignore[override]
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        vbs: torch.Tensor,
        *,
        sm_scale: float | None = None,
        return_lse: bool = True,
        return_max_prob: bool = False,
        check_values: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | AttentionOutput:
        """Validate, then run (as `BlockSparseAttention.__call__`, without an index tensor)."""
        on_cpu = q.device.type == "cpu"
        shapes = validate_sliding_tile_inputs(self.spec, q, k, v, vbs,
                                              check_values=check_values or on_cpu,
                                              separate_kv=True)
        check_sm_scale(sm_scale)
        q_vbs = self.query_vbs(shapes, vbs, None)  # GQA: k and v with fewer heads
        lut, counts = self.window_lut(q.device, shapes.batch, shapes.heads)
        mp = self.max_prob_buffers(q, shapes) if return_max_prob else None
        if needs_grad(q, k, v):
            o, lse = _Attention.apply(self, q, k, v, lut, vbs, counts, sm_scale, shapes, mp,
                                      q_vbs)
        else:
            o, lse = self._forward(q, k, v, lut, vbs, counts, shapes, sm_scale, return_lse, mp,
                                   q_vbs)
        if mp is not None:
            return AttentionOutput(o, lse if return_lse else None, *mp)
        return (o, lse) if return_lse else o

    def window_lut(self, device: torch.device, batch: int, heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The windows as a LUT (and counts when heads' windows differ in volume), cached."""
        key = ("lut", device, batch, heads)
        found = self._tables.get(key)
        if found is None:
            from tilegen.encodings import sliding_tile_lut

            found = self._tables[key] = sliding_tile_lut(self.spec, batch, heads, device)
        return found  # type: ignore[return-value]

    def cursor_args(self, topk_idx, counts, heads, device):
        key = ("windows", device, heads)
        table = self._tables.get(key)
        if table is None:
            from tilegen.encodings import window_table

            table = self._tables[key] = window_table(self.spec, heads, device)
        return (table,), self.spec.cube_grid, {}

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
               vbs: torch.Tensor, *, shapes: Shapes | None = None,
               sm_scale: float | None = None, store_lse: bool = True,
               out: tuple[torch.Tensor, torch.Tensor] | None = None,
               max_prob_out: tuple[torch.Tensor, torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Launch the kernel with no input checks (`validate_sliding_tile_inputs` first);
        ``max_prob_out`` as in `BlockSparseAttention.launch`."""
        if shapes is None:
            shapes = validate_sliding_tile_inputs(self.spec, q, k, v, vbs, check_values=False,
                                                  separate_kv=True)
        return self._launch(q, k, v, None, vbs, None, shapes=shapes, sm_scale=sm_scale,
                            store_lse=store_lse, out=out, max_prob_out=max_prob_out,
                            q_vbs=self.query_vbs(shapes, vbs, None))


_grad_ops: dict[tuple[Spec, str | None], BlockSparseAttention] = {}


def differentiable_op(spec: Spec, target: Target | None, family: str) -> BlockSparseAttention:
    """The Triton family's op for `spec`: the families with no backward kernels (gluon, cuda,
    hip) hand it a call whose output needs gradients, so gradients flow on every path (the
    contract); said once per family. Its config is the Triton family's tuned winner for the
    device, else the target's default."""
    key = (spec, target.name if target is not None else None)
    op = _grad_ops.get(key)
    if op is None:
        from tilegen.backends import get
        from tilegen.config import reference_config

        triton = get("triton")
        cfg = reference_config(spec)
        if target is not None:
            from tilegen.winners import lookup_config

            cfg = lookup_config(spec, target) or triton.default_config(spec, target)
        op = _grad_ops[key] = triton.make_op(spec, cfg, target, "gradients")
    note_once(f"the {family} family hands calls that need gradients to the Triton family's op "
              f"({op.config.name}); on a wgmma GPU its forward is the Gluon winner's and its "
              f"backward {op.backward_config.name}")
    return op
