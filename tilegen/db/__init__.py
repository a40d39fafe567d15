"""tilegen's tuning DB: workloads, environments, candidates, trials and winners (SQLite, WAL).

The file is ``TuningDB.open(path)``'s ``path``, else ``$TILEGEN_DB``, else
``$XDG_CACHE_HOME/tilegen/tuning.sqlite`` (``~/.cache/tilegen/tuning.sqlite``). Schema and
export format: ``tuning_db/README.md``.

Importing this package needs SQLAlchemy. ``toolchain_key`` and ``TOOLCHAIN_FIELDS`` are
re-exported from ``tilegen.tune.toolchain``, their one definition, which does not need it.
"""

from tilegen.db.migrations import MIGRATIONS, SchemaVersionError
from tilegen.db.models import SCHEMA_VERSION
from tilegen.db.store import (
    DB_ENV_VAR,
    ENV_FIELDS,
    EXPORT_FORMAT,
    TOOLCHAIN_FIELDS,
    TRIAL_STATUSES,
    ConflictError,
    ImportReport,
    SetWinnerResult,
    TrialInfo,
    TuningDB,
    WinnerInfo,
    WinnerLookup,
    WorkloadDetail,
    WorkloadInfo,
    canonical_json,
    default_db_path,
    env_key,
    merge_export_file,
    normalize_env,
    resolve_db_path,
    toolchain_key,
)

__all__ = [
    "DB_ENV_VAR",
    "ENV_FIELDS",
    "EXPORT_FORMAT",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "TOOLCHAIN_FIELDS",
    "TRIAL_STATUSES",
    "ConflictError",
    "ImportReport",
    "SchemaVersionError",
    "SetWinnerResult",
    "TrialInfo",
    "TuningDB",
    "WinnerInfo",
    "WinnerLookup",
    "WorkloadDetail",
    "WorkloadInfo",
    "canonical_json",
    "default_db_path",
    "env_key",
    "merge_export_file",
    "normalize_env",
    "resolve_db_path",
    "toolchain_key",
]
