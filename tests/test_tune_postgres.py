"""Two "hosts" tune one study through a real PostgreSQL server (`--storage postgresql://...`).

`.ci/run` installs and starts a local PostgreSQL 15 and sets TILEGEN_TEST_POSTGRES_URL; without
that variable these tests are skipped with that reason. Each process has its own tilegen DB, as
separate hosts would; they share only the Optuna study, which is the trial log: the budget
(Optuna's MaxTrialsCallback over COMPLETE + PRUNED trials) is study-wide.
"""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TINY_TOML = 'grid = [4, 4, 8]\nnum_heads = 2\nhead_dim = 64\ntopk = 2\ndtype = "bf16"\n'

URL = os.environ.get("TILEGEN_TEST_POSTGRES_URL")
pytestmark = pytest.mark.skipif(
    not URL, reason="TILEGEN_TEST_POSTGRES_URL is unset (.ci/run starts a PostgreSQL server)")


def _drop_database(name: str, patience_s: float = 120.0) -> None:
    """DROP ... WITH (FORCE) ends the test role's own sessions, but not a server process of
    another role: an autovacuum worker that happens to be analyzing the fresh tables makes it
    fail with InsufficientPrivilege (session 40's CI). Such a worker finishes on its own, so
    the drop is tried again until it goes through."""
    import psycopg

    deadline = time.monotonic() + patience_s
    with psycopg.connect(URL, autocommit=True) as conn:
        while True:
            try:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
                return
            except (psycopg.errors.InsufficientPrivilege, psycopg.errors.ObjectInUse):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)


@pytest.fixture
def fresh_db() -> str:
    """A new, empty database per test (the role needs CREATEDB): hosts then also race to
    create Optuna's tables, as on a first run."""
    import psycopg

    name = f"tilegen_{uuid.uuid4().hex[:10]}"
    base, _, _db = URL.rpartition("/")
    with psycopg.connect(URL, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield f"{base}/{name}"
    _drop_database(name)


def _host_env(tmp: Path, host: str) -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1",
               TILEGEN_DB=str(tmp / f"{host}.sqlite"),
               TILEGEN_CACHE_DIR=str(tmp / f"cache-{host}"))
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_two_hosts_share_one_study(tmp_path: Path, fresh_db: str) -> None:
    import optuna

    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    study = f"pg-{uuid.uuid4().hex[:12]}"
    trials = 10
    procs = []
    for host in ("host-a", "host-b"):
        cmd = [sys.executable, "-m", "tilegen.tune.cli", "tune", "--spec",
               str(tmp_path / "tiny.toml"), "--target", "sm_90", "--timer",
               "fake-deterministic", "--timeout", "120", "--trials", str(trials),
               "--sampler", "tpe", "--storage", fresh_db, "--study", study,
               "--summary", str(tmp_path / f"{host}.json")]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_host_env(tmp_path, host),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]

    loaded = optuna.load_study(study_name=study, storage=fresh_db)
    # nothing left running (a seed or explore trial queued as the budget ran out may stay
    # WAITING: a later session of the study takes it first)
    assert not [t for t in loaded.trials if t.state.name == "RUNNING"]
    counted = [t for t in loaded.trials if t.state.name in ("COMPLETE", "PRUNED")]
    # hosts racing for the last trial may overshoot by at most one trial per extra host
    assert trials <= len(counted) <= trials + 1
    measured = [t for t in counted if t.user_attrs.get("duplicate_of") is None]
    names = [t.user_attrs["config"] for t in measured]
    assert len(set(names)) == len(names)  # no config measured twice across the hosts
    assert len({t.user_attrs["pid"] for t in measured}) == 2  # both hosts did work
    summaries = [json.loads((tmp_path / f"{h}.json").read_text()) for h in ("host-a", "host-b")]
    assert {s["study"] for s in summaries} == {study}
    assert all(s["storage"].startswith("postgresql") for s in summaries)
    # the default trial is a seed for each host, but only one of them measures it
    assert names.count("bm64_bn64_w4_s3_lse") == 1


def test_resume_from_postgres_runs_nothing_new(tmp_path: Path) -> None:
    import optuna

    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    study = f"pg-{uuid.uuid4().hex[:12]}"
    cmd = [sys.executable, "-m", "tilegen.tune.cli", "tune", "--spec",
           str(tmp_path / "tiny.toml"), "--target", "sm_90", "--timer", "fake-deterministic",
           "--trials", "4", "--sampler", "tpe", "--storage", URL, "--study", study]
    env = _host_env(tmp_path, "h")
    for _ in range(2):
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
    loaded = optuna.load_study(study_name=study, storage=URL)
    counted = [t for t in loaded.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(counted) == 4  # the second run found the budget spent and ran nothing
