"""Tuning DB: models and unique keys, concurrency, winner lookup, export/import, migrations.

Real SQLite files under tmp_path; no mocks.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sqlite3
import subprocess
import sys
import textwrap
from datetime import timedelta
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
    toolchain_key,
)
from tilegen.db.migrations import upgrade
from tilegen.db.models import (
    Candidate,
    Environment,
    SchemaVersion,
    Trial,
    Winner,
    Workload,
    utcnow,
)
from tilegen.db.store import MAX_ERROR_TEXT, merge_export_file

H200 = {"device_name": "NVIDIA H200", "arch": "sm_90", "driver": "570.86", "torch": "2.13.0",
        "triton": "3.6.0", "nvcc": "12.8", "clang": None, "tilegen_version": "0.1.0",
        "template_set_hash": "tpl_aaaa"}
SPEC_A = "a" * 64
SPEC_B = "b" * 64


def _db(tmp_path: Path, name: str = "tuning.sqlite") -> TuningDB:
    return TuningDB.open(tmp_path / name)


def _seed(db: TuningDB, spec_hash: str = SPEC_A) -> tuple[int, int]:
    """A workload with one candidate, and the H200 environment; returns (candidate, env) ids."""
    db.upsert_workload(spec_hash, {"encoding": "lut", "head_dim": 128})
    cid = db.add_candidate(spec_hash, "bq64_bkv64_w4_s2", {"num_warps": 4, "num_stages": 2},
                           "1" * 64)
    return cid, db.upsert_environment(H200)


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
    with TuningDB.open(tmp_path / "sub" / "dir" / "t.sqlite", busy_timeout_ms=1234) as db:
        assert db.schema_version() == SCHEMA_VERSION
        with db.session() as s:
            conn = s.connection()
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 1234
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            tables = set(inspect(conn).get_table_names())
    assert tables == {"schema_version", "workloads", "environments", "candidates", "trials",
                      "winners"}
    # Reopening an existing file is fine and keeps the data.
    with TuningDB.open(tmp_path / "sub" / "dir" / "t.sqlite") as db:
        assert db.schema_version() == SCHEMA_VERSION


# --------------------------------------------------------------------------- unique keys


def test_unique_keys_are_enforced_by_sqlite(tmp_path: Path) -> None:
    db = _db(tmp_path)
    cid, eid = _seed(db)
    db.record_trial("study", 0, cid, eid, "pass", median_ms=1.0)
    db.set_winner(SPEC_A, cid, device_name="NVIDIA H200", arch="sm_90",
                  template_set_hash="tpl_aaaa", toolchain_key="triton=3.6.0", median_ms=1.0)
    wid = db.upsert_workload(SPEC_A, {"encoding": "lut", "head_dim": 128})
    now = utcnow()
    env_fields = {k: ("" if v is None else v) for k, v in H200.items()}
    duplicates: list[Any] = [
        Workload(spec_hash=SPEC_A, spec_json="{}", created_at=now),
        # Same identity under another key: the all-fields UNIQUE catches it.
        Environment(env_key="other", **env_fields),
        Candidate(workload_id=wid, config_name="bq64_bkv64_w4_s2", config_json="{}",
                  source_sha256="1" * 64),
        Trial(candidate_id=cid, environment_id=eid, study="study", trial_number=0,
              status="pass", created_at=now),
        Winner(workload_id=wid, device_name="NVIDIA H200", arch="sm_90",
               template_set_hash="x", toolchain_key="y", candidate_id=cid, median_ms=0.5,
               recorded_at=now),
    ]
    for row in duplicates:
        with pytest.raises(IntegrityError), db.session(write=True) as s:
            s.add(row)
    # Different natural keys go in: a second arch, a new trial number, another source hash.
    with db.session(write=True) as s:
        s.add(Winner(workload_id=wid, device_name="NVIDIA H200", arch="sm_100a",
                     template_set_hash="x", toolchain_key="y", candidate_id=cid, median_ms=0.5,
                     recorded_at=now))
        s.add(Trial(candidate_id=cid, environment_id=eid, study="study", trial_number=1,
                    status="pruned", created_at=now))
        s.add(Candidate(workload_id=wid, config_name="bq64_bkv64_w4_s2", config_json="{}",
                        source_sha256="2" * 64))
    # A second schema_version row is refused (single-row table).
    with pytest.raises(IntegrityError), db.session(write=True) as s:
        s.add(SchemaVersion(id=2, version=1, updated_at=now))
    db.close()


def test_upserts_are_idempotent(tmp_path: Path) -> None:
    db = _db(tmp_path)
    w1 = db.upsert_workload(SPEC_A, '{"head_dim": 128, "encoding": "lut"}')
    # A dict, or JSON text with other key order/spacing, is the same canonical spec.
    assert db.upsert_workload(SPEC_A, {"encoding": "lut", "head_dim": 128}) == w1
    with pytest.raises(ConflictError, match=SPEC_A):
        db.upsert_workload(SPEC_A, {"encoding": "mask"})
    with pytest.raises(TypeError):
        db.upsert_workload(SPEC_B, "[1, 2]")

    e1 = db.upsert_environment(H200)
    assert db.upsert_environment({**H200, "clang": ""}) == e1  # None and "" are one value
    assert db.upsert_environment({**H200, "triton": "3.7.0"}) != e1
    assert env_key(H200) == env_key(dict(reversed(list(H200.items()))))
    assert len(env_key(H200)) == 16
    with pytest.raises(ValueError, match="tilegen"):
        db.upsert_environment({**H200, "tilegen": "0.1"})  # misspelt field
    with pytest.raises(ValueError, match="arch"):
        db.upsert_environment({"device_name": "x"})

    c1 = db.add_candidate(SPEC_A, "cfg", {"num_warps": 4}, "1" * 64)
    assert db.add_candidate(SPEC_A, "cfg", {"num_warps": 4}, "1" * 64) == c1
    assert db.add_candidate(SPEC_A, "cfg", {"num_warps": 4}, "2" * 64) != c1
    with pytest.raises(KeyError):
        db.add_candidate(SPEC_B, "cfg", {}, "1" * 64)

    t1 = db.record_trial("s", 7, c1, e1, "compile_error", error_class="CompilationError",
                         error_text="boom")
    # Same (study, trial_number): same row, updated to the latest report.
    assert db.record_trial("s", 7, c1, e1, "pass", median_ms=2.5, tflops=300.0,
                           scores=[{"min_head_cos": 0.99999, "max_abs": float("inf")}]) == t1
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Trial)) == 1
        row = s.get(Trial, t1)
        assert row is not None
        assert (row.status, row.median_ms, row.error_class) == ("pass", 2.5, None)
        assert json.loads(row.scores_json or "") == [{"min_head_cos": 0.99999, "max_abs": "inf"}]
    with pytest.raises(ValueError, match="status"):
        db.record_trial("s", 8, c1, e1, "crashed")
    with pytest.raises(ValueError, match="median_ms"):
        db.record_trial("s", 8, c1, e1, "pass")
    with pytest.raises(ValueError, match="median_ms"):
        db.record_trial("s", 8, c1, e1, "pass", median_ms=float("nan"))
    with pytest.raises(KeyError):
        db.record_trial("s", 8, 999, e1, "pruned")
    long = "x" * (3 * MAX_ERROR_TEXT)
    tid = db.record_trial("s", 9, c1, e1, "runtime_error", error_text=long)
    with db.session() as s:
        row = s.get(Trial, tid)
        assert row is not None and row.error_text is not None
        assert len(row.error_text) < MAX_ERROR_TEXT + 100 and "characters cut" in row.error_text
    db.close()


def test_write_transactions_take_the_lock_up_front(tmp_path: Path) -> None:
    """BEGIN IMMEDIATE: a second writer waits at BEGIN (busy_timeout), not at a lock upgrade."""
    a = TuningDB.open(tmp_path / "t.sqlite")
    b = TuningDB.open(tmp_path / "t.sqlite", busy_timeout_ms=50)
    # Sessions begin lazily: the transaction (and BEGIN IMMEDIATE) starts at first use.
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
        db.upsert_workload(SPEC_A, {"encoding": "lut"})
        eid = db.upsert_environment(H200)
        cid = db.add_candidate(SPEC_A, "shared", {"num_warps": 4}, "1" * 64)
        for i in range(n):
            number = worker * n + i
            db.record_trial("concurrent", number, cid, eid, "pass", median_ms=1.0 + number)
            db.set_winner(SPEC_A, cid, device_name="NVIDIA H200", arch="sm_90",
                          template_set_hash="tpl", toolchain_key="tc",
                          median_ms=1.0 + number)


def test_two_processes_write_at_once(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    path = str(tmp_path / "shared.sqlite")
    barrier = ctx.Barrier(2)
    n = 50
    procs = [ctx.Process(target=_concurrent_writer, args=(path, w, n, barrier))
             for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    assert [p.exitcode for p in procs] == [0, 0]
    with TuningDB.open(path) as db, db.session() as s:
        numbers = s.scalars(select(Trial.trial_number).where(Trial.study == "concurrent"))
        assert sorted(numbers) == list(range(2 * n))
        assert s.scalar(select(func.count()).select_from(Workload)) == 1
        assert s.scalar(select(func.count()).select_from(Environment)) == 1
        assert s.scalar(select(func.count()).select_from(Candidate)) == 1
        assert s.scalars(select(Winner.median_ms)).all() == [1.0]


# --------------------------------------------------------------------------- winners


def test_winner_lookup_hit_miss_stale(tmp_path: Path) -> None:
    db = _db(tmp_path)
    tc = toolchain_key(H200)
    assert tc == "triton=3.6.0"  # the Triton version only: see test_toolchain_key_*
    miss = db.lookup_winner(SPEC_A, "NVIDIA H200", "sm_90", "tpl_aaaa", tc)
    assert miss.status == "miss" and not miss.hit and miss.config is None
    assert "no tuned winner" in miss.message

    cid, _ = _seed(db)
    res = db.set_winner(SPEC_A, cid, device_name="NVIDIA H200", arch="sm_90",
                        template_set_hash="tpl_aaaa", toolchain_key=tc, median_ms=1.25)
    assert res.action == "inserted"

    hit = db.lookup_winner(SPEC_A, "NVIDIA H200", "sm_90", "tpl_aaaa", tc)
    assert hit.status == "hit" and hit.hit
    assert hit.config == {"num_warps": 4, "num_stages": 2}
    assert (hit.config_name, hit.source_sha256, hit.median_ms) == (
        "bq64_bkv64_w4_s2", "1" * 64, 1.25)
    assert hit.stale_fields == ()

    # Another device kind (or another spec) is a miss, not stale.
    assert db.lookup_winner(SPEC_A, "NVIDIA H100", "sm_90", "tpl_aaaa", tc).status == "miss"
    assert db.lookup_winner(SPEC_A, "NVIDIA H200", "sm_100a", "tpl_aaaa", tc).status == "miss"
    assert db.lookup_winner(SPEC_B, "NVIDIA H200", "sm_90", "tpl_aaaa", tc).status == "miss"

    tpl = db.lookup_winner(SPEC_A, "NVIDIA H200", "sm_90", "tpl_bbbb", tc)
    assert tpl.status == "stale" and not tpl.hit
    assert (tpl.recorded_template_set_hash, tpl.current_template_set_hash) == (
        "tpl_aaaa", "tpl_bbbb")
    assert tpl.stale_fields == ("template_set_hash",)
    assert "template set tpl_aaaa, current tpl_bbbb" in tpl.message

    tool = db.lookup_winner(SPEC_A, "NVIDIA H200", "sm_90", "tpl_aaaa", "triton=3.7.0")
    assert tool.status == "stale"
    assert (tool.recorded_toolchain_key, tool.current_toolchain_key) == (tc, "triton=3.7.0")
    assert tool.stale_fields == ("toolchain_key",)
    assert "triton=3.7.0" in tool.message and tc in tool.message

    both = db.lookup_winner(SPEC_A, "NVIDIA H200", "sm_90", "tpl_bbbb", "triton=3.7.0")
    assert both.stale_fields == ("template_set_hash", "toolchain_key")
    db.close()


def test_set_winner_keeps_the_faster_unless_forced(tmp_path: Path) -> None:
    db = _db(tmp_path)
    fast, _ = _seed(db)
    slow = db.add_candidate(SPEC_A, "bq64_bkv64_w8_s3", {"num_warps": 8}, "2" * 64)
    where = {"device_name": "NVIDIA H200", "arch": "sm_90"}
    ident = {"template_set_hash": "tpl", "toolchain_key": "tc"}

    assert db.set_winner(SPEC_A, slow, **where, **ident, median_ms=2.0).action == "inserted"
    assert db.set_winner(SPEC_A, slow, **where, **ident, median_ms=2.0).action == "kept"
    res = db.set_winner(SPEC_A, fast, **where, **ident, median_ms=1.0)
    assert (res.action, res.previous_ms) == ("replaced", 2.0)
    assert db.set_winner(SPEC_A, slow, **where, **ident, median_ms=2.0).action == "kept"
    assert db.lookup_winner(SPEC_A, **where, **ident).config_name == "bq64_bkv64_w4_s2"
    assert db.set_winner(SPEC_A, slow, **where, **ident, median_ms=2.0,
                         force=True).action == "replaced"
    assert db.lookup_winner(SPEC_A, **where, **ident).config_name == "bq64_bkv64_w8_s3"
    # A winner measured under the current templates replaces a stale one even when slower:
    # the old time is not comparable, and the old winner would only ever be reported stale.
    res = db.set_winner(SPEC_A, fast, **where, template_set_hash="tpl2", toolchain_key="tc",
                        median_ms=3.0)
    assert res.action == "replaced"
    assert db.lookup_winner(SPEC_A, **where, template_set_hash="tpl2",
                            toolchain_key="tc").status == "hit"

    db.upsert_workload(SPEC_B, {"encoding": "mask"})
    with pytest.raises(ValueError, match="not a candidate"):
        db.set_winner(SPEC_B, fast, **where, **ident, median_ms=0.1)
    db.close()


def test_toolchain_key_has_one_definition_without_sqlalchemy() -> None:
    """The key winners are stored under comes from one pure module, importable without
    SQLAlchemy (tilegen.winners needs it there); tilegen.db re-exports the same function."""
    import triton

    import tilegen.db
    from tilegen import winners
    from tilegen.tune import toolchain

    assert tilegen.db.toolchain_key is toolchain.toolchain_key
    assert tilegen.db.TOOLCHAIN_FIELDS == toolchain.TOOLCHAIN_FIELDS == ("triton",)
    # nvcc and clang are environment fields, not part of the key (Triton brings its own ptxas)
    assert toolchain.toolchain_key({**H200, "clang": "18.1.0"}) == "triton=3.6.0"
    assert toolchain.toolchain_key({"device_name": "x"}) == "none"
    assert toolchain.current_toolchain_key() == f"triton={triton.__version__}"
    assert winners.current_toolchain_key() == toolchain.current_toolchain_key()
    script = textwrap.dedent("""
        import sys
        sys.modules["sqlalchemy"] = None  # import sqlalchemy -> ImportError
        from tilegen.tune.toolchain import current_toolchain_key, toolchain_key
        assert "tilegen.db" not in sys.modules
        print(toolchain_key({"triton": "3.6.0", "nvcc": "12.8"}), current_toolchain_key())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["triton=3.6.0", f"triton={triton.__version__}"]


