"""Tuning DB: models and unique keys, concurrency, winners, export/import, migrations.

Real SQLite files under tmp_path; no mocks. The winner-replacement rule itself is unit-tested
without a DB in tests/test_db_policy.py; broken and read-only files in tests/test_db_errors.py
and tests/test_db_readonly.py.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, inspect, select
from sqlalchemy.exc import IntegrityError, OperationalError

from tilegen.db import (
    SCHEMA_VERSION,
    ConflictError,
    SchemaVersionError,
    TuningDB,
    default_db_path,
    env_key,
    resolve_db_path,
)
from tilegen.db.exchange import read_export
from tilegen.db.migrations import upgrade
from tilegen.db.models import (
    Candidate,
    Environment,
    SchemaVersion,
    Study,
    Winner,
    Workload,
    utcnow,
)
from tilegen.db.records import merge_export_file
from tilegen.identity import VariantKey

H200 = {"device_name": "NVIDIA H200", "arch": "sm_90", "driver": "570.86", "torch": "2.13.0",
        "triton": "3.6.0", "nvcc": "12.8", "clang": None, "tilegen_version": "0.1.0",
        "template_set_hash": "tpl_aaaa"}
SPEC_A, SPEC_B = "a" * 64, "b" * 64
KERNEL = "k" * 64
SPEC = {"encoding": "lut", "head_dim": 128}


def variant(config: str = "cfg4", sha: str = "1" * 64, tool: str = "triton=3.6.0",
            target: str = "sm_90", kernel: str = KERNEL) -> dict[str, str]:
    return VariantKey(kernel, "triton", config, sha, tool, target).to_dict()


def _db(tmp_path: Path, name: str = "tuning.sqlite") -> TuningDB:
    return TuningDB.open(tmp_path / name)


def _seed(db: TuningDB, spec_hash: str = SPEC_A, **kw: Any) -> tuple[int, int]:
    """A workload with one candidate, and the H200 environment; returns (candidate, env) ids."""
    db.upsert_workload(spec_hash, KERNEL, SPEC)
    cid = db.add_candidate(variant(**kw), {"num_warps": 4, "num_stages": 2})
    return cid, db.upsert_environment(H200)


def _win(db: TuningDB, cid: int, ms: float, spec_hash: str = SPEC_A, **kw: Any) -> Any:
    return db.set_winner(spec_hash, cid, device_name="NVIDIA H200", median_ms=ms,
                         timer=kw.pop("timer", "do_bench"), **kw)


# --------------------------------------------------------------------------- paths, open


def test_db_path_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TILEGEN_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_db_path() == tmp_path / "xdg" / "tilegen" / "tuning.sqlite"
    assert resolve_db_path() == default_db_path()
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_db_path() == Path.home() / ".cache" / "tilegen" / "tuning.sqlite"
    monkeypatch.setenv("TILEGEN_DB", str(tmp_path / "env.sqlite"))
    assert resolve_db_path() == tmp_path / "env.sqlite"
    # An explicit path (the CLI's --db) beats the environment variable.
    assert resolve_db_path(tmp_path / "arg.sqlite") == tmp_path / "arg.sqlite"
    with TuningDB.open() as db:
        assert db.path == tmp_path / "env.sqlite"
    assert (tmp_path / "env.sqlite").exists()


def test_open_creates_schema_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "dir" / "t.sqlite"
    with TuningDB.open(path, busy_timeout_ms=1234) as db:
        assert db.schema_version() == SCHEMA_VERSION == 2
        with db.session() as s:
            conn = s.connection()
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 1234
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            tables = set(inspect(conn).get_table_names())
    # no trials table: Optuna's storage is the one record of each trial
    assert tables == {"schema_version", "workloads", "environments", "candidates", "studies",
                      "winners"}
    with TuningDB.open(path) as db:  # reopening keeps the data
        assert db.schema_version() == SCHEMA_VERSION


def test_readonly_open_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite"
    with TuningDB.open(path) as db:
        _seed(db)
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    with TuningDB.open(path, readonly=True) as db:
        assert db.readonly and db.list_workloads()[0].spec_hash == SPEC_A
        with pytest.raises(Exception, match="read-only"):
            db.upsert_workload(SPEC_B, KERNEL, SPEC)
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    from tilegen.db import TuningDBError

    with pytest.raises(TuningDBError, match="does not exist"):
        TuningDB.open(tmp_path / "none.sqlite", readonly=True)
    assert not (tmp_path / "none.sqlite").exists()


# --------------------------------------------------------------------------- unique keys


def test_unique_keys_are_enforced_by_sqlite(tmp_path: Path) -> None:
    db = _db(tmp_path)
    cid, eid = _seed(db)
    _win(db, cid, 1.0)
    wid = db.upsert_workload(SPEC_A, KERNEL, SPEC)
    now = utcnow()
    env_fields = {k: ("" if v is None else v) for k, v in H200.items()}
    v = variant()
    duplicates: list[Any] = [
        Workload(spec_hash=SPEC_A, kernel_hash=KERNEL, spec_json="{}", created_at=now),
        Environment(env_key="other", **env_fields),  # same identity under another key
        Candidate(variant_digest=VariantKey.from_dict(v).digest, kernel_hash=KERNEL,
                  backend="triton", config_name="x", source_sha256="1", toolchain="t",
                  target="sm_90", config_json="{}", created_at=now),
        Winner(workload_id=wid, backend="triton", device_name="NVIDIA H200", target="sm_90",
               candidate_id=cid, median_ms=0.5, timer="do_bench", recorded_at=now),
    ]
    for row in duplicates:
        with pytest.raises(IntegrityError), db.session(write=True) as s:
            s.add(row)
    # another target is another winner
    with db.session(write=True) as s:
        s.add(Winner(workload_id=wid, backend="triton", device_name="NVIDIA H200",
                     target="sm_100a", candidate_id=cid, median_ms=0.5, timer="do_bench",
                     recorded_at=now))
    with pytest.raises(IntegrityError), db.session(write=True) as s:
        s.add(SchemaVersion(id=2, version=1, updated_at=now))
    db.close()


def test_upserts_are_idempotent(tmp_path: Path) -> None:
    db = _db(tmp_path)
    w1 = db.upsert_workload(SPEC_A, KERNEL, '{"head_dim": 128, "encoding": "lut"}')
    assert db.upsert_workload(SPEC_A, KERNEL, {"encoding": "lut", "head_dim": 128}) == w1
    with pytest.raises(ConflictError, match=SPEC_A):
        db.upsert_workload(SPEC_A, KERNEL, {"encoding": "mask"})
    with pytest.raises(ConflictError):
        db.upsert_workload(SPEC_A, "other", SPEC)
    with pytest.raises(TypeError):
        db.upsert_workload(SPEC_B, KERNEL, "[1, 2]")

    e1 = db.upsert_environment(H200)
    assert db.upsert_environment({**H200, "clang": ""}) == e1  # None and "" are one value
    assert db.upsert_environment({**H200, "triton": "3.7.0"}) != e1
    assert env_key(H200) == env_key(dict(reversed(list(H200.items()))))
    with pytest.raises(ValueError, match="tilegen"):
        db.upsert_environment({**H200, "tilegen": "0.1"})  # misspelt field
    with pytest.raises(ValueError, match="arch"):
        db.upsert_environment({"device_name": "x"})

    c1 = db.add_candidate(variant(), {"num_warps": 4})
    assert db.add_candidate(variant(), {"num_warps": 8}) == c1  # first config kept
    assert db.add_candidate(variant(sha="2" * 64), {"num_warps": 4}) != c1
    with pytest.raises(ValueError, match="lacks"):
        db.add_candidate({"backend": "triton"}, {})
    db.record_study("sqlite:///x/optuna.sqlite", "s1", SPEC_A, backend="triton",
                    device_name="NVIDIA H200", target="sm_90", timer="do_bench")
    db.record_study("sqlite:///x/optuna.sqlite", "s1", SPEC_A, backend="triton",
                    device_name="NVIDIA H200", target="sm_90", timer="do_bench")
    db.record_study("postgresql://u:secret@db/tilegen", "s2", SPEC_A, backend="triton",
                    device_name="NVIDIA H200", target="sm_90", timer="do_bench")
    with db.session() as s:
        assert sorted(s.scalars(select(Study.storage))) == [
            "postgresql://u@db/tilegen", "sqlite:///x/optuna.sqlite"]  # no password stored
    db.close()


def test_write_transactions_take_the_lock_up_front(tmp_path: Path) -> None:
    """BEGIN IMMEDIATE: a second writer waits at BEGIN (busy_timeout), not at a lock upgrade."""
    a = TuningDB.open(tmp_path / "t.sqlite")
    b = TuningDB.open(tmp_path / "t.sqlite", busy_timeout_ms=50)
    with a.session(write=True) as sa:
        sa.connection()
        with pytest.raises(OperationalError, match="locked"), b.session(write=True) as sb:
            sb.connection()
        with b.session() as s:  # WAL: readers are not blocked by the writer
            assert s.scalar(select(func.count()).select_from(Workload)) == 0
    a.close()
    b.close()


# --------------------------------------------------------------------------- concurrency


def _concurrent_writer(db_path: str, worker: int, n: int, barrier: Any) -> None:
    barrier.wait(timeout=120)  # both open the (not yet existing) file at the same moment
    with TuningDB.open(db_path) as db:
        db.upsert_workload(SPEC_A, KERNEL, SPEC)
        db.upsert_environment(H200)
        for i in range(n):
            number = worker * n + i
            cid = db.add_candidate(variant(f"cfg{number}"), {"n": number})
            _win(db, cid, 1.0 + number)


def test_two_processes_write_at_once(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    path = str(tmp_path / "shared.sqlite")
    barrier = ctx.Barrier(2)
    n = 40
    procs = [ctx.Process(target=_concurrent_writer, args=(path, w, n, barrier))
             for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    assert [p.exitcode for p in procs] == [0, 0]
    with TuningDB.open(path) as db, db.session() as s:
        assert s.scalar(select(func.count()).select_from(Candidate)) == 2 * n
        assert s.scalar(select(func.count()).select_from(Workload)) == 1
        assert s.scalar(select(func.count()).select_from(Environment)) == 1
        assert s.scalars(select(Winner.median_ms)).all() == [1.0]  # the fastest stayed


# --------------------------------------------------------------------------- winners


def test_set_winner_follows_the_policy(tmp_path: Path) -> None:
    db = _db(tmp_path)
    slow, eid = _seed(db)
    fast = db.add_candidate(variant("cfg8", "2" * 64), {"num_warps": 8})
    assert _win(db, slow, 2.0, environment_id=eid).action == "inserted"
    assert _win(db, slow, 2.0, environment_id=eid).reason == "same"
    res = _win(db, fast, 1.0)
    assert (res.action, res.reason, res.previous_ms) == ("replaced", "faster", 2.0)
    assert _win(db, slow, 2.0).action == "kept"
    assert _win(db, slow, 2.0, force=True).reason == "forced"
    # a test-only timer never replaces a real one, even faster
    fake = _win(db, fast, 0.1, timer="fake-deterministic")
    assert (fake.action, fake.reason) == ("kept", "fake timer")
    # currency: a stale stored winner gives way to a current one, even slower
    stale_sha = {"1" * 64}

    def currency(v: Any, cfg: Any, spec: Any) -> bool:
        return v["source_sha256"] not in stale_sha

    res = _win(db, fast, 5.0, currency=currency)
    assert (res.action, res.reason) == ("replaced", "current")
    (w,) = db.winners_for_kernel(KERNEL, "triton", "NVIDIA H200", "sm_90")
    assert (w.config_name, w.median_ms, w.timer, w.spec_hash) == ("cfg8", 5.0, "do_bench",
                                                                  SPEC_A)
    assert w.variant == variant("cfg8", "2" * 64) and w.spec == SPEC
    # a candidate of another kernel cannot win
    other = db.add_candidate(variant(kernel="z" * 64), {})
    with pytest.raises(ValueError, match="not of spec"):
        _win(db, other, 0.1)
    db.close()


def test_winners_for_kernel_spans_workloads(tmp_path: Path) -> None:
    db = _db(tmp_path)
    cid, _ = _seed(db, SPEC_A)
    db.upsert_workload(SPEC_B, KERNEL, {**SPEC, "num_heads": 12})
    _win(db, cid, 1.0, SPEC_A)
    _win(db, cid, 2.0, SPEC_B)
    found = db.winners_for_kernel(KERNEL, "triton", "NVIDIA H200", "sm_90")
    assert [(w.spec_hash, w.median_ms) for w in found] == [(SPEC_A, 1.0), (SPEC_B, 2.0)]
    assert db.winners_for_kernel(KERNEL, "triton", "NVIDIA H100", "sm_90") == []
    assert db.winners_for_kernel(KERNEL, "triton", "NVIDIA H200", "sm_100a") == []
    db.close()


def test_list_and_show(tmp_path: Path) -> None:
    db = _db(tmp_path)
    cid, eid = _seed(db)
    db.upsert_workload(SPEC_B, "other" * 8, {"encoding": "mask"})
    _win(db, cid, 1.0, environment_id=eid, study="s1", trial_number=3)
    db.record_study("sqlite:///o.sqlite", "s1", SPEC_A, backend="triton",
                    device_name="NVIDIA H200", target="sm_90", timer="do_bench")
    infos = db.list_workloads()
    assert [w.spec_hash for w in infos] == [SPEC_A, SPEC_B]
    assert (infos[0].n_candidates, infos[0].n_winners, infos[0].n_studies) == (1, 1, 1)
    assert (infos[1].n_candidates, infos[1].n_winners, infos[1].n_studies) == (0, 0, 0)
    d = db.show(SPEC_A)
    assert d.workload.spec == SPEC and [w.config_name for w in d.winners] == ["cfg4"]
    assert d.winners[0].env_key == env_key(H200) and d.winners[0].trial_number == 3
    assert [st.name for st in d.studies] == ["s1"] and len(d.candidates) == 1
    with pytest.raises(KeyError):
        db.show("c" * 64)
    db.close()


# --------------------------------------------------------------------------- export / import


def _populate(db: TuningDB) -> None:
    """Two workloads (two kernels), two devices, real and fake winners, out of order."""
    h100 = {**H200, "device_name": "NVIDIA H100", "driver": "550.1"}
    envs = {"NVIDIA H100": db.upsert_environment(h100), "NVIDIA H200": db.upsert_environment(H200)}
    for spec_hash, kernel in ((SPEC_B, "j" * 64), (SPEC_A, KERNEL)):
        db.upsert_workload(spec_hash, kernel, {**SPEC, "h": spec_hash[0]})
        cands = [db.add_candidate(variant(f"w{w}", f"{w}" * 64, kernel=kernel),
                                  {"num_warps": w}) for w in (8, 4, 2)]
        for dev, cid, ms in (("NVIDIA H200", cands[1], 1.125), ("NVIDIA H100", cands[0], 1.5)):
            db.set_winner(spec_hash, cid, device_name=dev, median_ms=ms, timer="do_bench",
                          environment_id=envs[dev])
        db.set_winner(spec_hash, cands[2], device_name="cpu", median_ms=1.7,
                      timer="fake-deterministic")


def test_export_import_round_trip(tmp_path: Path) -> None:
    src = _db(tmp_path, "src.sqlite")
    _populate(src)
    for include_fake in (False, True):
        text = src.export_json(tmp_path / "export.json", include_fake=include_fake)
        assert (tmp_path / "export.json").read_text() == text
        doc = json.loads(text)
        assert doc["schema_version"] == SCHEMA_VERSION and doc["format"] == "tilegen-tuning-db"
        # Reviewable: indented, sorted keys, rows sorted by their natural keys.
        assert text == json.dumps(doc, indent=2, sort_keys=True) + "\n"
        assert [w["spec_hash"] for w in doc["workloads"]] == [SPEC_A, SPEC_B]
        devices = ("NVIDIA H100", "NVIDIA H200") + (("cpu",) if include_fake else ())
        assert [(w["spec_hash"], w["device_name"]) for w in doc["winners"]] == sorted(
            (h, d) for h in (SPEC_A, SPEC_B) for d in devices)
        assert all(w["timer"] == "do_bench" for w in doc["winners"]
                   if w["device_name"] != "cpu")
        assert len(doc["candidates"]) == 6 and len(doc["environments"]) == 2
        dst = _db(tmp_path, f"dst{include_fake}.sqlite")
        rep = dst.import_json(tmp_path / "export.json")
        assert rep.changed and rep.winners_inserted == len(devices) * 2
        assert dst.export_json(include_fake=include_fake) == text
        again = dst.import_json(tmp_path / "export.json")  # a re-import is a no-op
        assert not again.changed and again.winners_kept == len(devices) * 2 and not again.notes
        assert dst.export_json(include_fake=include_fake) == text
        dst.close()
    src.close()


def test_export_one_spec(tmp_path: Path) -> None:
    with _db(tmp_path) as db:
        _populate(db)
        doc = db.export_dict(spec_hash=SPEC_A)
        assert [w["spec_hash"] for w in doc["workloads"]] == [SPEC_A]
        assert {c["variant"]["kernel_hash"] for c in doc["candidates"]} == {KERNEL}
        assert {w["spec_hash"] for w in doc["winners"]} == {SPEC_A}
        assert doc["_left_out_fake"] == 1
        with pytest.raises(KeyError):
            db.export_dict(spec_hash="c" * 64)


def _winner_doc(tmp_path: Path, name: str, *, sha: str, ms: float, when: datetime,
                tool: str = "triton=3.6.0", timer: str = "do_bench") -> dict[str, Any]:
    with _db(tmp_path, name) as db:
        db.upsert_workload(SPEC_A, KERNEL, SPEC)
        cid = db.add_candidate(variant(f"cfg_{sha[0]}", sha, tool), {"sha": sha[0]})
        _win(db, cid, ms, recorded_at=when, timer=timer)
        return db.export_dict(include_fake=True)


def test_import_winner_conflicts(tmp_path: Path) -> None:
    now = utcnow()
    old_fast = _winner_doc(tmp_path, "old.sqlite", sha="o" * 64, ms=9.0,
                           when=now - timedelta(days=30))
    new_slow = _winner_doc(tmp_path, "new.sqlite", sha="n" * 64, ms=10.0, when=now)

    def current(v: Any, cfg: Any, spec: Any) -> bool:  # this checkout renders "n" sources
        return v["source_sha256"] == "n" * 64

    where = ("NVIDIA H200", "sm_90")
    with _db(tmp_path, "local.sqlite") as db:
        db.import_json(new_slow)
        # currency unknown, same toolchain: times are compared, the faster old one wins
        rep = db.import_json(old_fast)
        assert rep.winners_replaced == 1 and "faster" in rep.notes[0]
        # with currency: only the current one can win, however fast the stale one is
        rep = db.import_json(new_slow, currency=current)
        assert rep.winners_replaced == 1 and "only the imported one matches" in rep.notes[0]
        rep = db.import_json(old_fast, currency=current)
        assert rep.winners_kept == 1 and rep.notes[0].startswith("kept local winner")
        (w,) = db.winners_for_kernel(KERNEL, "triton", *where)
        assert w.median_ms == 10.0
        rep = db.import_json(old_fast, force=True, currency=current)
        assert rep.winners_replaced == 1 and "--force" in rep.notes[0]
    # another toolchain, currency unknown: not comparable, the later recording wins
    other_tool = _winner_doc(tmp_path, "tool.sqlite", sha="t" * 64, ms=20.0,
                             when=now + timedelta(days=1), tool="triton=9.9.9")
    with _db(tmp_path, "local2.sqlite") as db:
        db.import_json(new_slow)
        rep = db.import_json(other_tool)
        assert rep.winners_replaced == 1 and "recorded later" in rep.notes[0]
    # a test-only timer never replaces a real winner
    fake = _winner_doc(tmp_path, "fake.sqlite", sha="f" * 64, ms=0.1, when=now,
                       timer="fake-deterministic")
    with _db(tmp_path, "local3.sqlite") as db:
        db.import_json(new_slow)
        rep = db.import_json(fake)
        assert rep.winners_kept == 1 and "test-only timer" in rep.notes[0]
    conflicting = json.loads(json.dumps(new_slow))
    conflicting["workloads"][0]["spec"] = {"encoding": "mask"}
    with _db(tmp_path, "local4.sqlite") as db:
        db.import_json(new_slow)
        with pytest.raises(ConflictError, match=r"workloads\[0\]"):
            db.import_json(conflicting)


def test_merge_export_file_keeps_what_the_file_holds(tmp_path: Path) -> None:
    """``tilegen tune --export FILE`` for a second spec adds to FILE instead of replacing it."""
    dest = tmp_path / "shipped" / "winners.json"
    with _db(tmp_path, "src.sqlite") as db:
        _populate(db)
        doc_a = db.export_dict(spec_hash=SPEC_A)
        assert merge_export_file(dest, doc_a) is None  # no file yet: written as is
        assert dest.read_text() == db.export_json(spec_hash=SPEC_A)
        rep = merge_export_file(dest, db.export_dict(spec_hash=SPEC_B))
        assert rep is not None and rep.winners_inserted == 2
        both = dest.read_text()
        assert both == db.export_json()  # the union is the export of both specs, sorted
        rep = merge_export_file(dest, doc_a)  # idempotent
        assert rep is not None and not rep.changed and rep.notes == []
        assert dest.read_text() == both
    for junk in ("not json", '{"format": "something-else"}'):
        bad = tmp_path / "bad.json"
        bad.write_text(junk)
        with pytest.raises(ValueError, match=str(bad)):
            merge_export_file(bad, doc_a)
        assert bad.read_text() == junk


def test_export_writes_through_the_shared_atomic_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One atomic writer for tilegen (tilegen.cache.atomic_write), not a copy in the DB."""
    import tilegen.cache
    from tilegen.db import exchange

    assert exchange.atomic_write is tilegen.cache.atomic_write
    calls: list[Path] = []

    def spy(path: Path, data: str | bytes) -> Path:
        calls.append(path)
        return tilegen.cache.atomic_write(path, data)

    monkeypatch.setattr(exchange, "atomic_write", spy)
    with _db(tmp_path) as db:
        _populate(db)
        text = db.export_json(tmp_path / "out" / "x.json")
    assert calls == [tmp_path / "out" / "x.json"]
    assert (tmp_path / "out" / "x.json").read_text() == text
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["x.json"]  # no temp file left


