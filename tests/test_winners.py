"""`tilegen.winners.lookup_config`: the tuned winner from the DB or a shipped JSON export,
stale detection (template set, toolchain), and lookups with SQLAlchemy unimportable."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import triton

import tilegen
from tilegen import winners
from tilegen.config import KernelConfig, default_config
from tilegen.db import TuningDB, toolchain_key
from tilegen.render import template_set_hash
from tilegen.spec import Spec
from tilegen.targets import get_target

ROOT = Path(__file__).resolve().parents[1]
SPEC = Spec(grid=(4, 4, 8), num_heads=2, head_dim=64, topk=2)
TARGET = get_target("sm_90")
TUNED = KernelConfig(block_m=32, block_n=64, num_warps=4, num_stages=2)


@pytest.fixture
def where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty DB location and an empty shipped-exports folder; fresh log-once state."""
    monkeypatch.setenv("TILEGEN_DB", str(tmp_path / "tuning.sqlite"))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(winners, "SHIPPED_DIR", shipped)
    monkeypatch.setattr(winners, "_logged", set())
    return tmp_path


def _store(path: Path, cfg: KernelConfig = TUNED, *, tpl: str | None = None,
           tool: str | None = None, device: str = "cpu", ms: float = 1.25) -> None:
    """Record `cfg` as the winner of SPEC on (device, sm_90) the way `tilegen tune` does."""
    with TuningDB.open(path) as db:
        db.upsert_workload(SPEC.hash, SPEC.to_dict())
        cid = db.add_candidate(SPEC.hash, cfg.name, cfg.to_dict(), "0" * 64)
        db.set_winner(SPEC.hash, cid, device_name=device, arch="sm_90",
                      template_set_hash=tpl or template_set_hash("triton"),
                      toolchain_key=tool or winners.current_toolchain_key(), median_ms=ms,
                      force=True)


def test_toolchain_key_is_the_db_format() -> None:
    assert winners.current_toolchain_key() == toolchain_key({"triton": triton.__version__})
    assert winners.current_device_name() == "cpu"  # this machine has no GPU


