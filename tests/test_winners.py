"""`tilegen.winners.lookup_config`: the tuned winner from the DB or a shipped JSON export.

- one identity: a winner is current iff re-rendering its config gives its source sha256 and the
  toolchain matches (a template comment keeps it; a source change makes it stale);
- kernel fields vs workload fields: a workload without a winner uses the winner of the nearest
  tuned workload of the same kernel, and says which;
- only winners timed on a real device are used;
- lookups with SQLAlchemy unimportable (shipped JSON only).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import triton

import tilegen
from tilegen import backends, ops, winners
from tilegen.config import KernelConfig, default_config
from tilegen.db import TuningDB
from tilegen.spec import Spec
from tilegen.targets import get_target

ROOT = Path(__file__).resolve().parents[1]
SPEC = Spec(grid=(4, 4, 8), num_heads=2, head_dim=64, topk=2)
TARGET = get_target("sm_90")
TRITON = backends.get("triton")
TUNED = KernelConfig(block_m=32, block_n=64, num_warps=4, num_stages=2)


@pytest.fixture
def where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty DB location and an empty shipped-exports folder; fresh log-once state."""
    monkeypatch.setenv("TILEGEN_DB", str(tmp_path / "tuning.sqlite"))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(winners, "SHIPPED_DIR", shipped)
    monkeypatch.setattr(winners, "_logged", set())
    monkeypatch.setattr(ops, "_noted", set())  # ops' own log-once notes (the untuned default)
    return tmp_path


def _store(path: Path, cfg: KernelConfig = TUNED, *, spec: Spec = SPEC, sha: str | None = None,
           tool: str | None = None, device: str = "cpu", ms: float = 1.25,
           timer: str = "do_bench") -> None:
    """Record `cfg` as the winner of `spec` on (device, sm_90) the way `tilegen tune` does:
    its variant key from the current render (or the given source sha / toolchain)."""
    key = TRITON.variant_key(spec, cfg, TARGET).to_dict()
    if sha is not None:
        key["source_sha256"] = sha
    if tool is not None:
        key["toolchain"] = tool
    with TuningDB.open(path) as db:
        db.upsert_workload(spec.hash, spec.kernel_hash, spec.to_dict())
        cid = db.add_candidate(key, cfg.to_dict())
        db.set_winner(spec.hash, cid, device_name=device, median_ms=ms, timer=timer,
                      force=True)


def _export(where: Path, name: str = "winners.json", **store) -> Path:
    db_file = where / f"export-{name}.sqlite"
    _store(db_file, **store)
    with TuningDB.open(db_file) as db:
        out = winners.SHIPPED_DIR / name
        db.export_json(out, include_fake=True)
    db_file.unlink()
    return out