# --------------------------------------------------------------------------- schema version

V1_DDL = """
CREATE TABLE schema_version (id INTEGER PRIMARY KEY CHECK (id = 1), version INTEGER NOT NULL,
  updated_at DATETIME NOT NULL);
CREATE TABLE workloads (id INTEGER PRIMARY KEY, spec_hash VARCHAR(128) NOT NULL UNIQUE,
  spec_json TEXT NOT NULL, created_at DATETIME NOT NULL);
CREATE TABLE environments (id INTEGER PRIMARY KEY, env_key VARCHAR(64) NOT NULL UNIQUE,
  device_name VARCHAR(256) NOT NULL, arch VARCHAR(64) NOT NULL, driver VARCHAR(128) NOT NULL,
  torch VARCHAR(128) NOT NULL, triton VARCHAR(128) NOT NULL, nvcc VARCHAR(128) NOT NULL,
  clang VARCHAR(128) NOT NULL, tilegen_version VARCHAR(128) NOT NULL,
  template_set_hash VARCHAR(128) NOT NULL);
CREATE TABLE candidates (id INTEGER PRIMARY KEY, workload_id INTEGER NOT NULL
  REFERENCES workloads (id) ON DELETE CASCADE, config_name VARCHAR(512) NOT NULL,
  config_json TEXT NOT NULL, source_sha256 VARCHAR(128) NOT NULL);
CREATE TABLE trials (id INTEGER PRIMARY KEY, candidate_id INTEGER NOT NULL
  REFERENCES candidates (id) ON DELETE CASCADE, environment_id INTEGER NOT NULL
  REFERENCES environments (id), study VARCHAR(256) NOT NULL, trial_number INTEGER NOT NULL,
  status VARCHAR(32) NOT NULL, median_ms FLOAT, tflops FLOAT, scores_json TEXT,
  error_class VARCHAR(256), error_text TEXT, created_at DATETIME NOT NULL);
CREATE TABLE winners (id INTEGER PRIMARY KEY, workload_id INTEGER NOT NULL
  REFERENCES workloads (id) ON DELETE CASCADE, device_name VARCHAR(256) NOT NULL,
  arch VARCHAR(64) NOT NULL, template_set_hash VARCHAR(128) NOT NULL,
  toolchain_key VARCHAR(512) NOT NULL, candidate_id INTEGER NOT NULL
  REFERENCES candidates (id) ON DELETE CASCADE, median_ms FLOAT NOT NULL,
  recorded_at DATETIME NOT NULL);
"""