def _winner_export(tmp_path: Path, name: str, *, tpl: str, ms: float,
                   recorded_at: Any) -> dict[str, Any]:
    """An export whose only winner (of SPEC_A on the H200) has this identity, time and date."""
    with _db(tmp_path, name) as db:
        db.upsert_workload(SPEC_A, {"encoding": "lut", "head_dim": 128})
        cid = db.add_candidate(SPEC_A, f"cfg_{tpl}", {"tpl": tpl}, tpl.ljust(64, "0"))
        db.set_winner(SPEC_A, cid, device_name="NVIDIA H200", arch="sm_90",
                      template_set_hash=tpl, toolchain_key="triton=3.6.0", median_ms=ms,
                      recorded_at=recorded_at)
        return db.export_dict()


def test_import_never_replaces_a_current_winner_with_a_stale_one(tmp_path: Path) -> None:
    """Times under different template sets (or toolchains) are not comparable: an import
    keeps the winner recorded later, whichever is faster (unless force)."""
    now = utcnow()
    old_fast = _winner_export(tmp_path, "old.sqlite", tpl="OLD", ms=9.0,
                              recorded_at=now - timedelta(days=30))
    new_slow = _winner_export(tmp_path, "new.sqlite", tpl="NEW", ms=10.0, recorded_at=now)
    where = ("NVIDIA H200", "sm_90")

    # Local winner under NEW (10 ms); the file's OLD one is faster (9 ms) but older: kept.
    with _db(tmp_path, "local_new.sqlite") as db:
        db.import_json(new_slow)
        rep = db.import_json(old_fast)
        assert (rep.winners_kept, rep.winners_replaced, rep.changed) == (1, 0, True)
        (note,) = rep.notes
        assert note.startswith("kept local winner") and "recorded later" in note
        assert "template set NEW" in note and "template set OLD" in note
        hit = db.lookup_winner(SPEC_A, *where, "NEW", "triton=3.6.0")
        assert hit.status == "hit" and hit.median_ms == 10.0 and hit.config == {"tpl": "NEW"}
        # force takes the file's winner all the same
        rep = db.import_json(old_fast, force=True)
        assert rep.winners_replaced == 1 and "--force" in rep.notes[0]
        assert db.lookup_winner(SPEC_A, *where, "NEW", "triton=3.6.0").status == "stale"

    # The other direction: local OLD (9 ms), import NEW (10 ms, recorded later): replaced.
    with _db(tmp_path, "local_old.sqlite") as db:
        db.import_json(old_fast)
        rep = db.import_json(new_slow)
        assert (rep.winners_kept, rep.winners_replaced) == (0, 1)
        (note,) = rep.notes
        assert note.startswith("replaced local winner") and "imported one was recorded later" \
            in note
        hit = db.lookup_winner(SPEC_A, *where, "NEW", "triton=3.6.0")
        assert hit.status == "hit" and hit.median_ms == 10.0
        again = db.import_json(new_slow)  # the same winner again: no change, no note
        assert not again.changed and again.notes == []

    # Another toolchain is the same rule; a tie on recorded_at keeps the local winner.
    other_tool = json.loads(json.dumps(old_fast))
    other_tool["winners"][0].update(template_set_hash="NEW", toolchain_key="triton=9.9.9",
                                    recorded_at=new_slow["winners"][0]["recorded_at"])
    with _db(tmp_path, "tie.sqlite") as db:
        db.import_json(new_slow)
        rep = db.import_json(other_tool)
        assert rep.winners_kept == 1 and "recorded at the same time" in rep.notes[0]
        assert db.lookup_winner(SPEC_A, *where, "NEW", "triton=3.6.0").status == "hit"
        other_tool["winners"][0]["recorded_at"] = _later(new_slow["winners"][0]["recorded_at"])
        assert db.import_json(other_tool).winners_replaced == 1
        assert db.lookup_winner(SPEC_A, *where, "NEW", "triton=9.9.9").status == "hit"


