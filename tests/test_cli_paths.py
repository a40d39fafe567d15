"""Issue 23: a path mistake on the command line is one line naming the user's path, exit 2.

The table drives every path option of every command through the mistakes a user makes: a
directory where a file is wanted, a file where a directory is wanted, a path under a regular
file, a place that cannot be written (/proc: the tests run as root, so permission bits would
not stop a write) and a missing file to read. Each must stop the command before any work
(compile, synthesis, tuning worker) with exactly one line on stderr, exit status 2 and no
traceback. Then: atomic writes name the user's path, never their temp file; a refused
``tilegen tune`` creates no DB file; ``db list`` / ``db show`` show the shipped winners;
``captures synthesize`` says how much it writes; ``triton_bwd`` is not offered to users.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tilegen import pathcheck
from tilegen.cli import main
from tilegen.spec import Spec

TINY = Spec(grid=(4, 4, 8), num_heads=2, head_dim=64, topk=2)

# What each kind of mistake must say, by the role of the option. Kinds: "dir" (an existing
# directory), "file" (an existing regular file), "under" (a path below that file), "proc" (a
# place no file can be created in), "missing" (nothing there).
SAYS = {
    "in": {"dir": "is a directory, not a file", "under": "f.txt is a file, not a directory",
           "missing": "does not exist"},
    "in-dir": {"file": "is a file, not a directory", "under": "f.txt is a file, not a directory",
               "missing": "does not exist", "dir": "holds no capture .pt files"},
    "out": {"dir": "is a directory", "under": "f.txt is a file, not a directory",
            "proc": "cannot be written"},
    "out-dir": {"file": "is a file, not a directory", "under": "f.txt is a file, not a directory",
                "proc": "cannot be created"},
    "db-write": {"dir": "is a directory", "under": "f.txt is a file, not a directory",
                 "proc": "is read-only"},
    "db-read": {"dir": "is a directory", "under": "f.txt is a file, not a directory"},
}

SPEC = ["--spec", "{tmp}/tiny.toml"]
TUNE = ["tune", *SPEC, "--target", "sm_90", "--timer", "fake-deterministic", "--trials", "1"]

# (command, option, argv with {bad} for the mistaken path, role, name of the path)
OPTIONS = [
    ("build", "--spec", ["build", "--target", "sm_90", "--spec", "{bad}"], "in", "s.toml"),
    ("build", "--out", ["build", "--target", "sm_90", "--out", "{bad}"], "out-dir", "out"),
    ("build", "--config", ["build", "--target", "sm_90", "--config", "{bad}"], "in", "c.json"),
    ("captures", "--out", ["captures", "synthesize", "--out", "{bad}"], "out-dir", "caps"),
    ("captures", "--spec", ["captures", "synthesize", "--out", "{tmp}/caps", "--spec", "{bad}"],
     "in", "s.toml"),
    ("bench", "--spec", ["bench", "--spec", "{bad}"], "in", "s.toml"),
    ("bench", "--captures", ["bench", "--captures", "{bad}"], "in-dir", "caps"),
    ("bench", "--json", ["bench", "--json", "{bad}"], "out", "r.json"),
    ("bench", "--plot", ["bench", "--plot", "{bad}"], "out", "r.png"),
    ("bench", "--config", ["bench", "--config", "{bad}"], "in", "c.json"),
    ("tune", "--spec", ["tune", "--spec", "{bad}"], "in", "s.toml"),
    ("tune", "--captures", [*TUNE, "--captures", "{bad}"], "in-dir", "caps"),
    ("tune", "--db", [*TUNE, "--db", "{bad}"], "db-write", "t.sqlite"),
    ("tune", "TILEGEN_DB", TUNE, "db-write", "t.sqlite"),
    ("tune", "--storage", [*TUNE, "--storage", "sqlite:///{bad}"], "out", "o.sqlite"),
    ("tune", "--export", [*TUNE, "--export", "{bad}"], "out", "w.json"),
    ("tune", "--summary", [*TUNE, "--summary", "{bad}"], "out", "s.json"),
    ("tune", "--plot", [*TUNE, "--plot", "{bad}"], "out", "h.png"),
    ("db list", "--db", ["db", "list", "--db", "{bad}"], "db-read", "t.sqlite"),
    ("db list", "TILEGEN_DB", ["db", "list"], "db-read", "t.sqlite"),
    ("db show", "--db", ["db", "show", "abc", "--db", "{bad}"], "db-read", "t.sqlite"),
    ("db export", "--db", ["db", "export", "--db", "{bad}"], "db-read", "t.sqlite"),
    ("db export", "--out", ["db", "export", "--out", "{bad}"], "out", "x.json"),
    ("db import", "FILE", ["db", "import", "{bad}"], "in", "x.json"),
    ("db import", "--db", ["db", "import", "{tmp}/export.json", "--db", "{bad}"], "db-write",
     "t.sqlite"),
    ("db import", "TILEGEN_DB", ["db", "import", "{tmp}/export.json"], "db-write", "t.sqlite"),
    ("db migrate", "--db", ["db", "migrate", "--db", "{bad}"], "db-read", "t.sqlite"),
]

CASES = [pytest.param(argv, role, kind, name, option == "TILEGEN_DB",
                      id=f"{command} {option} {kind}")
         for command, option, argv, role, name in OPTIONS for kind in SAYS[role]]


def _bad_path(tmp: Path, kind: str, name: str) -> Path:
    return {"dir": tmp / "d", "file": tmp / "f.txt", "under": tmp / "f.txt" / name,
            "proc": Path("/proc") / f"tilegen-test-{name}", "missing": tmp / name}[kind]


@pytest.fixture
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with an empty directory d/, a regular file f.txt, a tiny spec, a real (empty)
    export to import, and a DB that commands read unless a case names another one."""
    from tilegen.db import TuningDB

    (tmp_path / "d").mkdir()
    (tmp_path / "f.txt").write_text("not a folder\n")
    (tmp_path / "tiny.toml").write_text(TINY.to_toml())
    with TuningDB.open(tmp_path / "good.sqlite") as db:
        db.export_json(tmp_path / "export.json")
    monkeypatch.setenv("TILEGEN_DB", str(tmp_path / "good.sqlite"))
    monkeypatch.chdir(tmp_path)  # bench's default bench_results.json lands here
    return tmp_path


