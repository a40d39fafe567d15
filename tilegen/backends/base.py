"""The backend protocol: what every kernel family (triton, cuda, hip, ...) provides.

`build`, `check`, `load`, `tune` and `bench` only talk to backends through this class, so a new
kernel family is one folder under `tilegen/backends/` plus one line in the registry
(`tilegen.backends.BACKEND_MODULES`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tilegen import config as cfgmod
from tilegen.config import KernelConfig
from tilegen.identity import VariantKey
from tilegen.spec import Spec
from tilegen.targets import Target

if TYPE_CHECKING:
    from tilegen.compile import Artifact
    from tilegen.render import Source


class Backend(ABC):
    """One kernel family. Subclasses set `name` and implement the abstract methods."""

    #: registry name, also the `templates/<name>/` folder and the target toml's backends entry
    name: ClassVar[str]
    #: whether the op runs on this machine without the backend's GPU (interpreter / CPU path)
    runs_on_cpu: ClassVar[bool] = False
    #: True for a backward kernel set tuned on its own (`tilegen tune --backward`): the tuner's
    #: gate scores dQ/dK/dV and times the backward (`tilegen.tune.objective`)
    gradients: ClassVar[bool] = False
    #: the `templates/<folder>/` its sources come from (default: its name)
    templates: ClassVar[str] = ""
    #: the registry name of the backward kernel set of this family, if it has one
    backward: ClassVar[str | None] = None
    #: the kernel encodings its templates implement (`Spec.kernel_spec`: a "mask" spec reaches
    #: every family as the LUT kernel, behind the op layer's on-device conversion)
    encodings: ClassVar[tuple[str, ...]] = ("lut",)
    #: why a kernel encoding it lacks is missing (said by `spec_violations`)
    missing_encoding_reason: ClassVar[str] = ""
    #: the `Spec.quant` modes its kernels compute (`tilegen.quant`'s recipes)
    quant_modes: ClassVar[tuple[str, ...]] = ("none",)
    #: rank among the families computing an 8-bit mode, for a `load` that names none (lower
    #: first: the family whose 8-bit kernel was measured and tuned comes first)
    quant_rank: ClassVar[int] = 100
    #: the largest cube (tokens per query / KV block) its kernels are checked at
    max_cube: ClassVar[int] = 128

    # -- what it accepts ---------------------------------------------------------------------
    def spec_violations(self, spec: Spec, target: Target) -> list[str]:
        """Reasons this backend cannot compute `spec` on `target` at all (any config)."""
        if self.name not in target.backends:
            return [f"target {target.name} has no {self.name} backend "
                    f"(its backends: {list(target.backends)})"]
        encoding = spec.kernel_spec.encoding
        if encoding not in self.encodings:
            from tilegen import backends

            having = [n for n in backends.names() if encoding in backends.get(n).encodings]
            why = f": {self.missing_encoding_reason}" if self.missing_encoding_reason else ""
            return [f"the {self.name} family implements encodings {list(self.encodings)}, not "
                    f"{encoding!r}{why} (families with it: {having})"]
        if spec.quant not in self.quant_modes:
            from tilegen import backends

            having = backends.with_quant(spec.quant)
            return [f"the {self.name} family has no quant={spec.quant!r} kernel (families with "
                    f"it: {having or 'none yet: the 8-bit kernels are issue #19'}; "
                    "tilegen.quant.emulate computes the recipe in PyTorch)"]
        if max(spec.block_q, spec.block_kv) > self.max_cube:
            from tilegen import backends

            having = [n for n in backends.names()
                      if backends.get(n).max_cube >= max(spec.block_q, spec.block_kv)]
            return [f"the {self.name} family takes cubes of up to {self.max_cube} tokens, not "
                    f"{max(spec.block_q, spec.block_kv)} (cube {spec.cube}; families that take "
                    f"it: {having})"]
        return []

    def config_violations(self, spec: Spec, target: Target, cfg: KernelConfig) -> list[str]:
        """The backend's own tiling rules, on top of the target's (`tilegen.config`)."""
        return []

    def violations(self, spec: Spec, target: Target, cfg: KernelConfig) -> list[str]:
        """Every rule (spec, target and config) the variant breaks; empty when valid. A spec is
        judged by its kernel (`Spec.kernel_spec`: a mask spec is the LUT kernel)."""
        spec = spec.kernel_spec
        problems = self.spec_violations(spec, target)
        if problems:
            return problems
        return cfgmod.violations(spec, target, cfg) + self.config_violations(spec, target, cfg)

    def check(self, spec: Spec, target: Target, cfg: KernelConfig) -> None:
        problems = self.violations(spec, target, cfg)
        if problems:
            raise ValueError(f"config {cfg.name} is invalid for the {self.name} backend on "
                             f"{target.name}: " + "; ".join(problems))

    def default_config(self, spec: Spec, target: Target) -> KernelConfig:
        """The target's default config for this backend, fitted to the spec."""
        return cfgmod.default_config(target, spec, backend=self.name)

    def tuning_base(self, spec: Spec, target: Target) -> KernelConfig:
        """The config a search over `tunable` varies (the fields and options it does not
        search come from here): the default config, unless the family tunes another kernel."""
        return self.default_config(spec, target)

    def optional_options(self, spec: Spec, target: Target) -> dict[str, Any]:
        """The family's knobs that its configs name only where they differ from these
        defaults (so that adding one renamed no config of before), which a search space may
        still search: none by default."""
        return {}

    def tunable(self, target: Target, spec: Spec | None = None) -> dict[str, tuple[Any, ...]]:
        """The search space of this backend on `target` (targets/<t>/target.toml) for `spec`
        (a family whose kernels differ by spec, e.g. the 8-bit one, picks its table by it)."""
        return target.tunable_for(self.name)

    # -- source, toolchain, identity ---------------------------------------------------------
    @abstractmethod
    def render(self, spec: Spec, cfg: KernelConfig, target: Target) -> Source:
        """The kernel source for (spec, config) on `target`; deterministic."""

    def sources(self, spec: Spec, cfg: KernelConfig, target: Target) -> list[Source]:
        """Every source a build of (spec, config) on `target` renders and compiles, and `tilegen
        check` keeps committed: the forward kernel, plus whatever else the family generates
        (the Triton family adds its backward kernels)."""
        return [self.render(spec, cfg, target)]

    @abstractmethod
    def toolchain(self, target: Target) -> str:
        """Which compiler turns the source into machine code, e.g. ``"triton=3.6.0"``."""

    def require_toolchain(self, target: Target) -> None:  # noqa: B027 - optional hook
        """Raise `tilegen.compile.ToolchainMissing` (with the install hint) if absent."""
        return None

    def variant_key(self, spec: Spec, cfg: KernelConfig, target: Target,
                    source: Source | None = None) -> VariantKey:
        """The one name of this compiled variant (`tilegen.identity`), by the spec's kernel
        (`Spec.kernel_spec`: a mask spec names the LUT kernel it runs)."""
        spec = spec.kernel_spec
        src = source or self.render(spec, cfg, target)
        return VariantKey(kernel_hash=spec.kernel_hash, backend=self.name, config=cfg.name,
                          source_sha256=src.sha256, toolchain=self.toolchain(target),
                          target=target.name)

    # -- compile and run ---------------------------------------------------------------------
    @abstractmethod
    def compile(self, spec: Spec, cfg: KernelConfig, target: Target, source: Source,
                out_dir: Path) -> Artifact | list[Artifact]:
        """Compile `source` (one of `sources()`) ahead of time (no GPU) into `out_dir`; return
        its artifact with resources, or one per kernel when the source holds several."""

    @abstractmethod
    def make_op(self, spec: Spec, cfg: KernelConfig, target: Target | None,
                config_source: str = "explicit") -> Any:
        """The callable op (``o, lse = op(q, k, v, topk_idx, vbs, ...)``) for this variant."""
