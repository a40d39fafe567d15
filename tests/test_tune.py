"""`tilegen tune`: search space, failure classes, worker isolation, resume, end to end.

Everything runs on the CPU under the Triton interpreter (TRITON_INTERPRET=1) on a tiny shape;
timing uses the test-only ``fake-deterministic`` timer, but every trial still goes through the
real correctness gate (`tilegen.captures.score` against the reference variant).

The op factories below (``faulty_op``, ``slow_op``, ``wrong_for_fastest``) are imported by name
inside spawned worker processes (``test_tune:faulty_op``), which find this file on sys.path.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tilegen.config import KernelConfig, default_config
from tilegen.spec import Spec
from tilegen.targets import get_target
from tilegen.tune.objective import (
    TrialRequest,
    WorkerHandle,
    WorkerSetup,
    classify,
    fake_deterministic_ms,
    poisons_context,
)
from tilegen.tune.space import Dim, SearchSpace, parse_space_override, seed_configs

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
TINY = Spec(grid=(4, 4, 8), num_heads=2, head_dim=64, topk=2, dtype="bf16")
TINY_TOML = 'grid = [4, 4, 8]\nnum_heads = 2\nhead_dim = 64\ntopk = 2\ndtype = "bf16"\n'


@pytest.fixture
def tune_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Interpreter on, DB and kernel cache under tmp_path, this folder importable by workers."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TILEGEN_DB", str(tmp_path / "tuning.sqlite"))
    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    return tmp_path


# ============================================================================ op factories
# (run inside worker processes; each returns an op like tilegen.ops.BlockSparseAttention)


def _unchecked(spec: Spec, cfg: KernelConfig):
    from tilegen.ops import BlockSparseAttention

    # Built directly, skipping load()'s config check, so Triton itself sees the config.
    return BlockSparseAttention(spec, cfg, None, "explicit")


class _WrongOutput:
    """The real kernel, with its output deliberately broken on one head."""

    def __init__(self, op) -> None:
        self.op, self.spec, self.config = op, op.spec, op.config

    def __call__(self, *args, **kwargs):
        o, lse = self.op(*args, **kwargs)
        o = o.clone()
        o[:, :, 0, :] += 0.05  # head 0 shifted: max|Δ| = 5e-2 > 3e-2
        return o, lse

    def launch(self, *args, **kwargs):
        return self.op.launch(*args, **kwargs)


def faulty_op(spec: Spec, cfg: KernelConfig):
    """Fault by config trait: bm48 -> Triton rejects it, bn32 -> wrong result, s1 -> hangs,
    s2 -> the process dies (SIGSEGV), s4 -> CUDA-style illegal address; else the real op."""
    from tilegen.ops import load

    if cfg.block_m == 48:
        return _unchecked(spec, cfg)  # tl.arange(0, 48): not a power of 2
    if cfg.block_n == 32:
        return _WrongOutput(load(spec, cfg))
    if cfg.num_stages == 1:
        time.sleep(600)
    if cfg.num_stages == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if cfg.num_stages == 4:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel "
                           "errors might be asynchronously reported at some other API call")
    return load(spec, cfg)


class _OutOfBounds:
    """GPU only: launches the real kernel on a LUT that points 2**30 cubes past the end of K,
    for a real illegal memory access (the CUDA context is lost)."""

    def __init__(self, op) -> None:
        self.op, self.spec, self.config = op, op.spec, op.config

    def __call__(self, q, k, v, topk_idx, vbs, *args, **kwargs):
        import torch

        return self.op.launch(q, k, v, torch.full_like(topk_idx, 2**30), vbs)

    def launch(self, *args, **kwargs):
        return self.op.launch(*args, **kwargs)


def gpu_fault_op(spec: Spec, cfg: KernelConfig):
    """For a GPU check of worker isolation (bench/tune_h200.sh's neighbour, not a CPU test):
    num_stages=2 reads far out of bounds; everything else is the real op."""
    from tilegen.ops import load

    op = load(spec, cfg)
    return _OutOfBounds(op) if cfg.num_stages == 2 else op


def slow_op(spec: Spec, cfg: KernelConfig):
    """The real op, 0.4 s slower to build: a kill lands in the middle of a trial."""
    from tilegen.ops import load

    time.sleep(0.4)
    return load(spec, cfg)


# test_failing_trial_never_wins pins the space to 32 points, whatever the target file says
PINNED_SPACE = {"num_stages": (1, 2, 3, 4)}


def _fastest_feasible(spec: Spec) -> KernelConfig:
    space = SearchSpace.from_target(spec, get_target("sm_90"), PINNED_SPACE)
    return min(space.feasible(), key=lambda c: fake_deterministic_ms(c.name))


def wrong_for_fastest(spec: Spec, cfg: KernelConfig):
    """Breaks the output of exactly the config the fake timer ranks fastest."""
    from tilegen.ops import load

    op = load(spec, cfg)
    return _WrongOutput(op) if cfg.name == _fastest_feasible(spec).name else op


# ============================================================================ space


def test_space_from_target_and_pruning() -> None:
    target = get_target("sm_90")
    space = SearchSpace.from_target(Spec(), target)
    assert space.names == ("block_m", "block_n", "num_warps", "num_stages")
    assert all(d.kind == "launch" for d in space.dims) and space.fragment("render") == ()
    stages = len(target.tunable["num_stages"])  # the ranges come from targets/sm_90/target.toml
    assert space.size == 2 * 2 * 2 * stages == len(list(space.configs()))
    feasible = space.feasible()
    assert len(feasible) == 6 * stages  # bm32 with 8 warps is pruned
    bad = KernelConfig(block_m=32, block_n=64, num_warps=8, num_stages=2)
    assert space.contains(bad)
    assert space.violations(bad) == ["num_warps=8 is more than a 32-row tile can use"]
    # gfx942: the shared-memory predicate names the LDS budget
    amd = SearchSpace.from_target(Spec(), get_target("gfx942"))
    reasons = amd.violations(KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=5))
    assert any("shared memory" in r and "65536" in r for r in reasons)
    # exhaustive order: seeds first, then feasible, then infeasible
    seeds = seed_configs(space)
    assert seeds == [("target default = reference", default_config(target))]
    order = space.enumeration([c for _, c in seeds])
    assert order[0] == default_config(target) and len(order) == 8 * stages
    assert all(not space.violations(c) for c in order[:6 * stages])
    assert all(space.violations(c) for c in order[6 * stages:])
    # a config outside the space is not a seed (Optuna could not enqueue it)
    outside = KernelConfig(block_m=16)
    assert not space.contains(outside)
    assert seed_configs(space, [("known winner (hit)", outside)]) == seeds


def test_space_overrides_are_typed() -> None:
    assert parse_space_override("num_stages=2, 3,5") == ("num_stages", (2, 3, 5))
    space = SearchSpace.from_target(Spec(), get_target("sm_90"),
                                    dict([parse_space_override("num_warps=2,4")]))
    stages = len(get_target("sm_90").tunable["num_stages"])
    choices = dict(zip(space.names, [d.choices for d in space.dims], strict=True))
    assert space.size == 2 * 2 * 2 * stages and choices["num_warps"] == (2, 4)
    for text, match in (("num_stages=2,x", "not an int"), ("block_q=64", "not a KernelConfig"),
                        ("num_stages", "NAME=V1"), ("store_lse=true", "not tunable")):
        with pytest.raises(ValueError, match=match):
            name, values = parse_space_override(text)
            Dim(name, values, "render")
    with pytest.raises(ValueError, match="must be a int"):
        Dim("block_m", (True,), "launch")  # a bool is not an int here
    with pytest.raises(ValueError, match="interpreter-only"):
        Dim("interp_bf16", (True, False), "render")


# ============================================================================ classification


def test_classify_real_exceptions(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from triton.runtime.errors import OutOfResources

    from tilegen import captures

    # A config Triton itself rejects (tl.arange needs a power of two), run for real.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cap = captures.synthesize(seed=0, grid=TINY.grid, heads=2, head_dim=64, topk=2)
    op = _unchecked(TINY, KernelConfig(block_m=48))
    with pytest.raises(Exception) as info:
        op(cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"])
    status, kind, text = classify(info.value)
    assert status == "compile_error", text
    assert kind.endswith("InterpreterError") and "power of 2" in text

    cases = [
        (OutOfResources(262144, 232448, "shared memory"), "out_of_resources"),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
         "out_of_resources"),
        (RuntimeError("CUDA error: an illegal memory access was encountered"),
         "illegal_memory_access"),
        (RuntimeError("Triton Error [CUDA]: misaligned address"), "illegal_memory_access"),
        # seen on an H200 for a LUT pointing past K (tests/test_tune.py:gpu_fault_op)
        (RuntimeError("CUDA error: operation not supported on global/shared address space\n"
                      "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."),
         "illegal_memory_access"),
        # torch's boilerplate about device-side assertions is not itself a memory fault
        (RuntimeError("CUDA error: unknown error\nCompile with `TORCH_USE_CUDA_DSA` to enable "
                      "device-side assertions."), "runtime_error"),
        (RuntimeError("PassManager::run failed"), "compile_error"),
        (TimeoutError("slow"), "timeout"),
        (ZeroDivisionError("division by zero"), "runtime_error"),
    ]
    for exc, want in cases:
        try:  # raise for real, so the traceback and the chain are the real ones
            raise exc
        except Exception as caught:  # noqa: BLE001
            got, _kind, text = classify(caught)
        assert got == want, (exc, got)
    assert poisons_context("illegal_memory_access", "")
    assert poisons_context("runtime_error", "RuntimeError: CUDA error: unknown error")
    assert not poisons_context("compile_error", "ValueError: arange")
    # the test-only timer is a pure function of the config name
    a = fake_deterministic_ms("bm64_bn64_w4_s3_lse")
    assert a == fake_deterministic_ms("bm64_bn64_w4_s3_lse") and 1.0 <= a < 2.0
    assert a != fake_deterministic_ms("bm64_bn64_w4_s2_lse")


def test_worker_isolates_failures(tune_env: Path) -> None:
    """One persistent worker serves trials; hangs, crashes and poisoned contexts cost a
    respawn, not the session; every failure class is recorded with its message."""
    setup = WorkerSetup(TINY.canonical_json(), timer="fake-deterministic",
                        op_factory="test_tune:faulty_op")
    handle = WorkerHandle(setup, setup_timeout_s=120)
    try:
        info = handle.start()
        assert info.interpreter and info.device_type == "cpu"
        assert [c.outlier for c in info.captures] == [True, True]  # the gate has outlier heads
        plan = [
            (KernelConfig(), "pass"),
            (KernelConfig(block_m=48), "compile_error"),
            (KernelConfig(block_n=32), "fail_correctness"),
            (KernelConfig(num_stages=1), "timeout"),
            (KernelConfig(num_stages=2), "runtime_error"),
            (KernelConfig(num_stages=4), "illegal_memory_access"),
            (KernelConfig(), "pass"),
        ]
        results = []
        for n, (cfg, _want) in enumerate(plan):
            results.append(handle.run(TrialRequest(n, cfg.to_dict()), cfg.name, timeout_s=6))
        assert [r.status for r in results] == [want for _, want in plan], \
            [(r.status, r.error_text) for r in results]
        ok = results[0]
        assert ok.median_ms == fake_deterministic_ms(KernelConfig().name)
        assert all(c["passed"] for c in ok.captures) and len(ok.captures) == 2
        assert "power of 2" in results[1].error_text
        assert "synthetic_seed0: finite=True" in results[2].error_text
        shift = float(re.search(r"max\|Δ\|=([0-9.e+-]+)", results[2].error_text).group(1))
        assert 0.045 <= shift <= 0.06 and "-> FAIL" in results[2].error_text  # the 0.05 shift
        assert "exceeded 6 s" in results[3].error_text
        assert "SIGSEGV" in results[4].error_text and results[4].error_class == "WorkerDied"
        assert results[5].poisoned and "illegal memory access" in results[5].error_text
        # respawns: after the timeout, after the crash, after the poisoned context
        assert handle.spawns == 4
    finally:
        handle.close()
    assert not handle.alive


# ============================================================================ sessions


def _tune_args(tmp: Path, *extra: str) -> list[str]:
    return ["tune", "--spec", str(tmp / "tiny.toml"), "--target", "sm_90",
            "--timer", "fake-deterministic", "--timeout", "60", *extra]


def _cli(argv: list[str]) -> tuple[int, str]:
    from tilegen.tune.cli import add_db_parser, add_tune_parser

    parser = argparse.ArgumentParser(prog="tilegen")
    sub = parser.add_subparsers(dest="command")
    add_tune_parser(sub)
    add_db_parser(sub)
    args = parser.parse_args(argv)
    out = io.StringIO()
    old = sys.stdout
    sys.stdout = out
    try:
        code = args.func(args)
    finally:
        sys.stdout = old
    return code, out.getvalue()


def _study(tmp: Path):
    import optuna

    storage = f"sqlite:///{tmp / 'optuna.sqlite'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage)


def test_tune_end_to_end_cli(tune_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tilegen tune` with two workers on one study, then `tilegen db`, then tilegen.load."""
    from tilegen.db import TuningDB
    from tilegen.winners import find_winner, lookup_config

    tmp = tune_env
    export = tmp / "export" / "winners.json"
    other = TINY.replace(num_heads=4)  # already shipped in the export: --export keeps it
    with TuningDB.open(tmp / "elsewhere.sqlite") as db:
        _store_winner(db, other, KernelConfig(block_m=64, block_n=32), 2.5)
        db.export_json(export)
    code, out = _cli(_tune_args(tmp, "--trials", "8", "--workers", "2", "--sampler", "tpe",
                                "--export", str(export), "--summary", str(tmp / "s.json")))
    assert code == 0, out
    assert f"merged winners of spec {TINY.short_hash} into {export}" in out
    shipped = json.loads(export.read_text())
    assert sorted(w["spec_hash"] for w in shipped["winners"]) == sorted([TINY.hash, other.hash])
    progress = capsys.readouterr().err
    assert "tune [" in progress and "/8" in progress and "best" in progress
    assert "rank" in out and "TFLOP/s" in out and "winner" in out and "PASS" in out
    summary = json.loads((tmp / "s.json").read_text())
    assert summary["trials_counted"] == 8 and summary["timer"] == "fake-deterministic"
    assert summary["seeds"][0]["label"] == "target default = reference"

    study = _study(tmp)
    counted = [t for t in study.trials if t.user_attrs.get("duplicate_of") is None]
    assert len(counted) == 8
    assert len({t.user_attrs["config"] for t in counted}) == 8  # no config measured twice
    passing = [t for t in counted if t.user_attrs["status"] == "pass"]
    best = min(passing, key=lambda t: t.value)
    # the fake timer is a function of the name, and it is what the objective saw
    assert best.value == fake_deterministic_ms(best.user_attrs["config"])
    assert {t.user_attrs["host"] for t in counted} and study.trials[0].user_attrs["config"] == \
        default_config(get_target("sm_90")).name  # the seed ran first

    winner_cfg = KernelConfig.from_dict(json.loads(best.user_attrs["config_json"]))
    assert lookup_config(TINY, get_target("sm_90")) == winner_cfg  # through the DB
    res = find_winner(TINY, get_target("sm_90"), db_path=tmp / "none.sqlite",
                      shipped_dir=export.parent)
    assert res.hit and res.config == winner_cfg and res.source.startswith("json:")
    import tilegen

    op = tilegen.load(TINY, target="sm_90")  # the op picks the winner up
    assert op.config == winner_cfg and op.config_source == "winner"

    with TuningDB.open() as db:
        (w,) = db.list_workloads()
        assert w.n_trials == 8 and w.n_winners == 1
    code, out = _cli(["db", "list"])
    assert code == 0 and TINY.short_hash in out
    code, out = _cli(["db", "show", TINY.hash[:8]])
    assert code == 0 and winner_cfg.name in out and "cpu (sm_90)" in out
    code, out = _cli(["db", "export", "--out", str(tmp / "all.json"), "--trials"])
    assert code == 0 and len(json.loads((tmp / "all.json").read_text())["trials"]) == 8
    code, out = _cli(["db", "--db", str(tmp / "other.sqlite"), "import", str(tmp / "all.json")])
    assert code == 0 and "trials +8" in out and "winners +1 new" in out
    code, out = _cli(["db", "show", "ffffffff"])
    assert code == 1


def test_failing_trial_never_wins(tune_env: Path) -> None:
    """Exhaustive search of the tiny space (32 points <= 40 trials): infeasible configs are
    pruned before compiling, and the config the timer ranks fastest fails the gate."""
    from tilegen.tune.session import TuneOptions, run_session

    out = io.StringIO()
    res = run_session(TuneOptions(
        spec=TINY, target="sm_90", timer="fake-deterministic", trials=40, timeout_s=60,
        space=PINNED_SPACE,
        op_factory="test_tune:wrong_for_fastest", progress=io.StringIO(), out=out))
    fastest = _fastest_feasible(TINY)
    assert res.exhausted and res.trials_counted == 32  # every point once, then stop
    assert res.counts == {"pass": 23, "fail_correctness": 1, "pruned": 8}
    assert res.best is not None and res.best.config_name != fastest.name
    bad = [r for r in res.rows if r.config_name == fastest.name]
    assert [r.status for r in bad] == ["fail_correctness"]
    assert "search space exhausted" in out.getvalue()
    pruned = [r for r in res.rows if r.status == "pruned"]
    assert all("num_warps=8" in r.message for r in pruned)
    study = _study(tune_env)
    # pruned trials never reached a worker: no timing, no first call
    assert all("wall_s" not in t.user_attrs for t in study.trials
               if t.user_attrs.get("status") == "pruned")


def _progress_count(line: str) -> int | None:
    if line.startswith("tune ["):
        return int(line.split("] ", 1)[1].split("/", 1)[0])
    return None


def test_resume_after_kill(tune_env: Path) -> None:
    """Kill a session mid-trial (SIGKILL), re-run the same command: the study ends with
    exactly --trials counted trials, no config measured twice, the interrupted one redone."""
    from tilegen.db import TuningDB

    tmp = tune_env
    cmd = [sys.executable, "-m", "tilegen.tune.cli", *_tune_args(
        tmp, "--trials", "9", "--sampler", "tpe", "--op-factory", "test_tune:slow_op")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if (_progress_count(line) or 0) >= 3:
                break
        time.sleep(0.2)  # the next trial is now running in the worker
    finally:
        proc.kill()  # SIGKILL: no cleanup at all
        proc.wait(30)
    killed = _study(tmp)
    assert any(t.state.name == "RUNNING" for t in killed.trials)

    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming" in again.stderr and "interrupted" in again.stderr

    study = _study(tmp)
    assert not [t for t in study.trials if t.state.name in ("RUNNING", "WAITING")]
    interrupted = [t for t in study.trials if t.user_attrs.get("status") == "interrupted"]
    counted = [t for t in study.trials if t.user_attrs.get("status") != "interrupted"
               and t.user_attrs.get("duplicate_of") is None]
    assert len(counted) == 9 and interrupted
    names = [t.user_attrs["config"] for t in counted]
    assert len(set(names)) == 9  # nothing duplicated
    for t in interrupted:  # the interrupted config was measured after the resume
        assert t.user_attrs["config"] in names
    with TuningDB.open() as db:
        rows = db.export_dict(include_trials=True)["trials"]
    assert sorted(r["trial_number"] for r in rows) == sorted(t.number for t in counted)


def test_do_bench_timer_on_cpu_is_refused(tune_env: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Under the interpreter on the CPU, the default timer (do_bench, CUDA events) is refused
    with a clear error before any trial, naming the test-only alternative."""
    code, out = _cli(["tune", "--spec", str(tune_env / "tiny.toml"), "--target", "sm_90",
                      "--trials", "2"])
    err = capsys.readouterr().err
    assert code == 2, out
    assert "tilegen tune: error:" in err
    assert "--timer do_bench times kernels with CUDA events and needs a GPU" in err
    assert "--timer fake-deterministic" in err
    assert "rank" not in out  # no session ran, no table


# ============================================================================ tune --export, db


def _store_winner(db, spec: Spec, cfg: KernelConfig, ms: float) -> None:
    db.upsert_workload(spec.hash, spec.to_dict())
    cid = db.add_candidate(spec.hash, cfg.name, cfg.to_dict(), "0" * 64)
    db.set_winner(spec.hash, cid, device_name="NVIDIA H200", arch="sm_90",
                  template_set_hash="tpl", toolchain_key="triton=3.6.0", median_ms=ms)


def test_tune_export_merges_into_an_existing_file(tune_env: Path) -> None:
    """`tilegen tune --export F` for spec A, then spec B to the same F: both specs' winners are
    in F; exporting A again gives the same bytes."""
    from tilegen.db import TuningDB
    from tilegen.tune.session import export_spec

    spec_a, spec_b = TINY, TINY.replace(num_heads=4)
    assert spec_a.hash != spec_b.hash
    dest = tune_env / "tuning_db" / "winners.json"
    with TuningDB.open() as db:
        _store_winner(db, spec_a, KernelConfig(block_m=32, block_n=64), 1.5)
        _store_winner(db, spec_b, KernelConfig(block_m=64, block_n=32), 2.5)
        out = io.StringIO()
        export_spec(db, spec_a, dest, out)
        assert f"exported winners of spec {spec_a.short_hash}" in out.getvalue()
        first = json.loads(dest.read_text())
        assert [w["spec_hash"] for w in first["winners"]] == [spec_a.hash]
        export_spec(db, spec_b, dest, out)
        assert f"merged winners of spec {spec_b.short_hash} into {dest}" in out.getvalue()
        both = dest.read_text()
        doc = json.loads(both)
        assert sorted(w["spec_hash"] for w in doc["winners"]) == sorted(
            [spec_a.hash, spec_b.hash])
        assert {w["spec_hash"] for w in doc["workloads"]} == {spec_a.hash, spec_b.hash}
        assert both == db.export_json()  # deterministic: the sorted union
        out = io.StringIO()
        export_spec(db, spec_a, dest, out)  # idempotent
        assert dest.read_text() == both and "(no change)" in out.getvalue()

        # A destination that is not an export: a SessionError naming it, the file untouched.
        from tilegen.tune.session import SessionError

        junk = tune_env / "notes.json"
        junk.write_text('{"hello": 1}\n')
        with pytest.raises(SessionError, match="notes.json.*not a tilegen tuning DB export"):
            export_spec(db, spec_a, junk, io.StringIO())
        assert junk.read_text() == '{"hello": 1}\n'


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
        got, out = _cli(argv)
        text = out + capsys.readouterr().err
        assert got == code, text
        assert f"no tuning DB at {db} (nothing tuned yet; run tilegen tune)" in text
        assert not db.parent.parent.exists()  # neither the file nor its folders
        assert not (tmp_path / "x.json").exists()