def test_miss_falls_back_with_one_line(where: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tilegen"):
        assert winners.lookup_config(SPEC, TARGET) is None
        assert winners.lookup_config(SPEC, TARGET) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1  # once per process
    assert "no tuned winner" in lines[0] and default_config(TARGET).name in lines[0]
    assert not (where / "tuning.sqlite").exists()  # a lookup never creates a DB
    op = tilegen.load(SPEC, target="sm_90")
    assert op.config == default_config(TARGET) and op.config_source == "default"


def test_hit_from_db(where: Path, caplog: pytest.LogCaptureFixture) -> None:
    _store(where / "tuning.sqlite")
    with caplog.at_level(logging.INFO, logger="tilegen"):
        assert winners.lookup_config(SPEC, TARGET) == TUNED
    assert "using tuned winner" in caplog.text
    op = tilegen.load(SPEC, target="sm_90")
    assert op.config == TUNED and op.config_source == "winner"
    # another device name or arch is another kind of device: a miss
    assert winners.find_winner(SPEC, TARGET, device_name="NVIDIA H200").status == "miss"
    assert winners.find_winner(SPEC, get_target("sm_100a")).status == "miss"


@pytest.mark.parametrize("field", ["template", "toolchain"])
def test_stale_in_db_is_reported_not_used(where: Path, field: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    if field == "template":
        _store(where / "tuning.sqlite", tpl="f" * 64)
    else:
        _store(where / "tuning.sqlite", tool="triton=3.5.1")
    with caplog.at_level(logging.WARNING, logger="tilegen"):
        assert winners.lookup_config(SPEC, TARGET) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert "stale tuned winner" in line and TUNED.name in line
    if field == "template":
        assert "template set ffffffffffff" in line and template_set_hash("triton")[:12] in line
    else:
        assert "toolchain 'triton=3.5.1'" in line and triton.__version__ in line
    found = winners.find_winner(SPEC, TARGET)
    assert found.status == "stale" and found.config == TUNED  # still offered as a tuning seed
    assert tilegen.load(SPEC, target="sm_90").config_source == "default"


def _export(where: Path, name: str = "winners.json", **store) -> Path:
    db_file = where / f"export-{name}.sqlite"
    _store(db_file, **store)
    with TuningDB.open(db_file) as db:
        out = winners.SHIPPED_DIR / name
        db.export_json(out, spec_hash=SPEC.hash)
    db_file.unlink()
    return out


def test_hit_and_stale_from_json_export(where: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _export(where)
    (winners.SHIPPED_DIR / "notes.json").write_text('{"not": "an export"}')  # ignored
    res = winners.find_winner(SPEC, TARGET)
    assert res.hit and res.config == TUNED and res.source == f"json:{path}"
    assert res.median_ms == 1.25
    assert winners.lookup_config(SPEC, TARGET) == TUNED
    path.unlink()
    _export(where, "old.json", tpl="e" * 64)
    with caplog.at_level(logging.WARNING, logger="tilegen"):
        assert winners.lookup_config(SPEC, TARGET) is None
    assert "stale tuned winner" in caplog.text and "old.json" in caplog.text


def test_db_first_then_json(where: Path) -> None:
    # DB stale, shipped export current: the current one wins
    _store(where / "tuning.sqlite", tpl="d" * 64)
    _export(where, cfg=KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=4))
    res = winners.find_winner(SPEC, TARGET)
    assert res.hit and res.source.startswith("json:") and res.config.block_n == 32
    # DB current: it wins over the export
    _store(where / "tuning.sqlite")
    res = winners.find_winner(SPEC, TARGET)
    assert res.hit and res.source.startswith("db:") and res.config == TUNED


def test_unusable_winners_are_skipped(where: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _export(where)
    doc = json.loads(path.read_text())
    doc["candidates"][0]["config"]["block_m"] = 128  # 128 does not divide block_q = 64
    path.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="tilegen"):
        assert winners.lookup_config(SPEC, TARGET) is None
    assert "invalid for sm_90" in caplog.text and "block_m=128" in caplog.text
    doc["candidates"][0]["config"]["future_option"] = 1  # written by a newer tilegen
    path.write_text(json.dumps(doc))
    assert winners.find_winner(SPEC, TARGET).status == "miss"
    path.write_text("{broken")
    assert winners.find_winner(SPEC, TARGET).status == "miss"


def test_lookup_without_sqlalchemy(where: Path) -> None:
    """A GPU box with torch and triton only: the DB is skipped, shipped JSON still works."""
    _export(where)
    _store(where / "tuning.sqlite", cfg=KernelConfig(block_m=64, block_n=32))  # unreachable
    script = textwrap.dedent(f"""
        import sys
        sys.modules["sqlalchemy"] = None  # import sqlalchemy -> ImportError
        sys.modules["optuna"] = None
        from pathlib import Path
        from tilegen import winners
        from tilegen.spec import Spec
        from tilegen.targets import get_target
        try:
            import tilegen.db
        except ImportError:
            pass
        else:
            raise SystemExit("tilegen.db imported without sqlalchemy?")
        winners.SHIPPED_DIR = Path({str(winners.SHIPPED_DIR)!r})
        spec = Spec.from_json({SPEC.to_json()!r})
        cfg = winners.lookup_config(spec, get_target("sm_90"))
        print(cfg.name)
        winners.SHIPPED_DIR = Path("/nonexistent")
        print(winners.lookup_config(spec, get_target("sm_90")))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [TUNED.name, "None"]
    assert "no tuned winner" in out.stderr  # WARNING reaches stderr with no logging set up


def test_shipped_winners_are_current():
    """Every winner shipped in tuning_db/*.json was tuned under the current Triton templates and
    Triton version; otherwise a fresh install would log it as stale and run the default. A
    Triton template edit therefore needs a re-tune (bench/tune_h200.sh) before it lands."""
    import triton

    from tilegen.paths import ROOT

    shipped = sorted((ROOT / "tuning_db").glob("*.json"))
    assert shipped, "no shipped winners in tuning_db/"
    for path in shipped:
        for w in json.loads(path.read_text())["winners"]:
            assert w["template_set_hash"] == template_set_hash("triton"), (
                f"{path.name}: winner {w['config_name']} on {w['device_name']} was tuned under "
                f"template set {w['template_set_hash'][:12]}, current "
                f"{template_set_hash('triton')[:12]}: re-run bench/tune_h200.sh")
            assert w["toolchain_key"] == f"triton={triton.__version__}", path.name
