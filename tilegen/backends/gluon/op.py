"""The Gluon backend's op: host-only validation, then the GPU pre-pass and the kernel.

Same call as every tilegen op: ``o, lse = op(q, k, v, topk_idx, vbs, counts=None)``. Index, vbs
and count values are checked on the GPU by the pre-pass (no host sync); a bad value turns its
row into NaN and sets the error word that a later call, or `op.check()`, raises.
``check_values=True`` checks eagerly instead.
"""

from __future__ import annotations

import logging

import torch

from tilegen.backends.triton.op import differentiable_op
from tilegen.config import KernelConfig
from tilegen.inputs import (
    DeviceErrorFlag,
    Shapes,
    check_sm_scale,
    needs_grad,
    query_vbs,
    validate_inputs,
)
from tilegen.maxprob import AttentionOutput, empty_buffers
from tilegen.spec import Spec
from tilegen.targets import Target

log = logging.getLogger("tilegen")
_warned_unrun: set[str] = set()


class GluonBlockSparseAttention:
    backend = "gluon"
    #: the devices its kernels run on (said when a call's tensors are elsewhere)
    runs_on = "CUDA devices with wgmma (sm_90) or tcgen05 (sm_100a)"
    #: takes K/V of their own length and heads, and a q_vbs (`KernelConfig.separate_kv`): the
    #: forward; a call that needs gradients goes to the Triton family's op
    takes_separate_kv = True
    #: writes the softmax-normalizer signal (``return_max_prob=True``, `tilegen.maxprob`)
    provides_max_prob = True

    def __init__(self, spec: Spec, config: KernelConfig, target: Target | None,
                 config_source: str = "explicit") -> None:
        if target is None:
            raise ValueError("the gluon backend needs a target with wgmma or tcgen05: run on "
                             "such a GPU or pass target=... (targets/*/target.toml list it in "
                             "backends)")
        from tilegen.backends.gluon.render import mma_kind

        if mma_kind(spec, target) == "tcgen05" and target.name not in _warned_unrun:
            _warned_unrun.add(target.name)
            log.warning("tilegen: the gluon family's %s (tcgen05) kernel was built and inspected "
                        "but has never run on such a GPU; compare it with backend='triton' "
                        "before you rely on it (`tilegen bench --backends triton,gluon` scores "
                        "both against the reference)", target.name)
        self.spec = spec
        self.config = config
        self.target = target
        self.config_source = config_source
        self.errors = DeviceErrorFlag(kinds=True)
        self._launches: dict[tuple[bool, bool, bool], object] = {}
        self._full_vbs: dict = {}  # `query_vbs`'s full query cubes

    def __repr__(self) -> str:
        return (f"GluonBlockSparseAttention(spec={self.spec.short_hash}, "
                f"config={self.config.name}, target={self.target.name}, "
                f"from={self.config_source})")

    def _launch_for(self, store_lse: bool, store_max_prob: bool = False,
                    separate_kv: bool = False):
        key = (store_lse, store_max_prob, separate_kv)
        run = self._launches.get(key)
        if run is None:
            from tilegen.backends.gluon import BACKEND
            from tilegen.backends.gluon.launch import GluonLaunch
            from tilegen.backends.gluon.render import options_of

            cfg = self.config.replace(store_lse=store_lse, store_max_prob=store_max_prob,
                                      separate_kv=separate_kv)
            run = GluonLaunch(BACKEND.render(self.spec, cfg, self.target), options_of(cfg),
                              self.spec.head_dim, self.target, separate_kv=separate_kv)
            self._launches[key] = run
        return run

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 topk_idx: torch.Tensor, vbs: torch.Tensor, counts: torch.Tensor | None = None,
                 *, sm_scale: float | None = None, return_lse: bool = True,
                 return_max_prob: bool = False, check_values: bool = False,
                 q_vbs: torch.Tensor | None = None):
        """(o, lse), or o with return_lse=False; with return_max_prob=True an
        `AttentionOutput(o, lse, max_prob, max_prob_cube)` whose signal the kernel's epilogue
        writes (gradient calls get it from the Triton family's op, whose forward for gradients is
        this family's kernel on a wgmma GPU). K/V of their own length or heads and ``q_vbs``
        as in `tilegen.backends.triton.op.BlockSparseAttention.__call__`."""
        shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                 check_values=check_values, q_vbs=q_vbs, separate_kv=True)
        plan = dict(topk_idx=topk_idx, counts=counts)
        rows = query_vbs(shapes, vbs, q_vbs, self.spec.block_q, self._full_vbs)
        if rows is not None:
            plan["q_vbs"] = rows
        return self._call(q, k, v, vbs, (topk_idx, vbs, counts), shapes, plan, sm_scale,
                          return_lse, return_max_prob, check_values,
                          {} if q_vbs is None else {"q_vbs": q_vbs})

    def _call(self, q, k, v, vbs, cubes: tuple, shapes: Shapes, plan: dict, sm_scale,
              return_lse: bool, return_max_prob: bool, check_values: bool,
              grad_kwargs: dict | None = None):
        """What every encoding's call does after its own input checks: ``cubes`` are the
        arguments after q, k, v (what the differentiable op takes), ``plan`` what the launch's
        pre-pass reads (`GluonLaunch.__call__`)."""
        check_sm_scale(sm_scale)
        if q.device.type != "cuda":
            raise ValueError(f"q is on {q.device}; the {self.backend} backend runs on "
                             f"{self.runs_on}")
        if needs_grad(q, k, v):
            return differentiable_op(self.spec, self.target, self.backend)(
                q, k, v, *cubes, sm_scale=sm_scale, return_lse=return_lse,
                return_max_prob=return_max_prob, check_values=check_values,
                **(grad_kwargs or {}))
        self.errors.raise_pending(q.device)
        mp = (empty_buffers(shapes.batch, shapes.heads, shapes.seq_len, shapes.num_q_blocks,
                            q.device, zero_cube=False) if return_max_prob else None)
        o, lse = self._launch_plan(q, k, v, vbs, shapes, plan, sm_scale, return_lse, None, mp)
        if mp is not None:
            return AttentionOutput(o, lse, *mp)
        return (o, lse) if return_lse else o

    def check(self) -> None:
        """Wait for this op's launches and raise ValueError if any met a bad value."""
        self.errors.check()

    def forward_for_grad(self, q, k, v, topk_idx, vbs, counts=None, *,
                         shapes: Shapes | None = None, sm_scale: float | None = None,
                         max_prob_out=None, errors: DeviceErrorFlag | None = None,
                         q_vbs: torch.Tensor | None = None, residual: bool = False,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward of a call that needs gradients, as the Triton family's
        (`BlockSparseAttention.forward_for_grad`, which hands its calls here on a wgmma target):
        (o, lse, o32), o32 being O before its rounding (fp32, written by the same launch:
        STORE_O32) for the backward's delta, or with ``residual`` O's rounding residual
        ``o32 - o`` in q's dtype where the config stores O by TMA (`o32_store_kind` 3; fp32
        otherwise: the caller checks the dtype). ``errors`` is the error word to set (default:
        this op's). ``q_vbs``: the resolved rows of a call of separate K/V (`query_vbs`)."""
        if shapes is None:
            shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                     check_values=False, q_vbs=q_vbs, separate_kv=True)
            q_vbs = query_vbs(shapes, vbs, q_vbs, self.spec.block_q, self._full_vbs)
        flag = errors or self.errors
        flag.raise_pending(q.device)
        o = torch.empty_like(q)
        launch = self._launch_for(True, max_prob_out is not None, q_vbs is not None)
        from tilegen.backends.gluon.render import o32_store_kind

        by_tma = o32_store_kind(launch.cfg, True) == 3
        o32 = torch.empty_like(q, dtype=q.dtype if residual and by_tma else torch.float32)
        lse = torch.empty((shapes.batch, shapes.heads, shapes.seq_len), dtype=torch.float32,
                          device=q.device)
        scale = sm_scale if sm_scale is not None else self.spec.sm_scale
        launch(q, k, v, topk_idx, vbs, counts, o, lse, flag.buffer(q.device), scale,
               max_prob_out=max_prob_out, o32=o32, q_vbs=q_vbs)
        flag.after_launch(q.device)
        return o, lse, o32

    def launch(self, q, k, v, topk_idx, vbs, counts=None, *, shapes: Shapes | None = None,
               sm_scale: float | None = None, store_lse: bool = True, out=None,
               max_prob_out=None, q_vbs: torch.Tensor | None = None):
        """Pre-pass and kernel with no input checks (validate once first)."""
        if shapes is None:
            shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                     check_values=False, q_vbs=q_vbs, separate_kv=True)
        plan = dict(topk_idx=topk_idx, counts=counts)
        rows = query_vbs(shapes, vbs, q_vbs, self.spec.block_q, self._full_vbs)
        if rows is not None:
            plan["q_vbs"] = rows
        return self._launch_plan(q, k, v, vbs, shapes, plan, sm_scale, store_lse, out,
                                 max_prob_out)

    def _launch_plan(self, q, k, v, vbs, shapes: Shapes, plan: dict, sm_scale, store_lse: bool,
                     out, max_prob_out):
        """Outputs, then the pre-pass named by ``plan`` and the kernel."""
        if out is None:
            o = torch.empty_like(q)
            lse = (torch.empty((shapes.batch, shapes.heads, shapes.seq_len),
                               dtype=torch.float32, device=q.device) if store_lse else None)
        else:
            o, lse = out
        scale = sm_scale if sm_scale is not None else self.spec.sm_scale
        plan = {"topk_idx": None, "counts": None, **plan}
        self._launch_for(store_lse, max_prob_out is not None, plan.get("q_vbs") is not None)(
            q, k, v, plan.pop("topk_idx"), vbs, plan.pop("counts"), o, lse,
            self.errors.buffer(q.device), scale, max_prob_out=max_prob_out, **plan)
        self.errors.after_launch(q.device)
        return o, lse