def _later(stamp: str) -> str:
    from datetime import datetime

    return (datetime.fromisoformat(stamp) + timedelta(seconds=1)).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ")


def test_list_and_show(tmp_path: Path) -> None:
    db = _db(tmp_path)
    cid, eid = _seed(db)
    db.upsert_workload(SPEC_B, {"encoding": "mask"})
    for i, (status, ms) in enumerate([("pass", 3.0), ("pass", 1.0), ("fail_correctness", 0.5),
                                      ("compile_error", None), ("pass", 2.0)]):
        db.record_trial("s", i, cid, eid, status, median_ms=ms)
    db.set_winner(SPEC_A, cid, device_name="NVIDIA H200", arch="sm_90",
                  template_set_hash="tpl", toolchain_key="tc", median_ms=1.0)

    infos = db.list_workloads()
    assert [w.spec_hash for w in infos] == [SPEC_A, SPEC_B]
    assert (infos[0].n_candidates, infos[0].n_trials, infos[0].n_winners) == (1, 5, 1)
    assert (infos[1].n_candidates, infos[1].n_trials, infos[1].n_winners) == (0, 0, 0)

    detail = db.show(SPEC_A, best=2)
    assert detail.workload.spec == {"encoding": "lut", "head_dim": 128}
    assert [t.median_ms for t in detail.best_trials] == [1.0, 2.0]  # failed 0.5 never counts
    assert detail.best_trials[0].env_key == env_key(H200)
    assert detail.status_counts == {"compile_error": 1, "fail_correctness": 1, "pass": 3}
    assert [w.config_name for w in detail.winners] == ["bq64_bkv64_w4_s2"]
    with pytest.raises(KeyError):
        db.show("c" * 64)
    db.close()


