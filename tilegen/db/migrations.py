"""Schema version check and the migration path of the tuning DB.

How to change the schema (the next person's recipe):

1. edit ``models.py`` and bump ``SCHEMA_VERSION`` to ``N``;
2. append ``(N, fn)`` to ``MIGRATIONS`` below, where ``fn(conn)`` turns a version ``N - 1`` file
   into a version ``N`` file with plain DDL, e.g.
   ``conn.exec_driver_sql("ALTER TABLE trials ADD COLUMN peak_mem_mb REAL")``;
3. add a test that opens a version ``N - 1`` file.

A fresh file never replays migrations: it is created from the current models and stamped with
``SCHEMA_VERSION``. Migrations only run on files that already hold an older version; they run
in order, in the caller's single transaction (SQLite DDL is transactional), so a failed step
leaves the file at its old version.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sqlalchemy import Connection, inspect, select

from tilegen.db.models import SCHEMA_VERSION, Base, SchemaVersion, utcnow

#: A migration step: brings a file from version ``target - 1`` to ``target`` on ``conn``.
Migration = Callable[[Connection], None]

#: Ordered ``(target_version, step)`` pairs. Empty while the schema is at version 1.
MIGRATIONS: list[tuple[int, Migration]] = []


class SchemaVersionError(RuntimeError):
    """The DB file's schema version cannot be used by this code (too new, or no path up)."""


def read_version(conn: Connection) -> int | None:
    """The version stored in ``schema_version``, or None for a file without one (fresh)."""
    if not inspect(conn).has_table(SchemaVersion.__tablename__):
        return None
    return conn.execute(select(SchemaVersion.version).where(SchemaVersion.id == 1)).scalar()


def _write_version(conn: Connection, version: int) -> None:
    table = SchemaVersion.__table__
    updated = conn.execute(
        table.update().where(table.c.id == 1).values(version=version, updated_at=utcnow())
    )
    if updated.rowcount == 0:
        conn.execute(table.insert().values(id=1, version=version, updated_at=utcnow()))


def _db_name(conn: Connection) -> str:
    return conn.engine.url.database or "<memory>"


def upgrade(
    conn: Connection,
    *,
    target: int = SCHEMA_VERSION,
    migrations: Sequence[tuple[int, Migration]] = MIGRATIONS,
) -> list[int]:
    """Bring the file behind ``conn`` to schema version ``target``; return the steps applied.

    ``conn`` must be inside a write transaction (the caller commits). Raises
    ``SchemaVersionError`` when the file is newer than ``target`` or a step is missing.
    """
    versions = [v for v, _ in migrations]
    if versions != sorted(set(versions)):
        raise ValueError(f"migrations must be in strictly increasing version order: {versions}")
    stored = read_version(conn)
    if stored is None:
        # Fresh file: build the current schema directly (no replay of old steps).
        Base.metadata.create_all(conn)
        _write_version(conn, SCHEMA_VERSION)
        stored = SCHEMA_VERSION
    if stored > target:
        raise SchemaVersionError(
            f"tuning DB {_db_name(conn)} has schema version {stored}, newer than version "
            f"{target} that this tilegen understands; upgrade tilegen, or point TILEGEN_DB "
            "at another file"
        )
    steps = [(v, fn) for v, fn in migrations if stored < v <= target]
    if [v for v, _ in steps] != list(range(stored + 1, target + 1)):
        raise SchemaVersionError(
            f"tuning DB {_db_name(conn)} has schema version {stored} and no migration path "
            f"to version {target} (known steps: {versions})"
        )
    for version, step in steps:
        step(conn)
        _write_version(conn, version)
    return [v for v, _ in steps]


__all__ = ["MIGRATIONS", "Migration", "SchemaVersionError", "read_version", "upgrade"]