def _v1_file(path: Path) -> None:
    """A version 1 DB as tilegen 0.1 wrote it: one real H200 winner, one CPU (fake) winner,
    and a candidate that only a trial names."""
    from tilegen.spec import Spec

    spec = Spec(grid=(4, 4, 8), num_heads=2, head_dim=64, topk=2)
    env = {**{k: ("" if v is None else v) for k, v in H200.items()}}
    cpu = {**env, "device_name": "cpu", "driver": ""}
    with sqlite3.connect(path) as c:
        c.executescript(V1_DDL)
        c.execute("INSERT INTO schema_version VALUES (1, 1, '2026-01-01 00:00:00.000000')")
        c.execute("INSERT INTO workloads VALUES (1, ?, ?, '2026-01-01 00:00:00.000000')",
                  (spec.hash, json.dumps(spec.to_dict())))
        for i, e in enumerate((env, cpu), 1):
            c.execute("INSERT INTO environments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                      (i, env_key(e), *(e[f] for f in (
                          "device_name", "arch", "driver", "torch", "triton", "nvcc", "clang",
                          "tilegen_version", "template_set_hash"))))
        for i, name in enumerate(("bm64_bn64_w4_s3_lse", "bm32_bn64_w4_s2_lse",
                                  "bm64_bn32_w4_s2_lse"), 1):
            c.execute("INSERT INTO candidates VALUES (?, 1, ?, '{}', ?)", (i, name, "s" * 64))
        c.execute("INSERT INTO trials VALUES (1, 3, 1, 'st', 0, 'pass', 2.0, NULL, NULL, NULL,"
                  " NULL, '2026-01-01 00:00:00.000000')")
        c.execute("INSERT INTO winners VALUES (1, 1, 'NVIDIA H200', 'sm_90', 'tpl_aaaa', "
                  "'triton=3.6.0', 1, 9.5, '2026-01-02 03:04:05.000006')")
        c.execute("INSERT INTO winners VALUES (2, 1, 'cpu', 'sm_90', 'tpl_aaaa', "
                  "'triton=3.6.0', 2, 1.5, '2026-01-02 03:04:05.000006')")
    c.close()