# --------------------------------------------------------------------------- export / import


def _populate(db: TuningDB) -> None:
    """Two workloads, two environments, trials and winners, inserted out of sorted order."""
    h100 = {**H200, "device_name": "NVIDIA H100", "driver": "550.1"}
    for spec_hash, enc in ((SPEC_B, "mask"), (SPEC_A, "lut")):
        db.upsert_workload(spec_hash, {"encoding": enc, "head_dim": 128})
    envs = [db.upsert_environment(h100), db.upsert_environment(H200)]
    number = 0
    for spec_hash in (SPEC_B, SPEC_A):
        cands = [db.add_candidate(spec_hash, f"w{w}", {"num_warps": w}, f"{w}" * 64)
                 for w in (8, 4, 2)]
        for eid in envs:
            for cid, ms in zip(cands, (1.5, 1.125, None), strict=True):
                status = "pass" if ms is not None else "out_of_resources"
                db.record_trial("study-" + spec_hash[:1], number, cid, eid, status,
                                median_ms=ms, tflops=None if ms is None else 100.0 / ms,
                                scores={"cap0": {"min_head_cos": float("nan")}},
                                error_class=None if ms else "OutOfResources",
                                error_text=None if ms else "shared memory 300000 > 232448")
                number += 1
        db.set_winner(spec_hash, cands[1], device_name="NVIDIA H200", arch="sm_90",
                      template_set_hash="tpl", toolchain_key=toolchain_key(H200),
                      median_ms=1.125)
        db.set_winner(spec_hash, cands[0], device_name="NVIDIA H100", arch="sm_90",
                      template_set_hash="tpl", toolchain_key=toolchain_key(H200),
                      median_ms=1.5)


