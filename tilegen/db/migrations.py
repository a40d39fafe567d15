"""Schema version check and the migration path of the tuning DB.

How to change the schema (the next person's recipe):

1. edit ``models.py`` and bump ``SCHEMA_VERSION`` to ``N``;
2. append ``(N, fn)`` to ``MIGRATIONS`` below, where ``fn(conn)`` turns a version ``N - 1`` file
   into a version ``N`` file, e.g.
   ``conn.exec_driver_sql("ALTER TABLE winners ADD COLUMN peak_mem_mb REAL")``;
3. add a test that opens a version ``N - 1`` file.

A fresh file never replays migrations: it is created from the current models and stamped with
``SCHEMA_VERSION``. Migrations only run on files that already hold an older version; they run
in order, in the caller's single transaction (SQLite DDL is transactional), so a failed step
leaves the file at its old version.

Version 2 (variant keys, winners per kernel + workload, timers, no trials table) is reached
from version 1 by `v1_to_v2`: the rows are read as a version 1 export, converted with
`tilegen.db.exchange.upgrade_doc` (the same conversion ``db import`` applies to a version 1
export file) and written back. Trials are not carried over: every one of them is also in the
Optuna study of its session, which is now their one record.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, inspect, select

from tilegen.db.errors import SchemaVersionError
from tilegen.db.models import SCHEMA_VERSION, Base, SchemaVersion, utcnow

#: A migration step: brings a file from version ``target - 1`` to ``target`` on ``conn``.
Migration = Callable[[Connection], None]


def _rows(conn: Connection, sql: str) -> list[dict[str, Any]]:
    return [dict(r._mapping) for r in conn.exec_driver_sql(sql)]


def _stamp(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).replace(" ", "T") + ("" if str(value).endswith("Z") else "Z")


def v1_to_v2(conn: Connection) -> None:
    """Version 1 (spec-hash keyed winners, template-set staleness, trials table) -> 2."""
    from tilegen.db.exchange import load_doc, upgrade_doc

    workloads = {r["id"]: r for r in _rows(conn, "SELECT * FROM workloads")}
    envs = _rows(conn, "SELECT * FROM environments")
    cands = {r["id"]: r for r in _rows(conn, "SELECT * FROM candidates")}
    trials = _rows(conn, "SELECT t.environment_id, t.candidate_id FROM trials t")
    env_by_id = {e["id"]: e for e in envs}
    doc: dict[str, Any] = {
        "format": "tilegen-tuning-db", "schema_version": 1,
        "workloads": [{"spec_hash": w["spec_hash"], "spec": json.loads(w["spec_json"]),
                       "created_at": _stamp(w["created_at"])} for w in workloads.values()],
        "environments": [{k: v for k, v in e.items() if k != "id"} for e in envs],
        "candidates": [{"spec_hash": workloads[c["workload_id"]]["spec_hash"],
                        "config_name": c["config_name"], "source_sha256": c["source_sha256"],
                        "config": json.loads(c["config_json"])} for c in cands.values()],
        "winners": [],
        # where each candidate ran (a toolchain and target for candidates without a winner)
        "trials": [{"spec_hash": workloads[cands[t["candidate_id"]]["workload_id"]]["spec_hash"],
                    "config_name": cands[t["candidate_id"]]["config_name"],
                    "source_sha256": cands[t["candidate_id"]]["source_sha256"],
                    "env_key": env_by_id[t["environment_id"]]["env_key"]}
                   for t in trials if t["candidate_id"] in cands
                   and t["environment_id"] in env_by_id],
    }
    for w in _rows(conn, "SELECT * FROM winners"):
        c = cands[w["candidate_id"]]
        doc["winners"].append({
            "spec_hash": workloads[w["workload_id"]]["spec_hash"],
            "device_name": w["device_name"], "arch": w["arch"],
            "template_set_hash": w["template_set_hash"], "toolchain_key": w["toolchain_key"],
            "config_name": c["config_name"], "source_sha256": c["source_sha256"],
            "median_ms": w["median_ms"], "recorded_at": _stamp(w["recorded_at"])})
    new = upgrade_doc(doc, Path(str(conn.engine.url.database or "<memory>")))
    for table in ("winners", "trials", "candidates", "workloads", "environments"):
        conn.exec_driver_sql(f"DROP TABLE {table}")
    Base.metadata.create_all(conn)
    load_doc(conn, new)


#: Ordered ``(target_version, step)`` pairs.
MIGRATIONS: list[tuple[int, Migration]] = [(2, v1_to_v2)]


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


def _db_path(conn: Connection) -> str:
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
    check_version(stored, _db_path(conn), target)
    steps = [(v, fn) for v, fn in migrations if stored < v <= target]
    if [v for v, _ in steps] != list(range(stored + 1, target + 1)):
        raise SchemaVersionError(
            _db_path(conn), f"has schema version {stored} and no migration path to version "
            f"{target} (known steps: {versions})")
    for version, step in steps:
        step(conn)
        _write_version(conn, version)
    return [v for v, _ in steps]


def check_version(stored: int | None, path: str | Path, target: int = SCHEMA_VERSION) -> None:
    """Raise `SchemaVersionError` for a file newer than this code."""
    if stored is not None and stored > target:
        raise SchemaVersionError(
            path, f"has schema version {stored}, newer than version {target} that this "
            "tilegen understands; upgrade tilegen, or point TILEGEN_DB at another file")


__all__ = ["MIGRATIONS", "Migration", "SchemaVersionError", "check_version", "read_version",
           "upgrade", "v1_to_v2"]