@pytest.mark.parametrize(("argv", "role", "kind", "name", "via_env"), CASES)
def test_path_mistake_is_one_line_exit_2(place: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str], argv: list[str],
                                         role: str, kind: str, name: str,
                                         via_env: bool) -> None:
    bad = _bad_path(place, kind, name)
    if via_env:
        monkeypatch.setenv("TILEGEN_DB", str(bad))
    before = sorted(p.name for p in place.iterdir())
    code = main([a.format(bad=bad, tmp=place) for a in argv])
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (out, err)
    assert len(lines) == 1 and out == "", (out, err)
    assert str(bad) in lines[0] and SAYS[role][kind] in lines[0], lines[0]
    assert "Traceback" not in err and ".tmp" not in lines[0]
    if via_env and kind == "under":
        assert "TILEGEN_DB" in lines[0]  # not a bare "[Errno 17] File exists"
    assert sorted(p.name for p in place.iterdir()) == before  # nothing created, no probe left


def tilegen(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None
            ) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("tilegen")
    cmd = [exe] if exe else [sys.executable, "-m", "tilegen.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, cwd=cwd,
                          env=None if env is None else {**os.environ, **env})


@pytest.mark.parametrize(("args", "named", "says"), [
    (["build", "--target", "sm_90", "--out", "{tmp}/f.txt"], "{tmp}/f.txt",
     "is a file, not a directory"),
    (["db", "export", "--out", "/proc/x.json"], "/proc/x.json", "cannot be written"),
    (["db", "export", "--out", "{tmp}"], "{tmp}", "is a directory"),
    (["tune", "--spec", "{tmp}/d"], "{tmp}/d", "is a directory, not a file"),
], ids=["build --out file", "export --out /proc", "export --out dir", "tune --spec dir"])
def test_console_script_prints_one_line_before_any_work(tmp_path: Path, args: list[str],
                                                        named: str, says: str) -> None:
    """The installed script, end to end: `build --out FILE` used to fail with FileExistsError
    after compiling everything; now it stops at once."""
    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "d").mkdir()
    t0 = time.perf_counter()
    res = tilegen(*[a.format(tmp=tmp_path) for a in args],
                  env={"TILEGEN_DB": str(tmp_path / "db" / "t.sqlite")})
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count("\n") == 1 and res.stdout == "", res.stdout + res.stderr
    assert named.format(tmp=tmp_path) in res.stderr and says in res.stderr
    assert "Traceback" not in res.stderr and "compiling" not in res.stderr
    assert time.perf_counter() - t0 < 60  # no compile ran (a build takes minutes here)
    assert not (tmp_path / "db").exists()