class GluonSlidingTileAttention(GluonBlockSparseAttention):
    """The Gluon kernel on a sliding-tile spec: ``o, lse = op(q, k, v, vbs)``. No index
    tensor: the pre-pass computes each query cube's window of KV cubes from its coordinates
    (`prepass._window_entries`, the centre clamped inside the cube grid; one window per head or
    one for all) and plans the tiles as for a LUT row; the kernel is the LUT kernel."""

    #: the windows follow one cube grid and q's heads: K/V of q's shape only
    takes_separate_kv = False

    def __init__(self, spec: Spec, config: KernelConfig, target: Target | None,
                 config_source: str = "explicit") -> None:
        super().__init__(spec, config, target, config_source)
        self._windows: dict[tuple[str, int], torch.Tensor] = {}

    def __repr__(self) -> str:
        return "SlidingTile" + super().__repr__()

    def windows(self, device: torch.device, heads: int) -> torch.Tensor:
        key = (str(device), heads)
        table = self._windows.get(key)
        if table is None:
            from tilegen.encodings import window_table

            table = self._windows[key] = window_table(self.spec, heads, device)
        return table

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                 vbs: torch.Tensor, *, sm_scale: float | None = None, return_lse: bool = True,
                 return_max_prob: bool = False, check_values: bool = False):
        """As `GluonBlockSparseAttention.__call__`, without an index tensor."""
        from tilegen.inputs import validate_sliding_tile_inputs

        shapes = validate_sliding_tile_inputs(self.spec, q, k, v, vbs,
                                              check_values=check_values)
        return self._call(q, k, v, vbs, (vbs,), shapes, self._plan(q, shapes), sm_scale,
                          return_lse, return_max_prob, check_values)

    def _plan(self, q: torch.Tensor, shapes: Shapes) -> dict:
        return dict(windows=self.windows(q.device, shapes.heads), cube_grid=self.spec.cube_grid,
                    topk=shapes.topk)

    def launch(self, q, k, v, vbs, *, shapes: Shapes | None = None,  # type: ignore[override]
               sm_scale: float | None = None, store_lse: bool = True, out=None,
               max_prob_out=None):
        """Pre-pass (windows from coordinates) and kernel with no input checks."""
        from tilegen.inputs import validate_sliding_tile_inputs

        if shapes is None:
            shapes = validate_sliding_tile_inputs(self.spec, q, k, v, vbs, check_values=False)
        return self._launch_plan(q, k, v, vbs, shapes, self._plan(q, shapes), sm_scale,
                                 store_lse, out, max_prob_out)