def test_version_1_file_is_migrated_at_open(tmp_path: Path) -> None:
    path = tmp_path / "v1.sqlite"
    _v1_file(path)
    from tilegen.db import TuningDBError

    with pytest.raises(TuningDBError, match="schema version 1.*tilegen db migrate"):
        TuningDB.open(path, readonly=True)  # read-only never migrates
    from tilegen.cli import main

    assert main(["db", "migrate", "--db", str(path)]) == 0
    with TuningDB.open(path, readonly=True) as db:
        assert db.schema_version() == 2
        (w,) = db.list_workloads()
        winners = {x.device_name: x for x in db.winners()}
        h200, cpu = winners["NVIDIA H200"], winners["cpu"]
        assert (h200.config_name, h200.median_ms, h200.timer) == (
            "bm64_bn64_w4_s3_lse", 9.5, "do_bench")
        assert h200.variant == VariantKey(w.kernel_hash, "triton", "bm64_bn64_w4_s3_lse",
                                          "s" * 64, "triton=3.6.0", "sm_90").to_dict()
        assert h200.env_key == env_key(H200) and h200.template_set_hash == "tpl_aaaa"
        assert h200.recorded_at == datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
        assert cpu.timer == "fake-deterministic"  # v1 recorded CPU winners only for it
        assert w.n_candidates == 3  # the trial-only candidate got its toolchain from the trial


