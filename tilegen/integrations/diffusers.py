"""diffusers' Wan transformer (``WanTransformer3DModel``, diffusers 0.42) with tilegen's
block-sparse self-attention: training-free, as seed 003 deploys it on Wan2.2-A14B (a mean-pool
selector, the fine stage only, chosen layers kept dense)::

    from tilegen.integrations.diffusers import enable_block_sparse, disable_block_sparse

    enable_block_sparse(pipe.transformer, sparsity=0.875, dense_layers=(0, 39))
    video = pipe(prompt).frames        # self-attention of layers 1..38 runs block-sparse
    disable_block_sparse(pipe.transformer)

What changes, per self-attention layer (``attn1`` of each block; the cross-attention ``attn2``,
with the I2V image branch, keeps diffusers' processor):

1. the projections, the q/k RMS norms and the rotary embedding as diffusers'
   ``WanAttnProcessor`` computes them; without gradients, the norms and the rotation of bf16 or
   fp16 projections run fused (`tilegen.prologue.rms_norm_rope`: one Triton launch a tensor on a
   GPU, where ``torch.compile`` makes one slower reduction kernel of them; the same values as
   diffusers' eager modules but where the fp32 rotation rounds to the other neighbouring bf16
   value);
2. q, k, v reordered from the model's token order (T*H*W after patchify) into cubes
   (`tilegen.layout.to_cubes`; a grid that is not whole cubes pads its edge cubes, their real
   tokens in ``vbs``);
3. per head, the ``topk`` KV cubes of each query cube by the mean-pooled scores
   (`tilegen.sparsity.mean_pool_topk`);
4. `tilegen.ops.block_sparse_attention` over them (the tuned kernel on a GPU, the PyTorch path
   on a CPU; differentiable, and one custom op under ``torch.compile``), reordered back, then
   diffusers' output projection.

The latent grid comes from the transformer's own input (a forward pre-hook reads
``hidden_states``' frames, height and width and the patch size), so the user does no
bookkeeping. ``sparsity=0.0`` (or a ``topk`` at or above the cube count) selects every cube, and
the layer computes dense attention through the block-sparse kernel.

**Precision.** The attention runs in the model's dtype when that is bf16 or fp16; an fp32 model's
q, k, v are rounded to bf16 for the kernel (tilegen's kernels take bf16 and fp16) and the output
is cast back to fp32. Scores, softmax and the P·V accumulation are fp32 inside the kernel in
every case.

`calibrate` measures each layer dense against sparse on the user's inputs and returns a
`SparsityPlan` (seed 003's per-layer gate on relative L1); ``enable_block_sparse(..., plan=...)``
applies one. `record_inputs` captures a pipeline's transformer calls to calibrate on.

**Wan2.2-A14B has two experts**: its pipeline runs ``pipe.transformer`` on the high-noise steps
and ``pipe.transformer_2`` on the low-noise ones. Each is a transformer of its own here: enable
(and calibrate) both, with a plan each (their configs are alike, so a plan made on one is not
refused on the other: keep them apart by file name); each counts its own ``dense_steps`` from
its first call.

**Multi-GPU** (diffusers 0.42's experimental parallelism; VSA is head-parallel, so each rank
runs the single-GPU selection and kernel on whole sequences of some heads):

- *Context parallelism*, ``transformer.enable_parallelism(config=ContextParallelConfig(
  ulysses_degree=P))``, before or after `enable_block_sparse`: the self-attention processors
  see diffusers' config (``_parallel_config``, set by ``enable_parallelism`` or inherited from
  the processor they replace) and run
  `tilegen.integrations.parallel.ulysses_attention` on its Ulysses process group
  (``_ulysses_mesh.get_group()``): all-to-all ``(B, S/P, H, D) -> (B, S, H/P, D)``, the
  block-sparse attention, the inverse all-to-all. Cross-attention, the I2V image branch, dense
  layers and dense steps keep diffusers' processor and its own Ulysses attention.
  ``ring_degree > 1`` and ``ulysses_anything=True`` are refused with a one-line error, by
  `enable_block_sparse` and by the processor. A plan applies per layer as on one GPU (the grid
  is the whole latent's: the pre-hook reads ``hidden_states`` before diffusers splits it);
  `calibrate` refuses a context-parallel transformer (calibrate on one process, apply the plan
  on every rank).
- *Tensor parallelism* (head sharding): the processor sees the rank's ``attn.heads`` heads and
  runs unchanged. diffusers 0.42 has no tensor-parallel plan (``_tp_plan``) for
  ``WanTransformer3DModel`` (``enable_parallelism`` refuses it), and its tensor parallelism
  runs on accelerators only, so a head-sharded Wan is a setup of one's own.

Checked on the CPU with two gloo processes (`tests/test_parallel.py`): diffusers' context
parallel hooks and this processor on a tiny Wan against one process; a head-sharded tiny Wan
(sharded by hand: Wan's q/k RMS norm spans all heads, so its sum of squares is all-reduced)
against one process. Not exercised on the CPU: ``enable_parallelism`` itself, which builds its
device mesh on the accelerator (``rank % torch.accelerator.device_count()``: a division by zero
without one), so the tests build the same mesh on the CPU, set the config up and apply
diffusers' context-parallel plan as ``enable_parallelism`` does; and NCCL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tilegen import __version__, layout, prologue
from tilegen.integrations.attention import (
    DEFAULT_SPARSITY,
    Triple,
    check_cube,
    check_sparsity,
    sparse_attention,
    topk_for,
)
from tilegen.integrations.parallel import ulysses_attention
from tilegen.spec import QUANT_MODES as QUANT_SPEC_MODES

__all__ = [
    "BlockSparseWanAttnProcessor", "LayerPlan", "SparsityPlan", "calibrate",
    "disable_block_sparse", "enable_block_sparse", "record_inputs", "topk_for",
]

log = logging.getLogger("tilegen")

SELECTORS = ("mean_pool",)
#: quant= values: Spec.quant's; "none" and "int8_fp8" run ("int8" has no kernel yet)
QUANT_MODES = QUANT_SPEC_MODES
QUANT_KERNELS = ("none", "int8_fp8")
_STATE_ATTR = "_tilegen_block_sparse"


def _require_diffusers() -> Any:
    try:
        import diffusers
    except ImportError as exc:  # one line that says how to get it
        raise ImportError("tilegen.integrations.diffusers needs diffusers: "
                          "pip install 'tilegen[diffusers]'") from exc
    return diffusers


def _self_attentions(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """``attn1`` of every block of a WanTransformer3DModel, refusing anything else by name."""
    diffusers = _require_diffusers()
    if not isinstance(transformer, diffusers.WanTransformer3DModel):
        raise TypeError("transformer must be a diffusers WanTransformer3DModel, got "
                        f"{type(transformer).__name__}")
    attns = [block.attn1 for block in transformer.blocks]
    for i, attn in enumerate(attns):
        if getattr(attn, "add_k_proj", None) is not None or attn.is_cross_attention:
            raise ValueError(f"blocks[{i}].attn1 is not a plain self-attention (it has an "
                             "image branch or is a cross-attention); tilegen replaces "
                             "self-attention only")
    return attns


def _model_config(transformer: torch.nn.Module) -> dict[str, Any]:
    """The transformer's architecture as JSON values: diffusers' bookkeeping keys and the
    weights' storage (``quantization_config``: a bitsandbytes or torchao copy of the same model
    takes the same plan) left out."""
    cfg = {k: v for k, v in dict(transformer.config).items()
           if not k.startswith("_") and k != "quantization_config"}
    return json.loads(json.dumps(cfg, default=str))


# -- plans -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One self-attention layer of a plan: ``sparsity`` (fraction of cubes dropped) or None
    for dense; ``topk`` the cubes kept at the plan's grid; what calibration measured there
    (worst relative L1 and lowest cosine over the calibration calls, of the chosen sparsity or,
    for a layer kept dense, of the least sparse candidate; None when not calibrated)."""

    index: int
    sparsity: float | None
    topk: int | None = None
    rel_l1: float | None = None
    cosine: float | None = None

    @property
    def dense(self) -> bool:
        return self.sparsity is None