def test_tilegen_db_under_a_regular_file_names_tilegen_db(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("x")
    bad = tmp_path / "f.txt" / "tuning.sqlite"
    for args in (["db", "import", str(tmp_path / "f.txt")], ["db", "list"],
                 ["tune", "--target", "sm_90", "--timer", "fake-deterministic"]):
        res = tilegen(*args, env={"TILEGEN_DB": str(bad)})
        assert res.returncode == 2, res.stderr
        (line,) = res.stderr.splitlines()
        assert str(bad) in line and "TILEGEN_DB" in line and "Errno" not in line, line


# --------------------------------------------------------------------------- the pieces


def test_checks_leave_nothing_behind_and_accept_good_paths(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "caps").mkdir()
    (tmp_path / "caps" / "a.pt").write_bytes(b"")
    assert pathcheck.writable_dir(tmp_path / "new" / "deeper", "--out") == (
        tmp_path / "new" / "deeper")
    assert pathcheck.writable_dir(tmp_path, "--out", staging=True) == tmp_path
    assert pathcheck.writable_file(tmp_path / "f.txt", "--json") == tmp_path / "f.txt"
    assert pathcheck.writable_file(tmp_path / "a" / "b.json", "--json")
    assert pathcheck.readable_file(tmp_path / "f.txt", "--spec") == tmp_path / "f.txt"
    assert pathcheck.capture_dir(tmp_path / "caps") == tmp_path / "caps"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["caps", "f.txt"]  # no probe, no dirs
    with pytest.raises(pathcheck.PathError, match="is not a regular file"):
        pathcheck.writable_file("/dev/null", "--json")  # would be replaced by a plain file
    assert pathcheck.sqlite_url_file("sqlite:////abs/o.sqlite") == Path("/abs/o.sqlite")
    assert pathcheck.sqlite_url_file("sqlite:///rel.db?timeout=3") == Path("rel.db")
    assert pathcheck.sqlite_url_file("postgresql://h/db") is None


@pytest.mark.parametrize(("dest", "says"), [
    ("/proc/x.json", "no file can be created in /proc"),
    ("{tmp}", "it is a directory"),
    ("{tmp}/f.txt/x.json", "f.txt is a file, not a directory"),
])
def test_atomic_writes_name_the_users_path_not_the_temp_file(tmp_path: Path, dest: str,
                                                             says: str) -> None:
    from tilegen.cache import atomic_write
    from tilegen.db.exchange import write_export

    (tmp_path / "f.txt").write_text("x")
    path = dest.format(tmp=tmp_path)
    for write in (lambda: atomic_write(Path(path), "{}"), lambda: write_export({}, path)):
        with pytest.raises(OSError) as err:
            write()
        msg = str(err.value)
        assert isinstance(err.value, pathcheck.PathError)
        assert path in msg and says in msg and ".tmp" not in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]  # no temp file left


def test_spec_from_file_raises_value_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "f.txt").write_text("x")
    for path in (tmp_path / "dir.toml", tmp_path / "f.txt" / "s.toml"):
        with pytest.raises(ValueError) as err:
            Spec.from_file(path)
        assert str(path) in str(err.value)
    with pytest.raises(FileNotFoundError):  # as documented: a missing file stays this
        Spec.from_file(tmp_path / "missing.toml")


