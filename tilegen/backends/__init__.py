"""The backend registry: every kernel family tilegen can render, compile and run.

To add a backend, write `tilegen/backends/<name>/` with a `Backend` subclass named `BACKEND`
and add one line to `BACKEND_MODULES`. Modules are imported on first use, so a backend whose
runtime needs an optional package costs nothing until it is asked for.
"""

from __future__ import annotations

import importlib

from tilegen.backends.base import Backend
from tilegen.targets import Target

#: name -> module holding `BACKEND`. Order is the order `build` and `check` walk them in.
BACKEND_MODULES: dict[str, str] = {
    "triton": "tilegen.backends.triton",
    "cuda": "tilegen.backends.cuda",
    "hip": "tilegen.backends.hip",
    "gluon": "tilegen.backends.gluon",
}

#: name -> module of kernel sets tuned on their own that are not families: the backward kernels
#: of a family (`Backend.backward`). `get` finds them; `names` and `for_target` do not list them
#: (no forward op, no build of their own).
TUNED_ONLY_MODULES: dict[str, str] = {
    "triton_bwd": "tilegen.backends.triton.gradient",
}

_loaded: dict[str, Backend] = {}


def names() -> tuple[str, ...]:
    return tuple(BACKEND_MODULES)


def get(name: str) -> Backend:
    """The backend called `name`; unknown names raise ValueError listing the known ones."""
    modules = {**BACKEND_MODULES, **TUNED_ONLY_MODULES}
    if name not in modules:
        # users name families; the tuned-only sets are reached through them (tune --backward)
        raise ValueError(f"backend={name!r} is not allowed; allowed values: {list(names())}")
    backend = _loaded.get(name)
    if backend is None:
        backend = _loaded[name] = importlib.import_module(modules[name]).BACKEND
    return backend


def with_quant(mode: str) -> list[str]:
    """The families whose kernels compute `Spec.quant` mode `mode` (`Backend.quant_modes`),
    by `Backend.quant_rank`."""
    having = [n for n in names() if mode in get(n).quant_modes]
    return sorted(having, key=lambda n: get(n).quant_rank)


def for_target(target: Target) -> list[Backend]:
    """The backends `target` lists (target.toml `backends`), in registry order."""
    return [get(n) for n in names() if n in target.backends]


__all__ = ["BACKEND_MODULES", "TUNED_ONLY_MODULES", "Backend", "for_target", "get", "names"]