def test_export_import_round_trip(tmp_path: Path) -> None:
    src = _db(tmp_path, "src.sqlite")
    _populate(src)
    for include_trials in (False, True):
        text = src.export_json(tmp_path / "export.json", include_trials=include_trials)
        assert (tmp_path / "export.json").read_text() == text
        doc = json.loads(text)
        assert doc["schema_version"] == SCHEMA_VERSION
        assert ("trials" in doc) == include_trials
        # Reviewable: indented, sorted keys, rows sorted by their natural keys.
        assert text == json.dumps(doc, indent=2, sort_keys=True) + "\n"
        assert [w["spec_hash"] for w in doc["workloads"]] == [SPEC_A, SPEC_B]
        assert [(c["spec_hash"], c["config_name"]) for c in doc["candidates"]] == [
            (h, n) for h in (SPEC_A, SPEC_B) for n in ("w2", "w4", "w8")]
        assert [(w["spec_hash"], w["device_name"]) for w in doc["winners"]] == [
            (h, d) for h in (SPEC_A, SPEC_B) for d in ("NVIDIA H100", "NVIDIA H200")]

        dst = _db(tmp_path, f"dst{include_trials}.sqlite")
        rep = dst.import_json(tmp_path / "export.json")
        assert rep.changed and rep.winners_inserted == 4
        assert rep.trials_added == (12 if include_trials else 0)
        assert dst.export_json(include_trials=include_trials) == text
        # Re-import is a no-op.
        again = dst.import_json(tmp_path / "export.json")
        assert not again.changed and again.winners_kept == 4
        assert again.trials_skipped == (12 if include_trials else 0)
        assert dst.export_json(include_trials=include_trials) == text
        dst.close()
    # The imported winners are usable.
    dst = TuningDB.open(tmp_path / "dstTrue.sqlite")
    hit = dst.lookup_winner(SPEC_A, "NVIDIA H200", "sm_90", "tpl", toolchain_key(H200))
    assert hit.status == "hit" and hit.config == {"num_warps": 4}
    dst.close()
    src.close()


