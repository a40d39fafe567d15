"""Errors of the tuning DB, importable without SQLAlchemy (`tilegen.winners` catches them).

Every message is one line that names the file, so a command can print it as is.
"""

from __future__ import annotations

import os
from pathlib import Path


class TuningDBError(RuntimeError):
    """The DB file cannot be used: not a SQLite file, truncated, unreadable, damaged.

    ``str(exc)`` is one line naming the path and the cause. Commands exit with status 2.
    """

    def __init__(self, path: str | os.PathLike[str], cause: str) -> None:
        self.path = Path(path)
        self.cause = cause
        super().__init__(f"tuning DB {self.path}: {cause}")


class DBReadOnlyError(TuningDBError):
    """A command that writes was pointed at a DB it cannot write (read-only mount, no
    permission). Read-only commands and winner lookups still work on such a DB."""


class SchemaVersionError(TuningDBError):
    """The DB file's schema version cannot be used by this code (too new, or no path up)."""


class ConflictError(ValueError):
    """The same natural key arrived with different content (e.g. one spec hash, two specs)."""


class ExportFormatError(ValueError):
    """An export file (``tilegen db export`` JSON) that cannot be imported.

    The message names the file, the record (``winners[3]``, with its config name where known)
    and the field, e.g. ``x.json: winners[0] (bm64_bn64_w4_s5_lse): median_ms: not a number:
    'fast'``; JSON syntax errors name the file, line and column.
    """


__all__ = [
    "ConflictError",
    "DBReadOnlyError",
    "ExportFormatError",
    "SchemaVersionError",
    "TuningDBError",
]