@dataclasses.dataclass(frozen=True)
class SparsityPlan:
    """Which self-attention layers run sparse at which sparsity: made by `calibrate`, saved and
    loaded as JSON, applied by ``enable_block_sparse(transformer, plan=plan)``, which refuses a
    transformer whose config differs from ``config``."""

    model: str
    config: dict[str, Any]
    grid: Triple
    cube: Triple
    layers: tuple[LayerPlan, ...]
    rel_l1_gate: float | None = None
    calibration_calls: int = 0
    tilegen_version: str = __version__

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["grid"], d["cube"] = list(self.grid), list(self.cube)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SparsityPlan:
        try:
            layers = tuple(LayerPlan(**layer) for layer in d["layers"])
            plan = cls(model=d["model"], config=dict(d["config"]),
                       grid=layout._triple(d["grid"], "grid"),
                       cube=layout._triple(d["cube"], "cube"), layers=layers,
                       rel_l1_gate=d.get("rel_l1_gate"),
                       calibration_calls=int(d.get("calibration_calls", 0)),
                       tilegen_version=d.get("tilegen_version", "unknown"))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a tilegen sparsity plan: {exc}") from exc
        for i, layer in enumerate(plan.layers):
            if layer.index != i:
                raise ValueError(f"plan layer {i} says index {layer.index}")
            if layer.sparsity is not None:
                check_sparsity(layer.sparsity, f"plan layer {i}'s sparsity")
        return plan

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)  # a reader never sees half a plan
        return path

    @classmethod
    def load(cls, path: str | Path) -> SparsityPlan:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from exc
        return cls.from_dict(data)

    def check_applies_to(self, transformer: torch.nn.Module) -> None:
        """Refuse a transformer this plan was not calibrated for (class or config differ)."""
        name = type(transformer).__name__
        if name != self.model:
            raise ValueError(f"the plan is for a {self.model}, not a {name}")
        cfg = _model_config(transformer)
        diff = sorted(k for k in set(cfg) | set(self.config) if cfg.get(k) != self.config.get(k))
        if diff:
            shown = ", ".join(f"{k}: plan {self.config.get(k)!r}, transformer {cfg.get(k)!r}"
                              for k in diff[:3])
            raise ValueError(f"the plan was calibrated for another transformer config ({shown})")
        if len(self.layers) != len(transformer.blocks):
            raise ValueError(f"the plan has {len(self.layers)} layers, the transformer "
                             f"{len(transformer.blocks)}")