def test_export_one_spec(tmp_path: Path) -> None:
    db = _db(tmp_path)
    _populate(db)
    doc = json.loads(db.export_json(spec_hash=SPEC_A, include_trials=True))
    assert [w["spec_hash"] for w in doc["workloads"]] == [SPEC_A]
    assert {c["spec_hash"] for c in doc["candidates"]} == {SPEC_A}
    assert {t["spec_hash"] for t in doc["trials"]} == {SPEC_A}
    assert len(doc["environments"]) == 2
    with pytest.raises(KeyError):
        db.export_json(spec_hash="c" * 64)
    db.close()


def test_import_winner_conflicts(tmp_path: Path) -> None:
    theirs = _db(tmp_path, "theirs.sqlite")
    cid, _ = _seed(theirs)
    theirs.set_winner(SPEC_A, cid, device_name="NVIDIA H200", arch="sm_90",
                      template_set_hash="tpl", toolchain_key="tc", median_ms=2.0)
    export = json.loads(theirs.export_json())

    ours = _db(tmp_path, "ours.sqlite")
    ours.upsert_workload(SPEC_A, {"encoding": "lut", "head_dim": 128})
    mine = ours.add_candidate(SPEC_A, "mine", {"num_warps": 8}, "9" * 64)
    ours.set_winner(SPEC_A, mine, device_name="NVIDIA H200", arch="sm_90",
                    template_set_hash="tpl", toolchain_key="tc", median_ms=1.0)

    rep = ours.import_json(export)  # theirs is slower: ours stays
    assert (rep.winners_kept, rep.winners_replaced, rep.candidates_added) == (1, 0, 1)
    assert rep.notes and "kept local winner" in rep.notes[0]
    lookup = ours.lookup_winner(SPEC_A, "NVIDIA H200", "sm_90", "tpl", "tc")
    assert lookup.config_name == "mine"
    rep = ours.import_json(export, force=True)
    assert rep.winners_replaced == 1
    assert ours.lookup_winner(SPEC_A, "NVIDIA H200", "sm_90", "tpl", "tc").median_ms == 2.0

    # The other way round: a faster imported winner replaces ours without force.
    faster = json.loads(json.dumps(export))
    faster["winners"][0]["median_ms"] = 0.5
    assert ours.import_json(faster).winners_replaced == 1

    conflicting = json.loads(json.dumps(export))
    conflicting["workloads"][0]["spec"] = {"encoding": "mask"}
    with pytest.raises(ConflictError):
        ours.import_json(conflicting)
    with pytest.raises(ValueError, match="format"):
        ours.import_json({"format": "something-else"})
    with pytest.raises(ValueError, match="schema version"):
        ours.import_json({**export, "schema_version": SCHEMA_VERSION + 1})
    theirs.close()
    ours.close()