def test_miss_falls_back_with_one_line(where: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tilegen"):
        assert winners.lookup_config(SPEC, TARGET) is None
        assert winners.lookup_config(SPEC, TARGET) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1  # once per process
    assert "no tuned winner" in lines[0] and default_config(TARGET).name in lines[0]
    assert not (where / "tuning.sqlite").exists()  # a lookup never creates a DB
    # no winner of any family: the target's untuned family at its tuning base (sm_90: the CUDA
    # wgmma kernel's defaults, measured 1.47x ahead of the Triton default on an untuned H100)
    with caplog.at_level(logging.WARNING, logger="tilegen"):
        op = tilegen.load(SPEC, target="sm_90")
    assert TARGET.untuned_backend == "cuda" and op.backend == "cuda"
    assert op.config == backends.get("cuda").tuning_base(SPEC, TARGET)
    assert op.config_source == "default" and "cuda family's untuned default" in caplog.text
    # a spec that family refuses (GQA), or a target that names none, gets the Triton default
    gqa = tilegen.load(SPEC.replace(num_kv_heads=1), target="sm_90")
    assert gqa.backend == "triton" and gqa.config == default_config(TARGET)
    sm80 = get_target("sm_80")
    assert sm80.untuned_backend == "triton"
    assert tilegen.load(SPEC, target=sm80).config == default_config(sm80)


def test_hit_from_db(where: Path, caplog: pytest.LogCaptureFixture) -> None:
    _store(where / "tuning.sqlite")
    with caplog.at_level(logging.INFO, logger="tilegen"):
        assert winners.lookup_config(SPEC, TARGET) == TUNED
    assert "using tuned winner" in caplog.text and "do_bench" in caplog.text
    op = tilegen.load(SPEC, target="sm_90")
    assert op.config == TUNED and op.config_source == "winner"
    # another device name or target is another kind of device: a miss
    assert winners.find_winner(SPEC, TARGET, device_name="NVIDIA H200").status == "miss"
    assert winners.find_winner(SPEC, get_target("sm_100a")).status == "miss"


@pytest.mark.parametrize("field", ["source", "toolchain"])
def test_stale_in_db_is_reported_not_used(where: Path, field: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    if field == "source":
        _store(where / "tuning.sqlite", sha="f" * 64)
    else:
        _store(where / "tuning.sqlite", tool="triton=3.5.1")
    with caplog.at_level(logging.WARNING, logger="tilegen"):
        assert winners.lookup_config(SPEC, TARGET) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert "stale tuned winner" in line and TUNED.name in line
    if field == "source":
        assert "its source ffffffffffff is not what this checkout renders" in line
    else:
        assert "'triton=3.5.1'" in line and triton.__version__ in line
    found = winners.find_winner(SPEC, TARGET)
    assert found.status == "stale" and found.config == TUNED  # still offered as a tuning seed
    assert tilegen.load(SPEC, target="sm_90").config_source == "default"


def _edited_templates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit) -> None:
    """Point rendering at a copy of templates/ with the Triton kernel template edited."""
    import tilegen.render as render

    copy = tmp_path / "templates"
    shutil.copytree(render.TEMPLATES_DIR, copy)
    path = copy / "triton" / "lut_kernel.py.j2"
    path.write_text(edit(path.read_text()))
    monkeypatch.setattr(render, "TEMPLATES_DIR", copy)
    render.environment.cache_clear()
    monkeypatch.setattr(winners, "_logged", set())


def test_template_comment_keeps_the_winner_a_source_change_makes_it_stale(
        where: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One identity: staleness is the variant key (rendered source + toolchain), not a hash of
    the template folder. A Jinja comment changes the folder but not the source."""
    import tilegen.render as render
    from tilegen.render import template_set_hash

    _store(where / "tuning.sqlite")
    before = template_set_hash("triton")
    try:
        _edited_templates(where / "a", monkeypatch,
                          lambda t: "{# reviewer's note: this never reaches the source #}\n" + t)
        assert template_set_hash("triton") != before  # the old criterion would call it stale
        res = winners.find_winner(SPEC, TARGET)
        assert res.hit and res.config == TUNED
        _edited_templates(where / "b", monkeypatch,
                          lambda t: t + "\n# a line that does reach the source\n")
        res = winners.find_winner(SPEC, TARGET)
        assert res.status == "stale" and "is not what this checkout renders" in res.message
    finally:
        monkeypatch.undo()
        render.environment.cache_clear()


def test_nearest_workload_of_the_same_kernel(where: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """720p grid / 12 heads has no winner of its own: it uses the Wan2.2 workload's winner
    (same kernel fields) and says which; its own winner comes first once it has one."""
    wan = Spec()
    p720 = Spec(grid=(21, 45, 80), num_heads=12)
    assert p720.kernel_hash == wan.kernel_hash and p720.hash != wan.hash
    far = Spec(grid=(4, 4, 8), num_heads=2, topk=2)  # same kernel, a much smaller workload
    wan_cfg = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=5)
    _store(where / "tuning.sqlite", wan_cfg, spec=wan, device="NVIDIA H200", ms=9.8)
    _store(where / "tuning.sqlite", TUNED, spec=far, device="NVIDIA H200", ms=0.1)
    with caplog.at_level(logging.INFO, logger="tilegen"):
        res = winners.find_winner(p720, TARGET, device_name="NVIDIA H200")
        assert res.hit and res.config == wan_cfg and res.nearest
        assert res.tuned_spec_hash == wan.hash and res.distance == p720.workload_distance(wan)
        assert "nearest tuned workload (spec " + wan.short_hash in res.message
        assert "grid 21x30x52, 40 heads" in res.message and "grid 21x45x80, 12 heads" in \
            res.message
    # exact match first
    mine = KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=3)
    _store(where / "tuning.sqlite", mine, spec=p720, device="NVIDIA H200", ms=3.0)
    res = winners.find_winner(p720, TARGET, device_name="NVIDIA H200")
    assert res.hit and res.config == mine and not res.nearest and res.distance == 0
    # another kernel (head_dim 64) never borrows them
    other = Spec(grid=(21, 45, 80), num_heads=12, head_dim=64)
    assert winners.find_winner(other, TARGET, device_name="NVIDIA H200").status == "miss"


def test_nearest_is_logged_once_by_lookup_config(where: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    _store(where / "tuning.sqlite", spec=SPEC)
    bigger = SPEC.replace(num_heads=4)
    with caplog.at_level(logging.INFO, logger="tilegen"):
        assert winners.lookup_config(bigger, TARGET) == TUNED
        assert winners.lookup_config(bigger, TARGET) == TUNED
    (line,) = [r.getMessage() for r in caplog.records]
    assert "nearest tuned workload" in line and SPEC.short_hash in line
    op = tilegen.load(bigger, target="sm_90")
    assert op.config == TUNED and op.config_source == "winner"


def test_fake_timer_winners_are_never_used(where: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    _store(where / "tuning.sqlite", timer="fake-deterministic")
    _export(where, timer="fake-deterministic")
    with caplog.at_level(logging.INFO, logger="tilegen"):
        assert winners.lookup_config(SPEC, TARGET) is None
    assert "test-only timer 'fake-deterministic'" in caplog.text
    assert "no tuned winner" in caplog.text
    assert tilegen.load(SPEC, target="sm_90").config_source == "default"


def test_hit_and_stale_from_json_export(where: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _export(where)
    (winners.SHIPPED_DIR / "notes.json").write_text('{"not": "an export"}')  # ignored
    res = winners.find_winner(SPEC, TARGET)
    assert res.hit and res.config == TUNED and res.source == f"json:{path}"
    assert res.median_ms == 1.25
    path.unlink()
    _export(where, "old.json", sha="e" * 64)
    with caplog.at_level(logging.WARNING, logger="tilegen"):
        assert winners.lookup_config(SPEC, TARGET) is None
    assert "stale tuned winner" in caplog.text and "old.json" in caplog.text


def test_db_first_then_json(where: Path) -> None:
    # DB stale, shipped export current: the current one wins
    _store(where / "tuning.sqlite", sha="d" * 64)
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
            import tilegen.db.records
        except ImportError:
            pass
        else:
            raise SystemExit("tilegen.db.records imported without sqlalchemy?")
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


def _shipped() -> list[tuple[Path, dict]]:
    from tilegen.paths import ROOT as root

    shipped = sorted((root / "tuning_db").glob("*.json"))
    assert shipped, "no shipped winners in tuning_db/"
    return [(p, json.loads(p.read_text())) for p in shipped]


def test_shipped_winners_are_current() -> None:
    """Every winner shipped in tuning_db/*.json is what this checkout builds: its config
    re-renders to its source sha256 and its toolchain is this Triton's. A Triton template edit
    that changes the rendered source therefore needs a re-tune (bench/experiments/tune_h200.sh; see
    tuning_db/README.md) before it lands; one that does not (a comment) needs nothing."""
    for path, doc in _shipped():
        configs = {json.dumps(c["variant"], sort_keys=True): c["config"]
                   for c in doc["candidates"]}
        specs = {w["spec_hash"]: w["spec"] for w in doc["workloads"]}
        for w in doc["winners"]:
            cfg = configs[json.dumps(w["variant"], sort_keys=True)]
            assert winners.variant_currency(w["variant"], cfg, specs[w["spec_hash"]]), (
                f"{path.name}: winner {w['variant']['config']} on {w['device_name']} is stale "
                f"(source {w['variant']['source_sha256'][:12]}, toolchain "
                f"{w['variant']['toolchain']}): re-tune and re-export (tuning_db/README.md)")


def test_shipped_winners_were_timed_on_a_real_device() -> None:
    """No shipped winner comes from the test-only timer (issue 12): CI runs this."""
    from tilegen.db.policy import REAL_TIMERS

    for path, doc in _shipped():
        for w in doc["winners"]:
            assert w["timer"] in REAL_TIMERS, (path.name, w["variant"]["config"], w["timer"])
            assert w["device_name"] != "cpu", (path.name, w["variant"]["config"])


def test_shipped_wan22_winner_is_used_on_an_h200(where: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The winners measured on the H200 (bench/RESULTS.md): on 2026-12-01 the Triton family's
    bm64_bn64_w4_s5 (9.74 ms) and the Gluon family's (7.67 ms), on 2026-12-06 (session 26) the
    CUDA family's three-consumer point (6.68 ms); `tilegen.load(Spec())` there takes the fastest
    family, and the 720p / 12-head workload of the same kernel borrows the Triton one."""
    from tilegen.paths import ROOT as root

    monkeypatch.setattr(winners, "SHIPPED_DIR", root / "tuning_db")
    res = winners.find_winner(Spec(), TARGET, device_name="NVIDIA H200")
    assert res.hit and res.config.name == "bm64_bn64_w4_s5_lse" and res.timer == "do_bench"
    assert abs(res.median_ms - 9.744) < 0.01
    glu = winners.find_winner(Spec(), TARGET, backend="gluon", device_name="NVIDIA H200")
    assert glu.hit and glu.config.option("k_stages") == 3 and abs(glu.median_ms - 7.667) < 0.01
    res = winners.find_winner(Spec(grid=(21, 45, 80), num_heads=12), TARGET,
                              device_name="NVIDIA H200")
    assert res.hit and res.nearest and res.config.name == "bm64_bn64_w4_s5_lse"
    monkeypatch.setattr(winners, "current_device_name", lambda: "NVIDIA H200")
    cu = winners.find_winner(Spec(), TARGET, backend="cuda", device_name="NVIDIA H200")
    assert cu.hit and cu.config.option("consumers") == 3 and abs(cu.median_ms - 6.676) < 0.01
    backend, cfg, source = ops.resolve_config(Spec(), TARGET)
    assert (backend, source) == ("cuda", "winner") and cfg == cu.config


def test_shipped_int8_fp8_winner_is_used_on_an_h200(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #19, deliverable 5: the CUDA 8-bit kernel tuned on the H200 (session 30,
    bench/results/2026-12-07_s30_h200_tune_int8_fp8.log: one consumer, K ring 2, V ring 3,
    128-key tiles, bulk copies, Q quantized in the kernel, 5.42 ms with lse) is what
    `tilegen.load(Spec(quant="int8_fp8"))` resolves there (re-keyed in session 32: the same
    SASS; and in session 38: the same SASS but for the scales' floor, an FMNMX immediate).
    The H100 has its own (session 32,
    bench/results/2026-12-07_s32_h100_run9_tune_int8_fp8.log: two consumers, K ring 2, V ring 2,
    bulk copies, `q_in_kernel`, P's code linear in the exponent and the MMA row sum, 4.98 ms
    with lse), and one of its own at TOPK 31 (session 33)."""
    from tilegen.paths import ROOT as root

    monkeypatch.setattr(winners, "SHIPPED_DIR", root / "tuning_db")
    spec = Spec(quant="int8_fp8")
    h200 = winners.find_winner(spec, TARGET, backend="cuda", device_name="NVIDIA H200")
    assert h200.hit and not h200.nearest and h200.timer == "do_bench"
    knobs = ("consumers", "k_stages", "v_stages", "kv_tile", "kv_copies", "q_in_kernel",
             "p_exp", "row_sum")
    assert {k: h200.config.option(k) for k in knobs} == {
        "consumers": 1, "k_stages": 2, "v_stages": 3, "kv_tile": 128, "kv_copies": "bulk",
        "q_in_kernel": True, "p_exp": None, "row_sum": None}
    assert abs(h200.median_ms - 5.415) < 0.01
    h100 = winners.find_winner(spec, TARGET, backend="cuda", device_name="NVIDIA H100 80GB HBM3")
    assert h100.hit and not h100.nearest and h100.timer == "do_bench"
    assert {k: h100.config.option(k) for k in knobs} == {
        "consumers": 2, "k_stages": 2, "v_stages": 2, "kv_tile": 128, "kv_copies": "bulk",
        "q_in_kernel": True, "p_exp": "linear", "row_sum": "mma"}
    assert abs(h100.median_ms - 4.977) < 0.01
    # TOPK 31 (session 33, bench/results/2026-12-07_s33_h100_run4_tune_topk31.log): the H100's
    # own winner there, one consumer (two were 2.4% behind); the H200 takes its TOPK-78 one
    sparse = spec.replace(topk=31)
    h100_31 = winners.find_winner(sparse, TARGET, backend="cuda",
                                  device_name="NVIDIA H100 80GB HBM3")
    assert h100_31.hit and not h100_31.nearest
    assert {k: h100_31.config.option(k) for k in knobs} == {
        "consumers": 1, "k_stages": 3, "v_stages": 2, "kv_tile": 128, "kv_copies": "bulk",
        "q_in_kernel": True, "p_exp": "linear", "row_sum": "mma"}
    assert abs(h100_31.median_ms - 2.501) < 0.01
    h200_31 = winners.find_winner(sparse, TARGET, backend="cuda", device_name="NVIDIA H200")
    assert h200_31.hit and h200_31.nearest and h200_31.config == h200.config
    monkeypatch.setattr(winners, "current_device_name", lambda: "NVIDIA H200")
    backend, cfg, source = ops.resolve_config(spec, TARGET)
    assert (backend, source) == ("cuda", "winner") and cfg == h200.config