# -- the state a transformer carries while enabled ----------------------------------------------
@dataclasses.dataclass
class _State:
    cube: Triple
    dense_steps: frozenset[int]
    originals: list[Any]
    hook: Any = None
    grid: Triple | None = None
    step: int = -1
    last_timestep: float | None = None
    plan_grid: Triple | None = None
    calibration: _Calibration | None = None
    quant: str = "none"

    def observe(self, transformer: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """The forward pre-hook: the post-patch grid from ``hidden_states``; the denoising step
        from ``timestep`` only when ``dense_steps`` asks for it (a read of one value: a host
        sync per transformer call, so leave ``dense_steps`` empty under CUDA graphs)."""
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 5:
            raise ValueError("the transformer's hidden_states must be (B, C, frames, height, "
                             f"width), got {getattr(hidden, 'shape', type(hidden).__name__)}")
        pt, ph, pw = transformer.config.patch_size
        _, _, f, h, w = hidden.shape
        self.grid = (f // pt, h // ph, w // pw)
        if self.plan_grid is not None and self.grid != self.plan_grid:
            log.warning("tilegen: the plan was calibrated at grid %s, the transformer runs %s: "
                        "the layers keep the plan's sparsity (cubes kept scale with the grid)",
                        self.plan_grid, self.grid)
            self.plan_grid = None  # said once
        if self.dense_steps:
            t = args[1] if len(args) > 1 else kwargs.get("timestep")
            value = float(torch.as_tensor(t).max())
            # one step per new timestep (CFG's two calls at one timestep are one step); a
            # timestep above the last starts a new generation
            if self.last_timestep is None or value > self.last_timestep:
                self.step = 0
            elif value < self.last_timestep:
                self.step += 1
            self.last_timestep = value

    @property
    def dense_now(self) -> bool:
        return self.step in self.dense_steps


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on (B, S, H, D) pairs of channels (diffusers' formula and dtype
    promotions: the tables are fp32/fp64, the result cast back to x's dtype)."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2).type_as(x)


class BlockSparseWanAttnProcessor:
    """The self-attention processor `enable_block_sparse` installs on one ``attn1``:
    ``sparsity`` (fraction of cubes dropped) or ``topk`` (cubes kept, clamped to the cube
    count); the original processor runs the denoising steps listed dense.

    Under diffusers' context parallelism (``_parallel_config``, which diffusers'
    ``enable_parallelism`` sets on every processor that has the attribute, and which this one
    inherits from the processor it replaces) the layer runs `ulysses_attention` on the config's
    Ulysses process group (module docstring, "Multi-GPU")."""

    # what diffusers' enable_parallelism / set_attention_backend look for on a processor
    _attention_backend = None
    _parallel_config = None

    def __init__(self, state: _State, layer: int, original: Any, *,
                 sparsity: float | None = None, topk: int | None = None) -> None:
        self.state, self.layer, self.original = state, layer, original
        self.sparsity, self.topk = sparsity, topk
        self._parallel_config = getattr(original, "_parallel_config", None)

    def cubes_kept(self, n_cubes: int) -> int:
        if self.topk is not None:
            return min(self.topk, n_cubes)
        return topk_for(self.sparsity, n_cubes)

    def __call__(self, attn: torch.nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                 **kwargs: Any) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("tilegen's block-sparse processor serves self-attention without a "
                             "mask; this call passed encoder_hidden_states or attention_mask")
        state = self.state
        group = _ulysses_group(self._parallel_config)
        if state.dense_now and state.calibration is None:
            _share_parallel_config(self, self.original)
            return self.original(attn, hidden_states, None, None, rotary_emb, **kwargs)
        if state.grid is None:
            raise RuntimeError("tilegen: the latent grid is unknown: call the transformer "
                               "itself (its pre-hook reads the grid), not a block alone")
        defer = (_PROLOGUE_IN_PREPASS and state.quant != "none" and state.calibration is None
                 and group is None)
        q, k, v, norm_rope = _project(attn, hidden_states, rotary_emb, defer_prologue=defer)
        if state.calibration is not None:
            if group is not None:
                raise ValueError(_CALIBRATE_CP)
            out = state.calibration.measure(self, q, k, v)
        elif group is not None:
            n_cubes = math.prod(layout.cube_grid(state.grid, state.cube))
            out = ulysses_attention(q, k, v, state.grid, group=group,
                                    topk=self.cubes_kept(n_cubes), cube=state.cube,
                                    quant=state.quant)
        else:
            out = sparse_attention(q, k, v, state.grid, state.cube, self.cubes_kept,
                                   state.quant, norm_rope=norm_rope)
        out = out.flatten(2, 3).type_as(q)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


# -- diffusers' parallelism (experimental in diffusers 0.42) -------------------------------------
_CALIBRATE_CP = ("calibrate runs on one process: calibrate the transformer without context "
                 "parallelism and pass the plan to enable_block_sparse on every rank")


def _context_parallel(config: Any) -> Any:
    """The ContextParallelConfig of a diffusers ParallelConfig (or None)."""
    return getattr(config, "context_parallel_config", None)


def _ulysses_group(config: Any) -> Any:
    """The Ulysses process group of a diffusers ParallelConfig under context parallelism, None
    without it (one GPU, or tensor parallelism: each rank attends over its own heads); the
    configurations tilegen's Ulysses attention cannot run are refused in one line."""
    cp = _context_parallel(config)
    if cp is None:
        return None
    if cp.ring_degree > 1:
        raise ValueError(f"tilegen's block-sparse attention runs context parallelism as Ulysses "
                         f"only: ring_degree={cp.ring_degree} is refused (a sparse ring would "
                         "cross ranks cube by cube); use ContextParallelConfig(ulysses_degree=P)")
    if cp.ulysses_anything:
        raise ValueError("tilegen's block-sparse attention needs the heads and the tokens to "
                         "divide by ulysses_degree: ContextParallelConfig(ulysses_anything=True) "
                         "is refused")
    if cp._ulysses_mesh is None:
        raise RuntimeError("the ContextParallelConfig is not set up (no device mesh): enable it "
                           "with transformer.enable_parallelism(config=...)")
    return cp._ulysses_mesh.get_group()


def _share_parallel_config(proc: Any, original: Any) -> None:
    """Hand the processor's parallel config to diffusers' processor it replaced when diffusers
    set it on ours only (``enable_parallelism`` after `enable_block_sparse`), so the original,
    run for a dense step or restored, attends over the whole sequence too."""
    config = getattr(proc, "_parallel_config", None)
    if config is not None and getattr(original, "_parallel_config", False) is None:
        original._parallel_config = config


#: Whether the 8-bit layers hand the q/k prologue to the 8-bit pre-pass (`prologue.NormRope`:
#: the normalized q and k never written) instead of running `prologue.rms_norm_rope` first. Off:
#: measured slower, alone (1.50-1.53 ms at 1-8 heads a program against 1.29 for the prologue and
#: the plain pass, H100) and in the compiled Wan step (+7.6 ms, H200), session 26,
#: bench/NOTES.md (`bench/experiments/h200_wan_step.py --prepass-prologue` times both).
_PROLOGUE_IN_PREPASS = False


def _project(attn: torch.nn.Module, hidden: torch.Tensor,
             rotary_emb: tuple[torch.Tensor, torch.Tensor] | None, *,
             defer_prologue: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, prologue.NormRope | None]:
    """q, k, v (B, S, heads, D) as diffusers' WanAttnProcessor makes them for self-attention,
    and None. With ``defer_prologue``, where the fused prologue applies, q and k are the
    projections before it and the prologue comes back as data (`prologue.NormRope`) for a
    pass that applies it as it reads them."""
    if getattr(attn, "fused_projections", False):
        q, k, v = attn.to_qkv(hidden).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(hidden), attn.to_k(hidden), attn.to_v(hidden)
    if _fused_prologue_applies(attn, q, rotary_emb):
        cos, sin = prologue.rope_tables(*rotary_emb)
        q_eps, k_eps = _eps(attn.norm_q, q), _eps(attn.norm_k, k)
        v = v.unflatten(2, (attn.heads, -1))
        if defer_prologue:
            return (q.unflatten(2, (attn.heads, -1)), k.unflatten(2, (attn.heads, -1)), v,
                    prologue.NormRope(attn.norm_q.weight, attn.norm_k.weight, q_eps, k_eps,
                                      cos, sin))
        q, k = prologue.rms_norm_rope(q, k, attn.norm_q.weight, attn.norm_k.weight, q_eps, k_eps,
                                      cos, sin, attn.heads)
        return q, k, v, None
    q, k = attn.norm_q(q), attn.norm_k(k)
    q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
    if rotary_emb is not None:
        q, k = _apply_rotary(q, *rotary_emb), _apply_rotary(k, *rotary_emb)
    return q, k, v, None


def _fused_prologue_applies(attn: torch.nn.Module, q: torch.Tensor,
                            rotary_emb: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Whether `tilegen.prologue` computes this layer's norm and rotation: Wan's
    ``rms_norm_across_heads`` (a ``torch.nn.RMSNorm`` with a weight over all channels) on
    bf16/fp16 projections with a power-of-two head dim, rotary tables in fp32 or fp64 (as
    diffusers keeps them: in bf16 its rotation rounds after every product), forward only (the
    fused op has no backward); other layers, and any call that records gradients, run
    diffusers' modules."""
    if rotary_emb is None or any(t.dtype not in (torch.float32, torch.float64)
                                 or t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != 1
                                 for t in rotary_emb):
        return False
    width = q.shape[-1]
    head_dim = width // attn.heads
    norms = (getattr(attn, "norm_q", None), getattr(attn, "norm_k", None))
    if torch.is_grad_enabled() and (q.requires_grad or any(
            getattr(n, "weight", None) is not None and n.weight.requires_grad for n in norms)):
        return False
    return (q.dtype in (torch.bfloat16, torch.float16) and q.stride(-1) == 1
            and width % attn.heads == 0 and head_dim % 2 == 0
            and head_dim & (head_dim - 1) == 0
            and all(type(n) is torch.nn.RMSNorm and n.weight is not None
                    and tuple(n.normalized_shape) == (width,) for n in norms))


def _eps(norm: torch.nn.RMSNorm, x: torch.Tensor) -> float:
    """torch.nn.RMSNorm's epsilon (its default: the input dtype's machine epsilon)."""
    return norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA over (B, S, H, D), in the inputs' dtype: what diffusers' default backend runs."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return o.transpose(1, 2)


# -- enable / disable --------------------------------------------------------------------------
def enable_block_sparse(
    transformer: torch.nn.Module,
    *,
    sparsity: float | None = None,
    topk: int | None = None,
    selector: str = "mean_pool",
    dense_layers: Iterable[int] = (),
    dense_steps: Iterable[int] = (),
    quant: str = "none",
    plan: SparsityPlan | str | Path | None = None,
    cube: Sequence[int] | None = None,
) -> torch.nn.Module:
    """Swap the self-attention processors of a diffusers ``WanTransformer3DModel`` for
    tilegen's block-sparse one (module docstring); returns the transformer.

    Args:
        sparsity: fraction of KV cubes each query cube drops, in [0, 1) (default 0.875);
            ``0.0`` keeps every cube (dense attention through the sparse kernel).
        topk: KV cubes kept per query cube instead of ``sparsity`` (clamped to the cube count).
        selector: ``"mean_pool"`` (VSA's / seed 003's mean-pooled top-k).
        dense_layers: block indices whose self-attention keeps diffusers' processor.
        dense_steps: denoising step indices (0-based) run dense on every layer. A step is a new
            timestep value seen by the transformer (CFG's two calls at one timestep are one
            step; a rise in the timestep starts a new generation at step 0). Reading the
            timestep costs one host sync per transformer call, so leave this empty under CUDA
            graphs.
        quant: ``"none"`` (bf16/fp16 attention), or ``"int8_fp8"``: the sparse layers run
            `tilegen.quant`'s INT8 Q.K / e4m3 P.V recipe through
            `tilegen.ops.block_sparse_attention_8bit_thw` (the tokens stay in THW order: no
            reorder to cubes; forward only, Hopper GPUs: a call elsewhere raises and says why;
            dense layers and steps stay with diffusers).
            ``"int8"`` (INT8 Q.K, bf16 P.V) has no kernel yet and is refused.
        plan: a `SparsityPlan` (or its JSON file) from `calibrate`: its layers' sparsity and
            dense layers, unioned with ``dense_layers``; refused for another transformer config.
        cube: the cube shape in latent tokens, 64 tokens (the kernels' block); default (4, 4, 4),
            or the plan's (a plan calibrated on other cubes is refused with another one).

    Calling it again replaces the previous settings; `disable_block_sparse` restores diffusers'
    processors.
    """
    attns = _self_attentions(transformer)
    if selector not in SELECTORS:
        raise ValueError(f"selector={selector!r} is not allowed; allowed values: {list(SELECTORS)}")
    if quant not in QUANT_MODES:
        raise ValueError(f"quant={quant!r} is not allowed; allowed values: {list(QUANT_MODES)}")
    if quant not in QUANT_KERNELS:
        raise NotImplementedError(
            f"quant={quant!r}: no kernel computes this recipe yet (INT8 Q.K with bf16 P.V); "
            f"the processor runs {list(QUANT_KERNELS)}")
    if plan is not None and not isinstance(plan, SparsityPlan):
        plan = SparsityPlan.load(plan)
    if plan is not None and cube is not None and tuple(cube) != tuple(plan.cube):
        raise ValueError(f"cube={tuple(cube)}: the plan was calibrated on cubes {plan.cube}")
    c = check_cube(cube if cube is not None else plan.cube if plan is not None else (4, 4, 4))
    if plan is not None and (sparsity is not None or topk is not None):
        raise ValueError("give a plan or sparsity/topk, not both (the plan sets each layer's)")
    if sparsity is not None and topk is not None:
        raise ValueError("give sparsity or topk, not both")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    per_layer: list[float | None]
    if plan is not None:
        plan.check_applies_to(transformer)
        per_layer = [layer.sparsity for layer in plan.layers]
        if plan.tilegen_version != __version__:
            log.info("tilegen: applying a plan made by tilegen %s with %s", plan.tilegen_version,
                     __version__)
    else:
        fraction = DEFAULT_SPARSITY if sparsity is None else sparsity
        per_layer = [None if topk is not None else check_sparsity(fraction)] * len(attns)
    dense = set()
    for i in dense_layers:
        if isinstance(i, bool) or not isinstance(i, int) or not -len(attns) <= i < len(attns):
            raise ValueError(f"dense_layers: {i!r} is not a block index of a transformer with "
                             f"{len(attns)} blocks")
        dense.add(i % len(attns))
    steps = frozenset(dense_steps)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in steps):
        raise ValueError(f"dense_steps must be step indices >= 0, got {sorted(steps, key=str)}")
    # under context parallelism, ring_degree > 1 is refused here, before any processor changes
    for owner in [transformer] + [a.processor for a in attns]:
        _ulysses_group(getattr(owner, "_parallel_config", None))

    disable_block_sparse(transformer)
    state = _State(cube=c, dense_steps=steps, originals=[a.processor for a in attns],
                   plan_grid=tuple(plan.grid) if plan is not None else None, quant=quant)
    for i, attn in enumerate(attns):
        if i in dense or (plan is not None and per_layer[i] is None):
            continue
        attn.set_processor(BlockSparseWanAttnProcessor(
            state, i, state.originals[i], sparsity=per_layer[i], topk=topk))
    state.hook = transformer.register_forward_pre_hook(
        lambda module, args, kwargs: state.observe(module, args, kwargs), with_kwargs=True)
    setattr(transformer, _STATE_ATTR, state)
    return transformer


def disable_block_sparse(transformer: torch.nn.Module) -> torch.nn.Module:
    """Restore the processors diffusers had before `enable_block_sparse` (a no-op when not
    enabled); returns the transformer."""
    state = getattr(transformer, _STATE_ATTR, None)
    if state is None:
        return transformer
    for attn, original in zip(_self_attentions(transformer), state.originals, strict=True):
        _share_parallel_config(attn.processor, original)
        attn.set_processor(original)
    state.hook.remove()
    delattr(transformer, _STATE_ATTR)
    return transformer


# -- calibration -------------------------------------------------------------------------------
class _Calibration:
    """Per layer and candidate sparsity, the relative L1 and cosine of the sparse attention
    output against dense SDPA on the same q, k, v; the layer passes the dense output on, so
    every layer is measured on the activations of the dense model."""

    def __init__(self, candidates: Sequence[float], n_layers: int) -> None:
        self.candidates = tuple(candidates)
        self.rel_l1 = [[[] for _ in candidates] for _ in range(n_layers)]
        self.cosine = [[[] for _ in candidates] for _ in range(n_layers)]
        self.topk: list[list[int]] = [[0] * len(candidates) for _ in range(n_layers)]

    def measure(self, proc: BlockSparseWanAttnProcessor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        state = proc.state
        dense = _dense_attention(q, k, v)
        ref = dense.float()
        for j, s in enumerate(self.candidates):
            n_cubes = math.prod(layout.cube_grid(state.grid, state.cube))
            kept = topk_for(s, n_cubes)
            out = sparse_attention(q, k, v, state.grid, state.cube, kept).float()
            self.topk[proc.layer][j] = kept
            self.rel_l1[proc.layer][j].append(
                float((out - ref).abs().sum() / ref.abs().sum().clamp_min(1e-30)))
            self.cosine[proc.layer][j].append(
                float(F.cosine_similarity(out.flatten(), ref.flatten(), dim=0)))
        return dense


def _as_calls(inputs: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    calls = [dict(inputs)] if isinstance(inputs, Mapping) else [dict(c) for c in inputs]
    if not calls:
        raise ValueError("inputs holds no transformer call to calibrate on")
    return calls


def calibrate(
    transformer: torch.nn.Module,
    inputs: Mapping[str, Any] | Iterable[Mapping[str, Any]],
    *,
    rel_l1: float = 0.09,
    sparsity: float | Sequence[float] = DEFAULT_SPARSITY,
    layer_gates: Mapping[int, float] | None = None,
    cube: Sequence[int] = (4, 4, 4),
    on_call: Callable[[int, int], None] | None = None,
) -> SparsityPlan:
    """Seed 003's per-layer calibration: run the transformer on ``inputs`` (keyword arguments of
    its forward, one dict per call: a few denoising steps, e.g. from `record_inputs`) with every
    self-attention layer computed dense and sparse, and gate each layer on its relative L1.

    Each layer takes the sparsest of ``sparsity`` (one fraction, or several candidates) whose
    worst relative L1 over the calls is at most its gate (``layer_gates[i]`` where given, else
    ``rel_l1``); a layer no candidate passes stays dense. The forward itself is the dense
    model's (each layer passes dense attention on), under ``torch.no_grad()``; the processors are
    restored afterwards. ``on_call(done, total)`` reports progress. Returns a `SparsityPlan`.
    """
    attns = _self_attentions(transformer)
    candidates = sorted({check_sparsity(s) for s in
                         ([sparsity] if isinstance(sparsity, (int, float)) else sparsity)},
                        reverse=True)
    if not candidates:
        raise ValueError("sparsity: give at least one candidate")
    gates = {i: _check_gate(rel_l1, "rel_l1") for i in range(len(attns))}
    for i, g in (layer_gates or {}).items():
        if not isinstance(i, int) or not 0 <= i < len(attns):
            raise ValueError(f"layer_gates: {i!r} is not a block index (0..{len(attns) - 1})")
        gates[i] = _check_gate(g, f"layer_gates[{i}]")
    if any(_context_parallel(getattr(m, "_parallel_config", None)) is not None
           for m in [transformer] + [a.processor for a in attns]):
        raise ValueError(_CALIBRATE_CP)
    calls = _as_calls(inputs)
    was = getattr(transformer, _STATE_ATTR, None)
    saved = [a.processor for a in attns]
    if was is not None:
        was.hook.remove()
    calib = _Calibration(candidates, len(attns))
    state = _State(cube=check_cube(cube), dense_steps=frozenset(), originals=saved,
                   calibration=calib)
    hook = transformer.register_forward_pre_hook(
        lambda module, args, kwargs: state.observe(module, args, kwargs), with_kwargs=True)
    try:
        for i, attn in enumerate(attns):
            attn.set_processor(BlockSparseWanAttnProcessor(state, i, saved[i], sparsity=0.0))
        with torch.no_grad():
            for n, call in enumerate(calls):
                transformer(**call)
                if on_call is not None:
                    on_call(n + 1, len(calls))
    finally:
        hook.remove()
        for attn, proc in zip(attns, saved, strict=True):
            attn.set_processor(proc)
        if was is not None:
            was.hook = transformer.register_forward_pre_hook(
                lambda module, args, kwargs: was.observe(module, args, kwargs), with_kwargs=True)
    layers = []
    for i in range(len(attns)):
        worst = [max(r) for r in calib.rel_l1[i]]
        lowest = [min(c) for c in calib.cosine[i]]
        passing = [j for j in range(len(candidates)) if worst[j] <= gates[i]]
        j = passing[0] if passing else len(candidates) - 1
        layers.append(LayerPlan(index=i, sparsity=candidates[j] if passing else None,
                                topk=calib.topk[i][j] if passing else None,
                                rel_l1=worst[j], cosine=lowest[j]))
    return SparsityPlan(model=type(transformer).__name__, config=_model_config(transformer),
                        grid=state.grid, cube=state.cube, layers=tuple(layers),
                        rel_l1_gate=float(rel_l1),
                        calibration_calls=len(calls))


def _check_gate(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a relative L1 >= 0, got {value!r}")
    return float(value)


@contextlib.contextmanager
def record_inputs(transformer: torch.nn.Module, max_calls: int | None = None
                  ) -> Iterator[list[dict[str, Any]]]:
    """Record the keyword arguments of the transformer's calls (tensors copied, on their device;
    ``attention_kwargs`` too, e.g. a LoRA scale) while a pipeline runs, to calibrate on or save
    with ``torch.save``. ``max_calls`` counts transformer calls: with classifier-free guidance a
    pipeline makes two per denoising step. Wan2.2-A14B's pipeline has two experts,
    ``pipe.transformer`` (the high-noise steps) and ``pipe.transformer_2`` (the low-noise ones):
    record, calibrate and enable each on its own::

        with record_inputs(pipe.transformer, max_calls=8) as calls:
            pipe(prompt, num_inference_steps=8)
        plan = calibrate(pipe.transformer, calls)
    """
    _require_diffusers()
    calls: list[dict[str, Any]] = []
    names = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image",
             "return_dict", "attention_kwargs")

    def hook(module, args, kwargs):
        if max_calls is None or len(calls) < max_calls:
            call = dict(zip(names, args, strict=False))
            call.update({k: v for k, v in kwargs.items() if k in names})
            calls.append({k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                          for k, v in call.items() if k != "return_dict"})

    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()
