"""The Gluon backend: a warp-specialized kernel (TMA producer warp, consumer warpgroups on
Hopper's wgmma or Blackwell's tcgen05, mbarrier rings) written in Triton's Gluon dialect,
rendered from templates/gluon/lut_ws_kernel.py.j2. Its decisions are `KernelConfig.options` (see
`render.DEFAULTS`); a GPU pre-pass validates the LUT and packs partial cubes (`prepass`).
An 8-bit spec (``Spec(quant="int8_fp8")``) gets the 8-bit kernel of `quant`
(templates/gluon/lut_ws_quant.py.j2, its knobs `quant.DEFAULTS`), forward only."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tilegen import config as cfgmod
from tilegen.backends.base import Backend
from tilegen.config import KernelConfig
from tilegen.spec import Spec
from tilegen.targets import Target

if TYPE_CHECKING:
    from tilegen.compile import Artifact
    from tilegen.render import Source


#: the target.toml tables ([default.<t>], [tunable.<t>]) of the 8-bit kernel
QUANT_TABLE = "gluon_quant"


class GluonBackend(Backend):
    name = "gluon"
    #: the kernel walks the pre-pass's tile plan: a LUT row, or a window from coordinates
    encodings = ("lut", "sliding_tile")
    max_cube = 64  # `render.spec_problem`: 64-token cubes
    quant_modes = ("none", "int8_fp8")  # `quant.QUANT_KERNELS`
    quant_rank = 5  # measured and tuned (sessions 13-16); behind the CUDA one since session 20

    def spec_violations(self, spec: Spec, target: Target) -> list[str]:
        problems = super().spec_violations(spec, target)
        if not problems and spec.quant != "none":
            from tilegen.backends.gluon.quant import spec_problem as quant_problem

            why = quant_problem(spec, target)
            return [why] if why else []
        if not problems:
            from tilegen.backends.gluon.render import mma_kind, spec_problem

            if mma_kind(spec, target) is None:
                problems.append(f"the Gluon kernel needs wgmma (Hopper) or tcgen05 "
                                f"(Blackwell); target {target.name} lists neither")
            why = spec_problem(spec)
            if why:
                problems.append(why)
        return problems

    def config_violations(self, spec: Spec, target: Target, cfg: KernelConfig) -> list[str]:
        from tilegen.backends.gluon.render import check, resolve

        problems = []
        if (cfg.block_m, cfg.block_n, cfg.num_warps) != (64, 64, 4):
            problems.append("the Gluon kernel runs 64x64 tiles with one 4-warp consumer "
                            "warpgroup per query cube (block_m=64, block_n=64, num_warps=4)")
        if cfg.interp_bf16:
            problems.append("interp_bf16 is a Triton-interpreter option; Gluon has none")
        if spec.quant != "none":
            from tilegen.backends.gluon import quant

            if cfg.store_max_prob or cfg.separate_kv:
                problems.append("the 8-bit kernel has no max_prob output and no separate K/V")
            try:
                why = quant.check(spec, quant.options_of(cfg), target)
            except ValueError as exc:
                why = str(exc)
            return problems + ([why] if why else [])
        try:
            opts = resolve({**dict(cfg.options), "store_lse": cfg.store_lse})
        except ValueError as exc:
            return problems + [str(exc)]
        why = check(spec, opts, target)
        return problems + ([why] if why else [])

    def default_config(self, spec: Spec, target: Target) -> KernelConfig:
        if spec.quant != "none":  # the 8-bit kernel's own table: [default.gluon_quant]
            from tilegen.backends.gluon.quant import default_config

            if QUANT_TABLE in target.default_by_backend:
                return cfgmod.default_config(target, spec, backend=QUANT_TABLE)
            return default_config(spec)
        return super().default_config(spec, target)

    def tunable(self, target: Target, spec: Spec | None = None) -> dict[str, tuple[Any, ...]]:
        """The bf16 kernel's [tunable.gluon], or for an 8-bit spec [tunable.gluon_quant]."""
        if spec is not None and spec.quant != "none":
            return dict(target.tunable_by_backend.get(QUANT_TABLE, {}))
        return super().tunable(target, spec)

    def render(self, spec: Spec, cfg: KernelConfig, target: Target) -> Source:
        if spec.quant != "none":
            from tilegen.backends.gluon.quant import render_quant

            return render_quant(spec, cfg, target)
        from tilegen.backends.gluon.render import render_gluon

        return render_gluon(spec, cfg, target)

    def sources(self, spec: Spec, cfg: KernelConfig, target: Target) -> list[Source]:
        """The forward kernel, and on a wgmma target for a LUT spec the backward module (dK/dV
        and dQ, `backward.render_backward`); other targets train on the Triton backward
        (`backward.spec_problem` says why)."""
        from tilegen.backends.gluon.backward import render_backward, spec_problem

        out = [self.render(spec, cfg, target)]
        if spec.quant == "none" and spec_problem(spec, target) is None:
            out.append(render_backward(spec, target))
        return out

    def toolchain(self, target: Target | None = None) -> str:
        import triton

        return f"triton={triton.__version__}"

    def compile(self, spec: Spec, cfg: KernelConfig, target: Target, source: Source,
                out_dir: Path) -> Artifact | list[Artifact]:
        from tilegen.backends.gluon import quant
        from tilegen.backends.gluon.aot import (
            compile_gluon,
            compile_gluon_backward,
            compile_gluon_quant,
        )
        from tilegen.backends.gluon.backward import TEMPLATE

        if source.template == TEMPLATE:
            return compile_gluon_backward(spec, target, source, out_dir)
        if source.template == quant.TEMPLATE:
            return compile_gluon_quant(spec, cfg, target, source, out_dir)
        return compile_gluon(spec, cfg, target, source, out_dir)

    def make_op(self, spec: Spec, cfg: KernelConfig, target: Target | None,
                config_source: str = "explicit") -> Any:
        from tilegen.backends.gluon.op import GluonBlockSparseAttention, GluonSlidingTileAttention

        if spec.quant != "none":
            from tilegen.backends.gluon.quant import make_op

            return make_op(spec, cfg, target, config_source)
        if spec.encoding == "sliding_tile":
            return GluonSlidingTileAttention(spec, cfg, target, config_source)
        return GluonBlockSparseAttention(spec, cfg, target, config_source)


BACKEND = GluonBackend()
