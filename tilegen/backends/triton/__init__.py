"""The Triton backend: the generated Triton kernel, JIT-compiled in process (CUDA, ROCm, the CPU
interpreter) or compiled ahead of time with no GPU (`aot`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tilegen.backends.base import Backend
from tilegen.config import KernelConfig
from tilegen.spec import Spec
from tilegen.targets import Target

if TYPE_CHECKING:
    from tilegen.compile import Artifact
    from tilegen.render import Source


class TritonBackend(Backend):
    name = "triton"
    runs_on_cpu = True
    backward = "triton_bwd"
    encodings = ("lut", "sliding_tile")
    #: 256- and 384-token cubes (FastVideo's VSA-256 and STA's (6, 8, 8) tiles): the kernels
    #: walk a cube in BLOCK_M / BLOCK_N steps; checked under the interpreter
    max_cube = 384

    def config_violations(self, spec: Spec, target: Target, cfg: KernelConfig) -> list[str]:
        return []  # the generic predicates (tilegen.config) are the Triton kernel's rules

    def render(self, spec: Spec, cfg: KernelConfig, target: Target | None) -> Source:
        from tilegen.backends.triton.render import render_triton

        return render_triton(spec, cfg, target)

    def sources(self, spec: Spec, cfg: KernelConfig, target: Target) -> list[Source]:
        """The forward kernel and the backward module (preprocess, dQ, dK/dV)."""
        from tilegen.backends.triton.backward import BackwardConfig, render_triton_backward

        return [self.render(spec, cfg, target),
                render_triton_backward(spec, cfg, target, BackwardConfig.default_for(target))]

    def toolchain(self, target: Target | None = None) -> str:
        import triton

        return f"triton={triton.__version__}"

    def compile(self, spec: Spec, cfg: KernelConfig, target: Target, source: Source,
                out_dir: Path) -> Artifact | list[Artifact]:
        from tilegen.backends.triton.aot import compile_triton, compile_triton_backward
        from tilegen.backends.triton.backward import is_backward

        if is_backward(source):
            return compile_triton_backward(spec, cfg, target, out_dir, source)
        return compile_triton(spec, cfg, target, out_dir, source)

    def make_op(self, spec: Spec, cfg: KernelConfig, target: Target | None,
                config_source: str = "explicit") -> Any:
        from tilegen.backends.triton.op import BlockSparseAttention, SlidingTileAttention

        cls = SlidingTileAttention if spec.encoding == "sliding_tile" else BlockSparseAttention
        return cls(spec, cfg, target, config_source)


BACKEND = TritonBackend()
