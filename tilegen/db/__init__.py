"""tilegen's tuning DB: workloads, environments, candidates (variant keys), studies, winners.

The file is ``TuningDB.open(path)``'s ``path``, else ``$TILEGEN_DB``, else
``$XDG_CACHE_HOME/tilegen/tuning.sqlite`` (``~/.cache/tilegen/tuning.sqlite``). Schema and
export format: ``tuning_db/README.md``. The modules:

- `tilegen.db.engine`: where the file is, checking it, opening it read-only or read-write;
- `tilegen.db.models`, `tilegen.db.migrations`: the tables and their versions;
- `tilegen.db.records`: ``TuningDB``, the tables' access;
- `tilegen.db.policy`: which winner to keep (pure, no SQLAlchemy);
- `tilegen.db.exchange`: export and import (JSON);
- `tilegen.db.cli`: ``tilegen db {list,show,export,import}``.

Names are imported lazily, so ``tilegen.db.policy`` and ``tilegen.db.errors`` work on a machine
without SQLAlchemy (`tilegen.winners` reads shipped JSON there).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DB_ENV_VAR": "engine",
    "DB_FILENAME": "engine",
    "default_db_path": "engine",
    "resolve_db_path": "engine",
    "ConflictError": "errors",
    "DBReadOnlyError": "errors",
    "ExportFormatError": "errors",
    "SchemaVersionError": "errors",
    "TuningDBError": "errors",
    "EXPORT_FORMAT": "policy",
    "FAKE_TIMERS": "policy",
    "REAL_TIMERS": "policy",
    "ENV_FIELDS": "models",
    "SCHEMA_VERSION": "models",
    "MIGRATIONS": "migrations",
    "ImportReport": "records",
    "SetWinnerResult": "records",
    "StudyInfo": "records",
    "TuningDB": "records",
    "WinnerInfo": "records",
    "WorkloadDetail": "records",
    "WorkloadInfo": "records",
    "canonical_json": "records",
    "env_key": "records",
    "normalize_env": "records",
    "variant_digest": "records",
    "merge_export_file": "records",
    "read_export": "exchange",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tilegen.db' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tilegen.db.{module}"), name)


__all__ = sorted(_EXPORTS)
