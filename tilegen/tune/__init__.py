"""Autotuning: search space, objective (compile -> gate -> time in a worker), session.

- `tilegen.tune.space`: `SearchSpace` from ``targets/<target>/target.toml`` [tunable], typed
  launch and render fragments, seeds;
- `tilegen.tune.objective`: one trial in a persistent worker process, failure classes;
- `tilegen.tune.session`: the Optuna study (resumable RDB storage), winners into the DB;
- `tilegen.tune.cli`: ``tilegen tune`` and ``tilegen db``;
- `tilegen.tune.toolchain`: the toolchain key winners are recorded under (pure Python).

Names are imported lazily: ``import tilegen.tune`` pulls in neither Optuna nor torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SearchSpace": "space",
    "Dim": "space",
    "seed_configs": "space",
    "FAILURE_CLASSES": "objective",
    "TIMERS": "objective",
    "TrialResult": "objective",
    "WorkerHandle": "objective",
    "WorkerSetup": "objective",
    "classify": "objective",
    "fake_deterministic_ms": "objective",
    "TuneOptions": "session",
    "SessionResult": "session",
    "SessionError": "session",
    "run_session": "session",
    "TOOLCHAIN_FIELDS": "toolchain",
    "current_toolchain_key": "toolchain",
    "toolchain_key": "toolchain",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tilegen.tune' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tilegen.tune.{module}"), name)


__all__ = sorted(_EXPORTS)