def test_version_1_export_is_read(tmp_path: Path) -> None:
    """The shipped file before this change (a version 1 export) imports as version 2."""
    path = tmp_path / "v1.sqlite"
    _v1_file(path)
    with sqlite3.connect(path) as c:
        rows = {t: [dict(zip([d[0] for d in c.execute(f"SELECT * FROM {t}").description], r,
                             strict=True)) for r in c.execute(f"SELECT * FROM {t}")]
                for t in ("workloads", "winners", "candidates")}
    c.close()
    spec_hash = rows["workloads"][0]["spec_hash"]
    doc = {"format": "tilegen-tuning-db", "schema_version": 1,
           "workloads": [{"spec_hash": spec_hash,
                          "spec": json.loads(rows["workloads"][0]["spec_json"])}],
           "environments": [{**{k: ("" if v is None else v) for k, v in H200.items()},
                             "env_key": "whatever"}],
           "candidates": [{"spec_hash": spec_hash, "config_name": "bm64_bn64_w4_s3_lse",
                           "source_sha256": "s" * 64, "config": {"block_m": 64}}],
           "winners": [{"spec_hash": spec_hash, "device_name": "NVIDIA H200", "arch": "sm_90",
                        "template_set_hash": "tpl_aaaa", "toolchain_key": "triton=3.6.0",
                        "config_name": "bm64_bn64_w4_s3_lse", "source_sha256": "s" * 64,
                        "median_ms": 9.5, "recorded_at": "2026-01-02T03:04:05.000006Z"}]}
    new = read_export(doc)
    assert new["schema_version"] == 2 and new["winners"][0]["timer"] == "do_bench"
    with _db(tmp_path, "x.sqlite") as db:
        assert db.import_json(doc).winners_inserted == 1


