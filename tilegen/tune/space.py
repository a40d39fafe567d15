"""The search space of `tilegen tune`: which `KernelConfig` fields vary, over which values.

The space is built from ``targets/<target>/target.toml`` ``[tunable]`` (one source of truth for
ranges), optionally overridden per field (``tilegen tune --space num_stages=2,3,4``). It has
two typed fragments:

- the **launch** fragment: ``block_m``, ``block_n``, ``num_warps``, ``num_stages`` (one rendered
  source serves all of them);
- the **render** fragment: every other `KernelConfig` field named in ``[tunable]`` (render-time
  template options such as several query cubes per program or a persistent grid, as the
  performance work adds them). Each value must have the field's Python type (``bool`` for a
  flag, ``int`` for a count, ``str`` for a choice), so a typo in a TOML file fails here and not
  inside a worker.

Fields the caller decides (``store_lse``, ``store_max_prob``) or that only exist for the CPU
interpreter (``interp_bf16``) are never searched. Everything not searched comes from the target's
``[default]``.

Feasibility is *not* a property of the space: every point can be proposed, and the session
prunes infeasible ones with `tilegen.config.violations` before anything is compiled, recording
the reasons. `SearchSpace.violations` is that check.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tilegen.config import KernelConfig, reference_config
from tilegen.spec import Spec
from tilegen.targets import Target

#: Launch parameters: constexprs / launch arguments of one rendered source.
LAUNCH_FIELDS: tuple[str, ...] = ("block_m", "block_n", "num_warps", "num_stages")

#: KernelConfig fields that are never tuned, and why.
NOT_TUNABLE: dict[str, str] = {
    "store_lse": "the caller decides it (return_lse); tuning always runs with lse stored",
    "store_max_prob": "the caller decides it (return_max_prob); tuning runs without it",
    "separate_kv": "the call's shapes decide it (K/V of their own length or heads)",
    "interp_bf16": "an interpreter-only workaround, never built for a GPU",
}

Value = int | bool | str
Kind = Literal["launch", "render"]


class TrialLike(Protocol):
    """The part of `optuna.Trial` the space uses (kept duck-typed: no optuna import here)."""

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any: ...


def _field_types() -> dict[str, type]:
    """Python type of each KernelConfig field, from its default value (bool before int)."""
    return {f.name: type(f.default) for f in dataclasses.fields(KernelConfig)}


@dataclass(frozen=True)
class Dim:
    """One searched field (or family option): its name, typed choices, and fragment. ``types``
    maps every name the space may search to its Python type (KernelConfig fields, then the
    family's options, `tilegen.config.KernelConfig.options`)."""

    name: str
    choices: tuple[Value, ...]
    kind: Kind
    types: tuple[tuple[str, type], ...] = ()

    def __post_init__(self) -> None:
        types = dict(self.types) or _field_types()
        if self.name not in types:
            raise ValueError(f"tunable {self.name!r} is not a KernelConfig field or an option of "
                             f"this kernel family; known: {sorted(types)}")
        if self.name in NOT_TUNABLE:
            raise ValueError(f"KernelConfig.{self.name} is not tunable: {NOT_TUNABLE[self.name]}")
        if not self.choices:
            raise ValueError(f"tunable {self.name!r} has no values")
        want = types[self.name]
        for value in self.choices:
            # type() and not isinstance(): True is an int, and 1 must not pass for a flag
            if type(value) is not want:
                raise ValueError(f"tunable {self.name!r} value {value!r} must be a "
                                 f"{want.__name__} (the KernelConfig field's type)")
        if len(set(self.choices)) != len(self.choices):
            raise ValueError(f"tunable {self.name!r} lists a value twice: {list(self.choices)}")

    def suggest(self, trial: TrialLike) -> Value:
        return trial.suggest_categorical(self.name, list(self.choices))


def make_dim(name: str, values: Sequence[Any],
             types: Mapping[str, type] | None = None) -> Dim:
    """A `Dim` for KernelConfig field (or family option) `name`, in the launch or render
    fragment by its name."""
    return Dim(name, tuple(values), "launch" if name in LAUNCH_FIELDS else "render",
               tuple(sorted((types or {}).items(), key=lambda kv: kv[0])))


def parse_space_override(text: str) -> tuple[str, tuple[Value, ...]]:
    """Parse ``NAME=V1,V2,...`` (the ``--space`` flag) into typed values for that field."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name or not rest.strip():
        raise ValueError(f"--space wants NAME=V1,V2,..., got {text!r}")
    types = _field_types()
    if name in types:
        want = types[name]
    else:  # a family option (e.g. the Gluon family's k_stages): typed by its values here and
        # checked against the family's options when the space is built
        first = rest.split(",")[0].strip().lower()
        want = bool if first in ("true", "false") else int if first.lstrip("-").isdigit() else str
    values: list[Value] = []
    for raw in rest.split(","):
        raw = raw.strip()
        if want is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"--space {name}: {raw!r} is not a bool (true/false)")
            values.append(raw.lower() in ("true", "1"))
        elif want is int:
            try:
                values.append(int(raw))
            except ValueError:
                raise ValueError(f"--space {name}: {raw!r} is not an int") from None
        else:
            values.append(raw)
    return name, tuple(values)


@dataclass(frozen=True)
class SearchSpace:
    """The tunable space of one spec on one target.

    ``dims`` are the searched fields (launch fragment first, then render fragment, each in a
    stable order); ``base`` gives every other field (the target's default config).
    """

    spec: Spec
    target: Target
    dims: tuple[Dim, ...]
    base: KernelConfig
    backend: str = "triton"
    #: the family's optional knobs and their defaults (`Backend.optional_options`): searchable,
    #: and named in a point's config only where they are not at their default
    optional: tuple[tuple[str, Value], ...] = ()

    @classmethod
    def from_target(cls, spec: Spec, target: Target,
                    overrides: Mapping[str, Sequence[Value]] | None = None,
                    backend: str = "triton") -> SearchSpace:
        """The space of `backend` from ``target.tunable_for(backend)`` (``[tunable]`` or
        ``[tunable.<backend>]``), with ``overrides`` replacing or adding fields."""
        from tilegen import backends

        base = backends.get(backend).tuning_base(spec, target)
        optional = backends.get(backend).optional_options(spec, target)
        types = {**_field_types(), **{k: type(v) for k, v in optional.items()},
                 **{k: type(v) for k, v in base.options}}
        ranges: dict[str, Sequence[Value]] = dict(backends.get(backend).tunable(target, spec))
        ranges.update(overrides or {})
        launch = [make_dim(n, ranges[n], types) for n in LAUNCH_FIELDS if n in ranges]
        render = [make_dim(n, ranges[n], types) for n in sorted(ranges)
                  if n not in LAUNCH_FIELDS]
        return cls(spec, target, tuple(launch + render), base, backend,
                   tuple(sorted(optional.items())))

    def _is_field(self, name: str) -> bool:
        return name in _field_types()

    # -- shape -----------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    @property
    def size(self) -> int:
        """Number of points, feasible or not."""
        return math.prod(len(d.choices) for d in self.dims)

    def fragment(self, kind: Kind) -> tuple[Dim, ...]:
        return tuple(d for d in self.dims if d.kind == kind)

    def describe(self) -> str:
        parts = [f"{d.name}={list(d.choices)}" for d in self.dims]
        return f"{self.size} points over " + " ".join(parts)

    # -- points <-> configs --------------------------------------------------------------
    def config(self, params: Mapping[str, Value]) -> KernelConfig:
        """The config for one point (fields not searched come from ``base``)."""
        missing = [n for n in self.names if n not in params]
        if missing:
            raise ValueError(f"params lack searched field(s) {missing}")
        fields = {n: params[n] for n in self.names if self._is_field(n)}
        options = {n: params[n] for n in self.names if not self._is_field(n)}
        if options:
            optional = dict(self.optional)
            merged = {**dict(self.base.options), **options}
            fields["options"] = {k: v for k, v in merged.items()
                                 if k not in optional or v != optional[k]}
        return self.base.replace(**fields)

    def _value(self, cfg: KernelConfig, name: str) -> Value:
        if self._is_field(name):
            return getattr(cfg, name)
        return cfg.option(name, dict(self.optional).get(name))

    def params(self, cfg: KernelConfig) -> dict[str, Value]:
        """The point of `cfg` (its searched fields and options)."""
        return {n: self._value(cfg, n) for n in self.names}

    def contains(self, cfg: KernelConfig) -> bool:
        """True when `cfg` is a point of this space (searched fields in range, the rest equal
        to ``base``)."""
        if any(self._value(cfg, d.name) not in d.choices for d in self.dims):
            return False
        return self.config(self.params(cfg)) == cfg

    def configs(self) -> Iterator[KernelConfig]:
        """Every point, in a stable product order (first dim slowest)."""
        for values in itertools.product(*(d.choices for d in self.dims)):
            yield self.config(dict(zip(self.names, values, strict=True)))

    def suggest(self, trial: TrialLike) -> KernelConfig:
        """Ask `trial` (an Optuna trial) for one point."""
        return self.config({d.name: d.suggest(trial) for d in self.dims})

    # -- feasibility ---------------------------------------------------------------------
    def violations(self, cfg: KernelConfig) -> list[str]:
        """Why `cfg` cannot run on the target (empty when it can): the backend's rules
        (`Backend.violations`: `tilegen.config`'s pure predicates plus the family's own), each
        naming the hardware rule it mirrors."""
        from tilegen import backends

        return backends.get(self.backend).violations(self.spec, self.target, cfg)

    def feasible(self) -> list[KernelConfig]:
        return [c for c in self.configs() if not self.violations(c)]

    def enumeration(self, first: Sequence[KernelConfig] = ()) -> list[KernelConfig]:
        """Every point once: `first` (seeds), then feasible points, then infeasible ones (they
        are pruned without compiling, so they go last and cost nothing)."""
        seen: set[str] = set()
        out: list[KernelConfig] = []
        ordered = list(first) + self.feasible() + [c for c in self.configs() if self.violations(c)]
        for cfg in ordered:
            if cfg.name not in seen and self.contains(cfg):
                seen.add(cfg.name)
                out.append(cfg)
        return out


def seed_configs(space: SearchSpace, known: Sequence[tuple[str, KernelConfig]] = ()
                 ) -> list[tuple[str, KernelConfig]]:
    """The configs to try first, labelled: the target default, the reference variant, then
    `known` (e.g. a tuned winner, even a stale one). Configs outside the space are dropped (an
    Optuna parameter cannot take a value outside its choices); a repeated config keeps one
    entry whose label joins its roles."""
    from tilegen import backends

    candidates = [("target default",
                   backends.get(space.backend).default_config(space.spec, space.target)),
                  ("reference", reference_config(space.spec)), *known]
    labels: dict[str, list[str]] = {}
    configs: dict[str, KernelConfig] = {}
    for label, cfg in candidates:
        if not space.contains(cfg):
            continue
        labels.setdefault(cfg.name, []).append(label)
        configs.setdefault(cfg.name, cfg)
    # One entry per config; a config with several roles says so ("target default = reference").
    return [(" = ".join(labels[name]), cfg) for name, cfg in configs.items()]


__all__ = [
    "LAUNCH_FIELDS",
    "NOT_TUNABLE",
    "Dim",
    "SearchSpace",
    "make_dim",
    "parse_space_override",
    "seed_configs",
]