# --------------------------------------------------------------------------- schema version


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
        doc = json.loads(both)
        assert [(w["spec_hash"], w["device_name"]) for w in doc["winners"]] == [
            (h, d) for h in (SPEC_A, SPEC_B) for d in ("NVIDIA H100", "NVIDIA H200")]
        assert both == db.export_json()  # the union is the export of both specs, sorted
        # Exporting A again is idempotent: same bytes, nothing changed.
        rep = merge_export_file(dest, doc_a)
        assert rep is not None and not rep.changed and rep.notes == []
        assert dest.read_text() == both

        # A file exported with trials keeps them (doc_a brings none).
        with_trials = tmp_path / "with_trials.json"
        b_trials = json.loads(db.export_json(with_trials, spec_hash=SPEC_B,
                                             include_trials=True))["trials"]
        merge_export_file(with_trials, doc_a)
        doc = json.loads(with_trials.read_text())
        assert doc["trials"] == b_trials and len(b_trials) == 6
        assert [w["spec_hash"] for w in doc["workloads"]] == [SPEC_A, SPEC_B]

    # Winner conflicts follow import_json: a stale (older) winner does not replace the file's.
    now = utcnow()
    current = _winner_export(tmp_path, "cur.sqlite", tpl="NEW", ms=10.0, recorded_at=now)
    stale = _winner_export(tmp_path, "stale.sqlite", tpl="OLD", ms=9.0,
                           recorded_at=now - timedelta(days=1))
    merged = tmp_path / "merged.json"
    merge_export_file(merged, current)
    rep = merge_export_file(merged, stale)
    assert rep is not None and rep.winners_kept == 1 and "kept local winner" in rep.notes[0]
    (w,) = json.loads(merged.read_text())["winners"]
    assert (w["template_set_hash"], w["median_ms"]) == ("NEW", 10.0)

    # A file that is not an export is an error naming it, and is left alone.
    for junk in ("not json", '{"format": "something-else"}'):
        bad = tmp_path / "bad.json"
        bad.write_text(junk)
        with pytest.raises(ValueError, match=f"cannot merge into {bad}"):
            merge_export_file(bad, current)
        assert bad.read_text() == junk