def test_a_refused_tune_creates_no_db_file(tmp_path: Path) -> None:
    """On a CPU the do_bench timer is refused at worker setup; the DB (and its folder) must
    not exist afterwards, and `db list` says there is none."""
    (tmp_path / "tiny.toml").write_text(TINY.to_toml())
    db = tmp_path / "cache" / "tilegen" / "tuning.sqlite"
    env = {"TILEGEN_DB": str(db)}
    res = tilegen("tune", "--spec", str(tmp_path / "tiny.toml"), "--trials", "2", "--target",
                  "sm_90", env=env, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "needs a GPU" in res.stderr or "no GPU" in res.stderr, res.stderr
    assert not (tmp_path / "cache").exists() and not list(tmp_path.glob("*.sqlite"))
    res = tilegen("db", "list", env=env, cwd=tmp_path)
    assert res.returncode == 0 and f"no tuning DB at {db}" in res.stdout


# --------------------------------------------------------------------------- shipped winners


def _db_with_winner(path: Path, spec: Spec, config: str) -> None:
    from tilegen.db import TuningDB
    from tilegen.identity import VariantKey

    with TuningDB.open(path) as db:
        db.upsert_workload(spec.hash, spec.kernel_hash, spec.to_dict())
        key = VariantKey(spec.kernel_hash, "triton", config, "0" * 64, "triton=3.6.0",
                         "sm_90").to_dict()
        cid = db.add_candidate(key, {"block_m": 64, "block_n": 64})
        db.set_winner(spec.hash, cid, device_name="NVIDIA H200", median_ms=1.5,
                      timer="do_bench")


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A shipped-winners folder holding one real export (of TINY, config 'shipped_cfg')."""
    from tilegen import winners
    from tilegen.db import TuningDB

    folder = tmp_path / "tuning_db"
    folder.mkdir()
    _db_with_winner(tmp_path / "src.sqlite", TINY, "shipped_cfg")
    with TuningDB.open(tmp_path / "src.sqlite", readonly=True) as db:
        db.export_json(folder / "winners.json")
    (folder / "notes.json").write_text('{"not": "an export"}')  # skipped, like load does
    monkeypatch.setattr(winners, "SHIPPED_DIR", folder)
    return folder / "winners.json"


def test_db_list_and_show_the_shipped_winners_with_no_db(
        tmp_path: Path, shipped: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "none" / "tuning.sqlite"
    monkeypatch.setenv("TILEGEN_DB", str(db))
    assert main(["db", "list"]) == 0
    out = capsys.readouterr().out
    assert f"no tuning DB at {db}" in out
    assert f"shipped winners {shipped}" in out and "1 workload(s), 1 winner(s)" in out
    assert TINY.hash[:12] in out and "shipped" in out.splitlines()[-1]
    assert main(["db", "show", TINY.hash[:8]]) == 0
    out = capsys.readouterr().out
    assert f"shipped in {shipped}" in out and f"not in the tuning DB {db}" in out
    (row,) = [ln for ln in out.splitlines() if "shipped_cfg" in ln]
    assert row.startswith("shipped") and "NVIDIA H200" in row and "do_bench" in row
    assert main(["db", "show", "ffffff"]) == 1  # neither in a DB nor shipped
    assert f"no tuning DB at {db}" in capsys.readouterr().err
    assert not db.parent.exists()  # read-only actions never create it


def test_db_list_and_show_mark_db_and_shipped_rows(
        tmp_path: Path, shipped: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "t.sqlite"
    other = TINY.replace(topk=1)
    _db_with_winner(db, other, "db_cfg_other")
    _db_with_winner(db, TINY, "db_cfg")
    monkeypatch.setenv("TILEGEN_DB", str(db))
    assert main(["db", "list"]) == 0
    out = capsys.readouterr().out
    head, tail = out.split(f"shipped winners {shipped}")
    assert f"tuning DB {db}" in head and "2 workload(s)" in head and other.hash[:12] in head
    assert TINY.hash[:12] in tail and other.hash[:12] not in tail
    assert main(["db", "show", TINY.hash[:8]]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln for ln in out.splitlines() if "_cfg" in ln}
    assert "db_cfg" in rows["db"] and "shipped_cfg" in rows["shipped"], out


# --------------------------------------------------------------------------- captures, backends


def test_captures_synthesize_says_its_size_and_progress_off_a_tty(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tilegen.cli import capture_bytes

    spec = Spec(grid=(5, 6, 8), num_heads=10, head_dim=64, topk=3)
    (tmp_path / "s.json").write_text(spec.to_json())
    assert main(["captures", "synthesize", "--out", str(tmp_path / "c"), "--spec",
                 str(tmp_path / "s.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("about 2.0 MB"), lines  # said before the work
    steps = [ln for ln in lines if ln.strip().startswith("step ")]
    assert steps and steps[-1].strip() == "step 3/3 (100%)", lines
    size = (tmp_path / "c" / "synthetic_seed0.pt").stat().st_size
    assert capture_bytes(spec) <= size <= capture_bytes(spec) * 1.02 + 65536
    # the README's default: the 1.2 GB it writes is said up front
    from tilegen.cli import _human_bytes

    assert _human_bytes(capture_bytes(Spec())) == "1.2 GB"


def test_triton_bwd_is_not_offered_to_users(capsys: pytest.CaptureFixture[str]) -> None:
    from tilegen import backends

    for cmd in ("build", "tune"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert "--backend {triton,cuda,hip,gluon}" in out, out
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--backend", "triton_bwd"])
    assert exit_.value.code == 2 and "--backward" in capsys.readouterr().err
    with pytest.raises(ValueError) as err:
        backends.get("metal")
    assert "triton_bwd" not in str(err.value) and "'gluon'" in str(err.value)
    assert backends.get("triton_bwd").name == "triton_bwd"  # tune --backward still reaches it


def test_export_file_is_valid_json_after_a_good_export(place: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The checks let good paths through: an export to a new folder works."""
    out = place / "new" / "w.json"
    assert main(["db", "export", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["format"] == "tilegen-tuning-db"
