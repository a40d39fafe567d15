"""Autotuning: search space, objective (compile -> gate -> time in a worker), session.

- `tilegen.tune.space`: `SearchSpace` from ``targets/<target>/target.toml`` [tunable], typed
  launch and render fragments, seeds;
- `tilegen.tune.objective`: one trial in a persistent worker process, failure classes;
- `tilegen.tune.session`: the study loop (samplers, seeds, the objective, the budget: Optuna's
  own machinery; the trial log is Optuna's storage), winners into the tilegen DB;
- `tilegen.tune.storage`: where a study lives (storage URLs, names, heartbeats, retries);
- `tilegen.tune.pool`: the worker processes, one per GPU;
- `tilegen.tune.ledger`: the study's configs: the budget, dedupe and claims, exploration;
- `tilegen.tune.report`: progress lines, the final table, the history plot;
- `tilegen.tune.cli`: ``tilegen tune`` (``tilegen db`` is `tilegen.db.cli`).

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
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tilegen.tune' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tilegen.tune.{module}"), name)


__all__ = sorted(_EXPORTS)
