"""The Triton backend's op: validate on the host, launch the generated kernel, no host sync.

Execution paths:

- CUDA / ROCm tensors: the generated Triton kernel, compiled by Triton's JIT. Index, vbs and
  count values are not read back: the kernel guards its loads, writes NaN into the rows a bad
  value touched and sets a device error word (`tilegen.inputs.DeviceErrorFlag`) that a later
  call, or `op.check()`, raises as a ValueError. ``check_values=True`` checks eagerly instead.
- CPU tensors with TRITON_INTERPRET=1: the same generated kernel under Triton's interpreter.
  Triton 3.6's interpreter computes bf16 ``tl.dot`` wrongly (it multiplies raw bits) and
  truncates fp32 -> bf16 casts, so for bf16 the kernel is rendered with the ``interp_bf16``
  option (see `KernelConfig`); the op says so once in the log. fp16 runs the GPU text unchanged.
- CPU tensors otherwise: the fp32 PyTorch path (`tilegen.reference`), cast to the input dtype;
  it is differentiable.

On the CPU the values are always checked eagerly.
"""

from __future__ import annotations

import logging

import torch

from tilegen.backends.triton.jit import interpreting, load_triton
from tilegen.backends.triton.render import render_triton
from tilegen.config import KernelConfig
from tilegen.inputs import DeviceErrorFlag, Shapes, check_sm_scale, validate_inputs
from tilegen.reference import LOG2E, attention_fp32
from tilegen.spec import Spec
from tilegen.targets import Target

log = logging.getLogger("tilegen")

_noted: set[str] = set()


def note_once(message: str, level: int = logging.INFO) -> None:
    if message not in _noted:
        _noted.add(message)
        log.log(level, message)


def require_no_grad(*tensors: torch.Tensor) -> None:
    """The GPU kernels have no backward yet: refuse a call whose output would need a gradient
    rather than hand back a detached tensor."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(
            "block-sparse attention on the GPU has no backward pass yet (the backward kernels "
            "are tracked as issue #10): call it under torch.no_grad() or on tensors that do not "
            "require grad; the CPU path (PyTorch) is differentiable")


class BlockSparseAttention:
    """A loaded kernel: ``o, lse = op(q, k, v, topk_idx, vbs, counts=None)``."""

    backend = "triton"

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
        check_values: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """Validate, then run. Returns (o, lse), or o alone when return_lse=False (lse is then
        never computed). ``check_values`` checks index, vbs and count values before launch (one
        host sync); on the CPU they are always checked."""
        on_cpu = q.device.type == "cpu"
        shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                 check_values=check_values or on_cpu)
        check_sm_scale(sm_scale)
        if on_cpu and not interpreting():
            o, lse = attention_fp32(
                q, k, v, topk_idx, vbs if self.spec.variable_block_sizes else None, counts,
                layout=self.spec.layout, block=self.spec.block_kv, sm_scale=sm_scale)
            o = o.to(q.dtype)
        else:
            require_no_grad(q, k, v)
            self.errors.raise_pending(q.device)
            o, lse = self.launch(q, k, v, topk_idx, vbs, counts, shapes=shapes,
                                 sm_scale=sm_scale, store_lse=return_lse)
        return (o, lse) if return_lse else o

    def check(self) -> None:
        """Wait for this op's launches and raise ValueError if any met a bad index, vbs or
        count (the explicit check of the no-sync path)."""
        self.errors.check()

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
            note_once("Triton interpreter with bf16: rendering the kernel with interp_bf16 "
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
        kernel[grid](
            q, k, v, topk_idx, counts if counts is not None else topk_idx, vbs, o, lse, err,
            shapes.seq_len, shapes.heads, shapes.num_q_blocks, shapes.num_kv_blocks,
            shapes.topk, scale * LOG2E,
            HAS_COUNTS=counts is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        self.errors.after_launch(q.device)
        if cfg.interp_bf16 and out is None:
            o = o.to(q.dtype)
        return o, (lse if store_lse else None)
