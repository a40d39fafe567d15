"""Issue 12: a tuning DB on a read-only filesystem (a real read-only mount).

Read-only commands (``db list``, ``db show``, ``db export``) and the winner lookup of
``tilegen.load`` open the DB read-only (SQLite ``mode=ro``, falling back to ``immutable=1``: a
WAL file on a read-only mount cannot create its ``-shm``) and work; writing commands (``db
import``, ``tune``) say the DB is read-only and where, and exit 2.

The test mounts a tmpfs itself and remounts it read-only, which needs root with
CAP_SYS_ADMIN (``.ci/run`` runs as root). Elsewhere it is skipped with the reason; root ignores
file modes, so ``chmod`` cannot stand in for a read-only mount.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tilegen import backends, winners
from tilegen.cli import main
from tilegen.config import KernelConfig
from tilegen.db import TuningDB
from tilegen.spec import Spec
from tilegen.targets import get_target

TINY = Spec(grid=(4, 4, 8), num_heads=2, head_dim=64, topk=2)
TINY_TOML = 'grid = [4, 4, 8]\nnum_heads = 2\nhead_dim = 64\ntopk = 2\ndtype = "bf16"\n'
TUNED = KernelConfig(block_m=32, block_n=64, num_warps=4, num_stages=2)


def _sh(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def ro_mount(tmp_path: Path) -> Iterator[tuple[Path, callable]]:
    """A fresh tmpfs at tmp_path/mnt; call the second item to remount it read-only."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only filesystem needs root (CAP_SYS_ADMIN); .ci/run "
                    "runs this test as root")
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) on this machine")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = _sh("mount", "-t", "tmpfs", "-o", "size=16m", "tilegen-ro-test", str(mnt))
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (no CAP_SYS_ADMIN in this container?): "
                    f"{res.stderr.strip()}")

    def make_readonly() -> None:
        res = _sh("mount", "-o", "remount,ro", str(mnt))
        assert res.returncode == 0, res.stderr
        assert os.statvfs(mnt).f_flag & os.ST_RDONLY

    try:
        yield mnt, make_readonly
    finally:
        _sh("umount", "-l", str(mnt))


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_db_on_a_read_only_mount(ro_mount, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    mnt, make_readonly = ro_mount
    path = mnt / "tuning.sqlite"
    target = get_target("sm_90")
    key = backends.get("triton").variant_key(TINY, TUNED, target).to_dict()
    with TuningDB.open(path) as db:  # a WAL DB, closed cleanly: no -wal / -shm left
        db.upsert_workload(TINY.hash, TINY.kernel_hash, TINY.to_dict())
        cid = db.add_candidate(key, TUNED.to_dict())
        db.set_winner(TINY.hash, cid, device_name="cpu", median_ms=1.25, timer="do_bench")
    export = tmp_path / "import.json"
    with TuningDB.open(path, readonly=True) as src, TuningDB.open(tmp_path / "o.sqlite") as db:
        db.import_json(json.loads(src.export_json()))
        db.export_json(export)
    make_readonly()
    before = _snapshot(mnt)
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    monkeypatch.setenv("TILEGEN_DB", str(path))

    # read-only commands work
    assert main(["db", "list"]) == 0
    out = capsys.readouterr().out
    assert f"tuning DB {path} (read-only)" in out and TINY.hash[:12] in out
    assert main(["db", "show", TINY.hash[:8]]) == 0
    assert TUNED.name in capsys.readouterr().out
    assert main(["db", "export", "--out", str(tmp_path / "out.json")]) == 0
    capsys.readouterr()
    (w,) = json.loads((tmp_path / "out.json").read_text())["winners"]
    assert w["variant"] == key

    # the winner lookup of tilegen.load uses it
    monkeypatch.setattr(winners, "_logged", set())
    monkeypatch.setattr(winners, "SHIPPED_DIR", tmp_path / "no-shipped")
    res = winners.find_winner(TINY, target)
    assert res.hit and res.config == TUNED and res.source == f"db:{path}"

    # writing commands say it is read-only, and where
    for argv in (["db", "import", str(export)],
                 ["tune", "--spec", str(tmp_path / "tiny.toml"), "--target", "sm_90",
                  "--timer", "fake-deterministic", "--trials", "1"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"tuning DB {path}: is read-only (read-only file system)" in err
    assert _snapshot(mnt) == before
