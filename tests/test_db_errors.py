"""Issue 12, tuning DB: every failure names its cause.

- a garbage, text, empty or truncated file named by TILEGEN_DB or --db: ``db list``, ``db
  import`` and ``tune`` print one line naming the path and the cause, exit 2, and leave the file
  byte-identical (same mtime); ``tilegen.load`` warns and goes on;
- ``db import`` errors name the file, the record and the field; JSON syntax errors the line;
- winners from the test-only timer: recorded with their timer, left out of ``db export``
  unless ``--include-fake`` (never used by ``load``: tests/test_winners.py);
- ``tilegen db list --db X`` (the option after the action) works.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from tilegen.cli import main
from tilegen.db import TuningDB
from tilegen.identity import VariantKey
from tilegen.spec import Spec

TINY = Spec(grid=(4, 4, 8), num_heads=2, head_dim=64, topk=2)
TINY_TOML = 'grid = [4, 4, 8]\nnum_heads = 2\nhead_dim = 64\ntopk = 2\ndtype = "bf16"\n'


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _good_db(path: Path, n: int = 60, timer: str = "do_bench") -> None:
    """A real tuning DB with enough rows to span several pages."""
    with TuningDB.open(path) as db:
        db.upsert_workload(TINY.hash, TINY.kernel_hash, TINY.to_dict())
        for i in range(n):
            key = VariantKey(TINY.kernel_hash, "triton", f"cfg{i}", f"{i:064d}",
                             "triton=3.6.0", "sm_90").to_dict()
            cid = db.add_candidate(key, {"block_m": 64, "pad": "x" * 200})
            db.set_winner(TINY.hash, cid, device_name="NVIDIA H200", median_ms=10.0 - i / 100,
                          timer=timer)


def _bad_file(tmp_path: Path, kind: str) -> tuple[Path, str]:
    path = tmp_path / "bad" / "tuning.sqlite"
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "garbage":
        path.write_bytes(bytes(range(256)) * 40)
        cause = "not a SQLite database (the file holds binary data"
    elif kind == "text":
        path.write_text("winners:\n  - bm64_bn64\n" * 50)
        cause = "not a SQLite database (the file holds text ('winners:'"
    elif kind == "empty":
        path.write_bytes(b"")
        cause = "empty file (0 bytes)"
    else:  # truncated: a real DB cut in half, as a failed copy leaves it
        _good_db(path)
        data = path.read_bytes()
        assert len(data) >= 4 * 4096
        path.write_bytes(data[: len(data) // 2 + 100])
        cause = "truncated SQLite file"
    os.utime(path, (1_600_000_000, 1_600_000_000))
    return path, cause


def _snapshot(path: Path) -> tuple[bytes, int, list[str]]:
    return path.read_bytes(), path.stat().st_mtime_ns, sorted(p.name for p in path.parent.iterdir())


@pytest.mark.parametrize("kind", ["garbage", "text", "empty", "truncated"])
@pytest.mark.parametrize("how", ["--db", "TILEGEN_DB"])
@pytest.mark.parametrize("command", ["db list", "db show", "db export", "db import", "tune"])
def test_a_file_that_is_not_a_db_is_one_line_exit_2_untouched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        kind: str, how: str, command: str) -> None:
    path, cause = _bad_file(tmp_path, kind)
    export = tmp_path / "export.json"
    export.write_text(json.dumps({"format": "tilegen-tuning-db", "schema_version": 2}))
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    argv = {"db list": ["db", "list"], "db show": ["db", "show", "abc"],
            "db export": ["db", "export"], "db import": ["db", "import", str(export)],
            "tune": ["tune", "--spec", str(tmp_path / "tiny.toml"), "--target", "sm_90",
                     "--timer", "fake-deterministic", "--trials", "1"]}[command]
    if how == "--db":
        argv = [*argv, "--db", str(path)]
    else:
        monkeypatch.setenv("TILEGEN_DB", str(path))
    before = _snapshot(path)
    code, out, err = _run(argv, capsys)
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert str(path) in lines[0] and cause in lines[0] and "Traceback" not in err
    assert _snapshot(path) == before  # byte-identical, same mtime, no -wal / -shm left


def test_load_warns_and_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                caplog: pytest.LogCaptureFixture) -> None:
    import tilegen
    from tilegen import winners

    path, _ = _bad_file(tmp_path, "garbage")
    before = _snapshot(path)
    monkeypatch.setenv("TILEGEN_DB", str(path))
    monkeypatch.setattr(winners, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="tilegen"):
        op = tilegen.load(TINY, target="sm_90")
    assert op.config_source == "default"
    assert f"cannot read the tuning DB {path}" in caplog.text
    assert "not a SQLite database" in caplog.text
    assert _snapshot(path) == before


# --------------------------------------------------------------------------- import errors


def _export_doc(tmp_path: Path) -> dict:
    db_path = tmp_path / "src.sqlite"
    _good_db(db_path, n=2)
    with TuningDB.open(db_path) as db:
        return json.loads(db.export_json())


@pytest.mark.parametrize(("mutate", "want"), [
    (lambda d: d["winners"][0].update(median_ms="fast"),
     "winners[0] (cfg1): median_ms: median_ms must be a number, got 'fast'"),
    (lambda d: d["winners"][0].update(median_ms=-1),
     "winners[0] (cfg1): median_ms: median_ms must be a finite number > 0, got -1"),
    (lambda d: d["winners"][0].pop("timer"), "winners[0] (cfg1): timer: missing"),
    (lambda d: d["winners"][0]["variant"].pop("toolchain"),
     "winners[0] (cfg1): variant: variant key lacks field(s) ['toolchain']"),
    (lambda d: d["candidates"][1].update(config=[1, 2]),
     "candidates[1] (cfg1): config: config must be a JSON object (dict), got list"),
    (lambda d: d["workloads"][0].pop("kernel_hash"),
     "workloads[0] (" + TINY.hash[:12] + "): kernel_hash: missing"),
    (lambda d: d["winners"][0].update(recorded_at="yesterday"),
     "winners[0] (cfg1): recorded_at: recorded_at is not an ISO 8601 time: 'yesterday'"),
    (lambda d: d["winners"][0].update(env_key="nope"),
     "winners[0] (cfg1): env_key: 'nope' names no environment of the file"),
    (lambda d: d.update(schema_version=9), "schema_version: 9; this tilegen reads 1..2"),
    (lambda d: d.update(format="other"),
     "not a tilegen tuning DB export (\"format\" must be 'tilegen-tuning-db')"),
])
def test_import_errors_name_file_record_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], mutate, want: str) -> None:
    doc = _export_doc(tmp_path)
    mutate(doc)
    bad = tmp_path / "bad export.json"
    bad.write_text(json.dumps(doc, indent=2))
    dst = tmp_path / "dst.sqlite"
    TuningDB.open(dst).close()
    before = dst.read_bytes()
    code, out, err = _run(["db", "--db", str(dst), "import", str(bad)], capsys)
    assert code == 1, (out, err)
    (line,) = err.splitlines()
    assert line == f"tilegen db: error: {bad}: {want}", line
    assert dst.read_bytes() == before  # nothing imported


def test_import_json_syntax_error_names_file_and_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "winners.json"
    bad.write_text('{\n  "format": "tilegen-tuning-db",\n  "winners": [\n    {"a": 1,,}\n]}\n')
    code, _out, err = _run(["db", "--db", str(tmp_path / "t.sqlite"), "import", str(bad)],
                           capsys)
    assert code == 1
    assert err.strip() == (f"tilegen db: error: {bad}: line 4 column 13: not JSON (Expecting "
                           "property name enclosed in double quotes)")
    bad.write_bytes(b"\xff\xfe\x00garbage")
    code, _out, err = _run(["db", "--db", str(tmp_path / "t.sqlite"), "import", str(bad)],
                           capsys)
    assert code == 1 and f"{bad}: not a text file" in err


# --------------------------------------------------------------------------- fake timer


def test_export_leaves_fake_timer_winners_out_unless_asked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db_path = tmp_path / "t.sqlite"
    _good_db(db_path, n=1, timer="fake-deterministic")
    out_file = tmp_path / "x.json"
    code, out, _err = _run(["db", "export", "--db", str(db_path), "--out", str(out_file)],
                           capsys)
    assert code == 0 and "left out 1 winner(s) timed by a test-only timer" in out
    assert json.loads(out_file.read_text())["winners"] == []
    code, out, _err = _run(["db", "export", "--db", str(db_path), "--out", str(out_file),
                            "--include-fake"], capsys)
    assert code == 0 and "left out" not in out
    (w,) = json.loads(out_file.read_text())["winners"]
    assert w["timer"] == "fake-deterministic"


# --------------------------------------------------------------------------- --db placement


def test_db_option_after_the_action(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.sqlite"
    _good_db(path, n=1)
    monkeypatch.setenv("TILEGEN_DB", str(tmp_path / "elsewhere.sqlite"))
    for argv in (["db", "list", "--db", str(path)], ["db", "--db", str(path), "list"]):
        code, out, err = _run(argv, capsys)
        assert code == 0, err
        assert f"tuning DB {path}" in out and TINY.hash[:12] in out
    code, out, _ = _run(["db", "show", TINY.hash[:8], "--db", str(path)], capsys)
    assert code == 0 and "cfg0" in out and "NVIDIA H200" in out
    assert not (tmp_path / "elsewhere.sqlite").exists()


@pytest.mark.parametrize(("action", "code"), [
    (["list"], 0), (["show", "abc123"], 1), (["export"], 1),
    (["export", "--out", "x.json"], 1)])
def test_db_read_only_actions_never_create_the_db(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    action: list[str], code: int,
) -> None:
    monkeypatch.chdir(tmp_path)
    for how in ("--db", "TILEGEN_DB"):
        db = tmp_path / how.strip("-") / "sub" / "tuning.sqlite"
        if how == "--db":
            argv = ["db", "--db", str(db), *action]
        else:
            monkeypatch.setenv("TILEGEN_DB", str(db))
            argv = ["db", *action]
        got, out, err = _run(argv, capsys)
        assert got == code, out + err
        assert f"no tuning DB at {db} (nothing tuned yet; run tilegen tune)" in out + err
        assert not db.parent.parent.exists()  # neither the file nor its folders
        assert not (tmp_path / "x.json").exists()
