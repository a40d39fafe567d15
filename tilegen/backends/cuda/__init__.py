"""The CK-style CUDA C++ backend: a kernel's traits rendered from templates/cuda over the static
headers in templates/cuda/include, compiled by nvcc for the target's ISA, launched through the
CUDA driver API (`runtime`). Two mainloops (the config's ``mainloop`` option): the mma.sync
kernel every NVIDIA target builds (`nvcc`), and on Hopper the wgmma kernel (`wgmma`: TMA
producer, consumer warpgroups, ping-pong), which a build of a wgmma target renders and compiles
beside the default."""

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


class CudaBackend(Backend):
    name = "cuda"
    #: int8_fp8 on the wgmma mainloop only (Hopper); other targets refuse it with the reason
    quant_modes = ("none", "int8_fp8")
    #: ahead of the Gluon family's: its 8-bit op measured faster than the Gluon one's (H100,
    #: 6.24 against 6.50 ms, bench/RESULTS.md, session 20)
    quant_rank = 0
    missing_encoding_reason = ("its kernel (templates/cuda/include/tilegen/cuda/"
                               "lut_attention.cuh) walks a LUT row; "
                               "the sliding-tile cursor branch is not written for it yet")

    def config_violations(self, spec: Spec, target: Target, cfg: KernelConfig) -> list[str]:
        from tilegen.backends.cuda.nvcc import cuda_violations

        return cuda_violations(spec, cfg, target)

    def render(self, spec: Spec, cfg: KernelConfig, target: Target) -> Source:
        from tilegen.backends.cuda.nvcc import render_cuda

        return render_cuda(spec, cfg, target)

    def toolchain(self, target: Target | None = None) -> str:
        from tilegen.backends.cuda.nvcc import toolchain_id

        return toolchain_id()

    def require_toolchain(self, target: Target) -> None:
        from tilegen.backends.cuda.nvcc import find_nvcc

        find_nvcc()

    def sources(self, spec: Spec, cfg: KernelConfig, target: Target) -> list[Source]:
        """The config's kernel and, for an mma.sync config on a target the wgmma kernel runs
        on, the wgmma kernel with its default knobs too (`wgmma.DEFAULTS`), so builds, CI and
        `tilegen check` compile and keep both."""
        out = [self.render(spec, cfg, target)]
        companion = self._wgmma_companion(spec, cfg, target)
        if companion is not None:
            out.append(self.render(spec, companion, target))
        return out

    def default_config(self, spec: Spec, target: Target) -> KernelConfig:
        """The target's default config; for an 8-bit spec the wgmma kernel's (the only CUDA
        kernel that computes one), where the target runs it."""
        cfg = super().default_config(spec, target)
        if spec.quant != "none":
            companion = self._wgmma_companion(spec, cfg, target)
            if companion is not None:
                return companion
        return cfg

    def tuning_base(self, spec: Spec, target: Target) -> KernelConfig:
        """A target whose [tunable.cuda] searches the wgmma mainloop tunes from its default
        knobs (`wgmma.DEFAULTS`); otherwise the default (mma.sync) config."""
        if "wgmma" in target.tunable_for(self.name).get("mainloop", ()):
            companion = self._wgmma_companion(spec, self.default_config(spec, target), target)
            if companion is not None:
                return companion
        return self.default_config(spec, target)

    def optional_options(self, spec: Spec, target: Target) -> dict[str, Any]:
        """The wgmma kernel's optional knobs (`wgmma.OPTIONAL`: kv_copies, q_in_kernel,
        row_sum, p_exp) where it is what the target tunes."""
        from tilegen.backends.cuda import wgmma

        if wgmma.mainloop_of(self.tuning_base(spec, target)) == "wgmma":
            return dict(wgmma.OPTIONAL)
        return {}

    @staticmethod
    def _wgmma_companion(spec: Spec, cfg: KernelConfig, target: Target) -> KernelConfig | None:
        from tilegen.backends.cuda import wgmma

        if wgmma.mainloop_of(cfg) == "wgmma":
            return None
        companion = wgmma.config(**wgmma.defaults_for(spec)).replace(
            store_lse=cfg.store_lse, store_max_prob=cfg.store_max_prob)
        return None if wgmma.violations(spec.kernel_spec, companion, target) else companion

    def compile(self, spec: Spec, cfg: KernelConfig, target: Target, source: Source,
                out_dir: Path) -> Artifact:
        from tilegen.backends.cuda import wgmma
        from tilegen.backends.cuda.nvcc import compile_cuda

        if source.template == wgmma.TEMPLATE and wgmma.mainloop_of(cfg) != "wgmma":
            cfg = self._wgmma_companion(spec, cfg, target) or cfg  # `sources`' second kernel
        return compile_cuda(source, target, out_dir,
                            self.variant_key(spec, cfg, target, source).digest)

    def make_op(self, spec: Spec, cfg: KernelConfig | None, target: Target | None,
                config_source: str = "explicit") -> Any:
        from tilegen.backends.cuda import wgmma

        if cfg is not None and wgmma.mainloop_of(cfg) == "wgmma":
            from tilegen.backends.cuda.wgmma_op import make_wgmma_op

            return make_wgmma_op(spec, cfg, target, config_source)
        from tilegen.backends.cuda.runtime import CudaBlockSparseAttention

        return CudaBlockSparseAttention(spec, cfg, config_source)


BACKEND = CudaBackend()