def _set_stored_version(path: Path, version: int) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE schema_version SET version = ? WHERE id = 1", (version,))
    conn.close()


def test_newer_db_than_code_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite"
    TuningDB.open(path).close()
    _set_stored_version(path, SCHEMA_VERSION + 1)
    for readonly in (False, True):
        with pytest.raises(SchemaVersionError) as err:
            TuningDB.open(path, readonly=readonly)
        msg = str(err.value)
        assert f"schema version {SCHEMA_VERSION + 1}" in msg and str(path) in msg
        assert f"version {SCHEMA_VERSION} that this tilegen understands" in msg


def test_failed_migration_leaves_the_file_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite"
    TuningDB.open(path).close()
    _set_stored_version(path, SCHEMA_VERSION - 1)

    def half_done(conn: Any) -> None:
        conn.exec_driver_sql("ALTER TABLE winners ADD COLUMN note TEXT")
        raise RuntimeError("step failed midway")

    with pytest.raises(RuntimeError, match="midway"):
        TuningDB.open(path, migrations=[(SCHEMA_VERSION, half_done)])
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone() == (
            SCHEMA_VERSION - 1,)
        cols = {row[1] for row in conn.execute("PRAGMA table_info(winners)")}
    conn.close()
    assert "note" not in cols


