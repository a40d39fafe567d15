"""``triton_bwd``: the Triton family's backward kernels as a kernel of their own for tuning.

The backward's launch parameters and template options (`BackwardConfig`) are tuned by the same
`tilegen tune` (``--backward``), in a study of their own with the forward fixed: the Triton
family's op as `tilegen.load` resolves it. Its configs are `KernelConfig`\\ s whose options are
the `BackwardConfig` fields (`BackwardConfig.to_kernel_config`), so the search space
(``[tunable.triton_bwd]`` in target.toml), the Optuna session, the variant key (the rendered
backward module's sha256), the tuning DB and the shipped winners file take them unchanged. The
correctness gate scores dQ/dK/dV (`tilegen.tune.objective`, ``Backend.gradients``), and the
Triton op's backward takes the winner through the same lookup as the forward
(`tilegen.winners.lookup_config` with ``backend="triton_bwd"``).

It is not a family of its own: no target lists it in ``backends`` (``tilegen build`` compiles the
backward with the Triton family, `TritonBackend.sources`), and `tilegen.load` never picks it
for a forward call.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tilegen.backends.base import Backend
from tilegen.backends.triton.backward import BackwardConfig
from tilegen.config import KernelConfig
from tilegen.spec import Spec
from tilegen.targets import Target

if TYPE_CHECKING:
    from tilegen.compile import Artifact
    from tilegen.identity import VariantKey
    from tilegen.render import Source


class TritonBackwardBackend(Backend):
    name = "triton_bwd"
    runs_on_cpu = True
    gradients = True
    templates = "triton"
    #: the family whose backward kernels these are
    forward_family = "triton"

    def spec_violations(self, spec: Spec, target: Target) -> list[str]:
        if self.forward_family not in target.backends:
            return [f"target {target.name} has no {self.forward_family} backend, whose backward "
                    f"kernels {self.name} tunes (its backends: {list(target.backends)})"]
        if spec.quant != "none":
            return [f"quant={spec.quant!r}: the backward kernels are bf16/fp16 (the 8-bit "
                    "variants are inference kernels)"]
        return []

    def violations(self, spec: Spec, target: Target, cfg: KernelConfig) -> list[str]:
        """The spec's and the BackwardConfig's rules (the forward's launch fields are unused)."""
        problems = self.spec_violations(spec, target)
        if problems:
            return problems
        try:
            bwd = BackwardConfig.from_kernel_config(cfg)
        except (TypeError, ValueError) as exc:
            return [str(exc)]
        return bwd.violations(spec)

    def tunable(self, target: Target, spec: Spec | None = None) -> dict[str, tuple[Any, ...]]:
        """``[tunable.triton_bwd]`` of the target (never the forward's common table)."""
        own = target.tunable_by_backend.get(self.name)
        if own is None:
            raise ValueError(f"target {target.name} has no [tunable.{self.name}] table in its "
                             "target.toml: nothing to tune for the backward")
        return dict(own)

    def default_config(self, spec: Spec, target: Target) -> KernelConfig:
        return BackwardConfig.default_for(target, spec).fit(spec).to_kernel_config()

    def render(self, spec: Spec, cfg: KernelConfig, target: Target | None) -> Source:
        from tilegen.backends.triton.backward import render_triton_backward

        return render_triton_backward(spec, cfg, target, BackwardConfig.from_kernel_config(cfg))

    def variant_key(self, spec: Spec, cfg: KernelConfig, target: Target,
                    source: Source | None = None) -> VariantKey:
        """As every family's (`Backend.variant_key`), and a config with ``gluon`` also names
        the Gluon backward's source: its sha256 is that of both sources' hashes, so an edit
        of either template makes such a winner stale."""
        key = super().variant_key(spec, cfg, target, source)
        if not BackwardConfig.from_kernel_config(cfg).gluon:
            return key
        import hashlib
        from dataclasses import replace

        from tilegen.backends.gluon.backward import render_backward, spec_problem

        if spec_problem(spec.kernel_spec, target) is not None:
            return key  # the config cannot run here (its violations say so): no Gluon source
        both = key.source_sha256 + render_backward(spec.kernel_spec, target).sha256
        return replace(key, source_sha256=hashlib.sha256(both.encode()).hexdigest())

    def toolchain(self, target: Target | None = None) -> str:
        import triton

        return f"triton={triton.__version__}"

    def compile(self, spec: Spec, cfg: KernelConfig, target: Target, source: Source,
                out_dir: Path) -> Artifact | list[Artifact]:
        from tilegen.backends.triton.aot import compile_triton_backward

        return compile_triton_backward(spec, cfg, target, out_dir, source,
                                       BackwardConfig.from_kernel_config(cfg))

    def make_op(self, spec: Spec, cfg: KernelConfig, target: Target | None,
                config_source: str = "explicit") -> Any:
        """The forward family's op as `tilegen.load` resolves it (its winner, else its
        default), its backward set to `cfg`."""
        from tilegen.ops import load

        op = load(spec, target=target, backend=self.forward_family)
        op.backward_config = BackwardConfig.from_kernel_config(cfg).fit(spec)
        return op


BACKEND = TritonBackwardBackend()
