"""The CK-style HIP C++ backend: a kernel's config rendered from templates/hip over the static
headers in templates/hip/include, compiled by clang-19 for the target's ISA with no ROCm
install, launched through hip-python (`runtime`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tilegen.backends.base import Backend
from tilegen.config import KernelConfig
from tilegen.spec import Spec
from tilegen.targets import Target

if TYPE_CHECKING:
    from tilegen.compile import Artifact
    from tilegen.render import Source

log = logging.getLogger("tilegen")

#: what the HIP kernel has run on, said once per process at load
WHAT_HAS_RUN = ("backend='hip': runs on a CPU executor of the HIP source with ISA-documented "
                "MFMA semantics; never run on an MI300")
_noted: set[str] = set()


class HipBackend(Backend):
    name = "hip"
    missing_encoding_reason = ("its kernel (templates/hip/include/tilegen/hip/"
                               "pipeline.hpp) walks a LUT row; "
                               "the sliding-tile cursor branch is not written for it yet")

    def config_violations(self, spec: Spec, target: Target, cfg: KernelConfig) -> list[str]:
        from tilegen.backends.hip.plan import hip_violations

        return hip_violations(spec, cfg, target)

    def render(self, spec: Spec, cfg: KernelConfig, target: Target) -> Source:
        from tilegen.backends.hip.plan import render_hip

        return render_hip(spec, cfg, target)

    def toolchain(self, target: Target | None = None) -> str:
        from tilegen.backends.hip.compile import toolchain_id

        return toolchain_id(target.arch if target else "")

    def require_toolchain(self, target: Target) -> None:
        from tilegen.backends.hip.compile import find_clang

        find_clang()

    def compile(self, spec: Spec, cfg: KernelConfig, target: Target, source: Source,
                out_dir: Path) -> Artifact:
        from tilegen.backends.hip.compile import compile_hip

        return compile_hip(source, out_dir, target,
                           self.variant_key(spec, cfg, target, source).digest)

    def make_op(self, spec: Spec, cfg: KernelConfig, target: Target | None,
                config_source: str = "explicit") -> Any:
        from tilegen.backends.hip.runtime import HipBlockSparseAttention
        from tilegen.paths import cache_dir

        if WHAT_HAS_RUN not in _noted:
            _noted.add(WHAT_HAS_RUN)
            log.info(WHAT_HAS_RUN)

        if target is None:
            raise ValueError("the HIP backend needs a target that lists it (pass target=... "
                             "or run on a ROCm device)")
        artifact = self.compile(spec, cfg, target, self.render(spec, cfg, target),
                                cache_dir() / "hip-build")
        return HipBlockSparseAttention(spec, cfg, artifact, target, config_source)


BACKEND = HipBackend()