def test_export_writes_through_the_shared_atomic_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One atomic writer for tilegen (tilegen.cache.atomic_write), not a copy in the DB."""
    import tilegen.cache
    from tilegen.db import store

    assert store.atomic_write is tilegen.cache.atomic_write
    calls: list[Path] = []

    def spy(path: Path, data: str | bytes) -> Path:
        calls.append(path)
        return tilegen.cache.atomic_write(path, data)

    monkeypatch.setattr(store, "atomic_write", spy)
    with _db(tmp_path) as db:
        _populate(db)
        text = db.export_json(tmp_path / "out" / "x.json")
    assert calls == [tmp_path / "out" / "x.json"]
    assert (tmp_path / "out" / "x.json").read_text() == text
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["x.json"]  # no temp file left


def _set_stored_version(path: Path, version: int) -> None:
    # Plain sqlite3, as another (older or newer) tilegen would have left the file.
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE schema_version SET version = ? WHERE id = 1", (version,))
    conn.close()


def test_newer_db_than_code_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite"
    TuningDB.open(path).close()
    _set_stored_version(path, SCHEMA_VERSION + 1)
    with pytest.raises(SchemaVersionError) as err:
        TuningDB.open(path)
    msg = str(err.value)
    assert f"schema version {SCHEMA_VERSION + 1}" in msg
    assert f"version {SCHEMA_VERSION} that this tilegen understands" in msg
    assert str(path) in msg


def test_older_db_is_migrated_at_open(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite"
    with TuningDB.open(path) as db:
        cid, eid = _seed(db)
        db.record_trial("s", 0, cid, eid, "pass", median_ms=1.0)
    _set_stored_version(path, SCHEMA_VERSION - 1)  # pretend an older tilegen wrote it

    # No step known for that version: a clear error, and the file is left as it was.
    with pytest.raises(SchemaVersionError, match=f"schema version {SCHEMA_VERSION - 1}"):
        TuningDB.open(path)

    ran: list[int] = []

    def add_note_column(conn: Any) -> None:
        ran.append(1)
        conn.exec_driver_sql("ALTER TABLE trials ADD COLUMN note TEXT")

    with TuningDB.open(path, migrations=[(SCHEMA_VERSION, add_note_column)]) as db:
        assert ran == [1]
        assert db.schema_version() == SCHEMA_VERSION
        with db.session() as s:
            cols = {c["name"] for c in inspect(s.connection()).get_columns("trials")}
        assert "note" in cols
        assert db.show(SPEC_A).workload.n_trials == 1  # data survived
    # Already at the current version: the step does not run again.
    with TuningDB.open(path, migrations=[(SCHEMA_VERSION, add_note_column)]):
        assert ran == [1]


def test_failed_migration_leaves_the_file_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "t.sqlite"
    TuningDB.open(path).close()
    _set_stored_version(path, SCHEMA_VERSION - 1)

    def half_done(conn: Any) -> None:
        conn.exec_driver_sql("ALTER TABLE trials ADD COLUMN note TEXT")
        raise RuntimeError("step failed midway")

    with pytest.raises(RuntimeError, match="midway"):
        TuningDB.open(path, migrations=[(SCHEMA_VERSION, half_done)])
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone() == (
            SCHEMA_VERSION - 1,)
        cols = {row[1] for row in conn.execute("PRAGMA table_info(trials)")}
    conn.close()
    assert "note" not in cols


def test_next_schema_change_is_append_a_function(tmp_path: Path) -> None:
    """What version 2 will look like: one more (version, step) pair, applied in order."""
    path = tmp_path / "t.sqlite"
    db = TuningDB.open(path)

    def v2(conn: Any) -> None:
        conn.exec_driver_sql("ALTER TABLE trials ADD COLUMN peak_mem_mb REAL")

    def v3(conn: Any) -> None:
        conn.exec_driver_sql("CREATE INDEX ix_trials_peak_mem_mb ON trials (peak_mem_mb)")

    target = SCHEMA_VERSION + 2
    steps = [(SCHEMA_VERSION + 1, v2), (target, v3)]
    with db.session(write=True) as s:
        assert upgrade(s.connection(), target=target, migrations=steps) == [
            SCHEMA_VERSION + 1, target]
    assert db.schema_version() == target
    with db.session(write=True) as s:
        assert upgrade(s.connection(), target=target, migrations=steps) == []
    with db.session(write=True) as s, pytest.raises(ValueError, match="increasing"):
        upgrade(s.connection(), target=target, migrations=list(reversed(steps)))
    db.close()
    # This code is still at SCHEMA_VERSION, so the upgraded file is now "newer".
    with pytest.raises(SchemaVersionError):
        TuningDB.open(path)


def test_import_prefers_the_winner_matching_the_current_templates(tmp_path):
    """An export tuned later on an older checkout must not replace the winner that matches
    this checkout's templates (tilegen.load would only report it stale)."""
    from datetime import UTC, datetime

    def make(path, tpl, ms, when):
        db = TuningDB.open(path)
        db.upsert_workload("a" * 64, {"head_dim": 128})
        cid = db.add_candidate("a" * 64, f"cfg_{tpl}", {"block_m": 64}, "s" * 64)
        db.set_winner("a" * 64, cid, device_name="NVIDIA H200", arch="sm_90",
                      template_set_hash=tpl, toolchain_key="triton=3.6.0", median_ms=ms,
                      recorded_at=when)
        return db

    local = make(tmp_path / "local.sqlite", "NEW", 10.0, datetime(2026, 1, 1, tzinfo=UTC))
    other = make(tmp_path / "other.sqlite", "OLD", 9.0, datetime(2026, 6, 1, tzinfo=UTC))
    doc = other.export_dict()
    rep = local.import_json(doc, current=("NEW", "triton=3.6.0"))
    assert local.lookup_winner("a" * 64, "NVIDIA H200", "sm_90", "NEW", "triton=3.6.0").hit
    assert any("matches this checkout" in n for n in rep.notes)
    # without knowing the current identity, the later recording wins (documented fallback)
    local.import_json(doc)
    assert local.lookup_winner("a" * 64, "NVIDIA H200", "sm_90", "NEW",
                               "triton=3.6.0").status == "stale"
    local.close()
    other.close()