def test_next_schema_change_is_append_a_function(tmp_path: Path) -> None:
    """What version 3 will look like: one more (version, step) pair, applied in order."""
    path = tmp_path / "t.sqlite"
    db = TuningDB.open(path)

    def v3(conn: Any) -> None:
        conn.exec_driver_sql("ALTER TABLE winners ADD COLUMN peak_mem_mb REAL")

    def v4(conn: Any) -> None:
        conn.exec_driver_sql("CREATE INDEX ix_winners_peak_mem_mb ON winners (peak_mem_mb)")

    target = SCHEMA_VERSION + 2
    steps = [(SCHEMA_VERSION + 1, v3), (target, v4)]
    with db.session(write=True) as s:
        assert upgrade(s.connection(), target=target, migrations=steps) == [
            SCHEMA_VERSION + 1, target]
    assert db.schema_version() == target
    with db.session(write=True) as s:
        assert upgrade(s.connection(), target=target, migrations=steps) == []
    with db.session(write=True) as s, pytest.raises(ValueError, match="increasing"):
        upgrade(s.connection(), target=target, migrations=list(reversed(steps)))
    db.close()
    with pytest.raises(SchemaVersionError):
        TuningDB.open(path)


def test_export_merge_after_a_retune(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """After a template change and a re-tune, `db export --merge` puts the new (current) winner
    in place of the shipped (stale) one and keeps the file's other workloads."""
    from tilegen import backends
    from tilegen.cli import main
    from tilegen.config import KernelConfig
    from tilegen.spec import Spec
    from tilegen.targets import get_target

    spec, other = Spec(grid=(4, 4, 8), num_heads=2, topk=2), Spec(grid=(4, 4, 8), topk=2)
    triton = backends.get("triton")
    cfg = KernelConfig(block_m=32)

    def store(path: Path, s: Spec, ms: float, sha: str | None = None) -> None:
        key = triton.variant_key(s, cfg, get_target("sm_90")).to_dict()
        key["source_sha256"] = sha or key["source_sha256"]
        with TuningDB.open(path) as db:
            db.upsert_workload(s.hash, s.kernel_hash, s.to_dict())
            db.set_winner(s.hash, db.add_candidate(key, cfg.to_dict()),
                          device_name="NVIDIA H200", median_ms=ms, timer="do_bench")

    shipped = tmp_path / "winners.json"
    store(tmp_path / "old.sqlite", spec, 1.0, sha="0" * 64)  # tuned before the template edit
    store(tmp_path / "old.sqlite", other, 3.0)
    with TuningDB.open(tmp_path / "old.sqlite") as db:
        db.export_json(shipped)
    store(tmp_path / "new.sqlite", spec, 2.0)  # the re-tune: slower, but current
    code = main(["db", "export", "--db", str(tmp_path / "new.sqlite"), "--spec-hash",
                 spec.hash[:10], "--out", str(shipped), "--merge"])
    out = capsys.readouterr().out
    assert code == 0 and f"into {shipped}" in out and "only the imported one matches" in out
    doc = json.loads(shipped.read_text())
    by_spec = {w["spec_hash"]: w for w in doc["winners"]}
    assert by_spec[spec.hash]["median_ms"] == 2.0 and by_spec[other.hash]["median_ms"] == 3.0
