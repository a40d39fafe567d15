"""`tilegen tune`: search space, failure classes, worker isolation, the fp32-oracle check of
the gate's reference, resume after a kill, several workers, export, end to end.

Everything runs on the CPU under the Triton interpreter (TRITON_INTERPRET=1) on a tiny shape;
timing uses the test-only ``fake-deterministic`` timer, but every trial still goes through the
real correctness gate (`tilegen.captures.score` against the reference variant).

The trial log is Optuna's storage: the tests read outcomes from the study's trials (state and
user attributes), and winners, candidates and environments from the tilegen DB.

The op factories below (``faulty_op``, ``held_op``, ``wrong_for_fastest``, ``wrong_reference``)
are imported by name inside spawned worker processes (``test_tune:faulty_op``), which find this
file on sys.path.
"""

from __future__ import annotations

import argparse
import io
import json
import os
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
    WorkerHandle,
    WorkerSetup,
    WorkerSetupError,
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


#: What `faulty_op` does for (block_n, num_stages): every failure class once, and two passes.
FAULTS = {
    (64, 1): "compile_error",  # Triton itself rejects a 48-row tile (not a power of 2)
    (64, 2): "out_of_resources",  # Triton's OutOfResources (shared memory)
    (64, 3): "pass",
    (64, 4): "illegal_memory_access",  # CUDA's message; the worker restarts after it
    (32, 1): "timeout",  # hangs
    (32, 2): "runtime_error",  # the worker process dies (SIGSEGV)
    (32, 3): "fail_correctness",  # one head shifted by 0.05
    (32, 4): "pass",
}
FAULT_SPACE = {"block_m": (64,), "block_n": (32, 64), "num_warps": (4,),
               "num_stages": (1, 2, 3, 4)}


def faulty_op(spec: Spec, cfg: KernelConfig, backend: str = "triton"):
    """Fault by (block_n, num_stages), see FAULTS; else the real op."""
    from triton.runtime.errors import OutOfResources

    from tilegen.ops import load

    fault = FAULTS.get((cfg.block_n, cfg.num_stages), "pass")
    if fault == "compile_error":
        return _unchecked(spec, cfg.replace(block_m=48))  # tl.arange(0, 48)
    if fault == "out_of_resources":
        raise OutOfResources(262144, 232448, "shared memory")
    if fault == "illegal_memory_access":
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel "
                           "errors might be asynchronously reported at some other API call")
    if fault == "timeout":
        time.sleep(600)
    if fault == "runtime_error":
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "fail_correctness":
        return _WrongOutput(load(spec, cfg))
    return load(spec, cfg)


def wrong_reference(spec: Spec, cfg: KernelConfig):
    """A reference op whose output is off on one head: the setup's fp32-oracle check must
    refuse to gate against it."""
    from tilegen.ops import BlockSparseAttention

    return _WrongOutput(BlockSparseAttention(spec, cfg, None, "reference"))


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


def gpu_fault_op(spec: Spec, cfg: KernelConfig, backend: str = "triton"):
    """For a GPU check of worker isolation (bench/experiments/tune_h200.sh's neighbour, not a CPU
    test): num_stages=2 reads far out of bounds; everything else is the real op."""
    from tilegen.ops import load

    op = load(spec, cfg)
    return _OutOfBounds(op) if cfg.num_stages == 2 else op


#: test_resume_after_kill's hand-off with held_op: a folder, and files in it
HOLD_DIR_ENV = "TILEGEN_TEST_HOLD_DIR"
HOLD_AFTER = 3  # builds before the held one


def held_op(spec: Spec, cfg: KernelConfig, backend: str = "triton"):
    """The real op, except that while ``$TILEGEN_TEST_HOLD_DIR/armed`` exists the build after
    HOLD_AFTER others never returns: it writes ``held`` (its config name) and waits, so a kill
    lands inside a trial whose config is recorded, whatever the machine's load. The worker's
    parent watch ends it once the session is killed."""
    from tilegen.ops import load

    hold = Path(os.environ[HOLD_DIR_ENV])
    built = len(list(hold.glob("built-*")))
    (hold / f"built-{built}").write_text(cfg.name)
    if built >= HOLD_AFTER and (hold / "armed").exists():
        (hold / "armed").unlink()
        (hold / "held.tmp").write_text(cfg.name)
        (hold / "held.tmp").rename(hold / "held")  # appears whole
        time.sleep(600)
    return load(spec, cfg)


# test_failing_trial_never_wins pins the space to 32 points, whatever the target file says
PINNED_SPACE = {"num_stages": (1, 2, 3, 4)}


def _fastest_feasible(spec: Spec) -> KernelConfig:
    space = SearchSpace.from_target(spec, get_target("sm_90"), PINNED_SPACE)
    return min(space.feasible(), key=lambda c: fake_deterministic_ms(c.name))


def wrong_for_fastest(spec: Spec, cfg: KernelConfig, backend: str = "triton"):
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


# ============================================================================ the gate's reference


def test_reference_that_fails_the_fp32_oracle_stops_the_setup(tune_env: Path) -> None:
    """At worker setup the reference variant is scored against the fp32 oracle on every
    capture; a wrong reference stops the setup loudly (no trial would be gated against it)."""
    setup = WorkerSetup(TINY.canonical_json(), seeds=(0,), timer="fake-deterministic",
                        reference_factory="test_tune:wrong_reference", oracle_check="enforce")
    handle = WorkerHandle(setup, setup_timeout_s=120)
    try:
        with pytest.raises(WorkerSetupError) as err:
            handle.start()
    finally:
        handle.close()
    msg = str(err.value)
    assert "does not pass the fp32 oracle on capture synthetic_seed0" in msg
    assert "max|Δ|=5" in msg and "-> FAIL" in msg and "no trial runs" in msg


def test_reference_passes_the_fp32_oracle(tune_env: Path) -> None:
    """The real reference variant passes the contract's rule against the fp32 oracle where the
    rule's absolute mean bound is meaningful (enough keys per row; partial cubes)."""
    spec = Spec(grid=(5, 6, 8), num_heads=2, head_dim=64, topk=3, dtype="bf16")
    setup = WorkerSetup(spec.canonical_json(), seeds=(0,), timer="fake-deterministic",
                        oracle_check="enforce")
    handle = WorkerHandle(setup, setup_timeout_s=120)
    try:
        info = handle.start()
    finally:
        handle.close()
    (cap,) = info.captures
    assert cap.reference == "reference variant" and cap.oracle.endswith("-> PASS")


def test_oracle_check_is_enforced_from_the_command_line(
        tune_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """At the tiny CPU shape bf16 outputs are too large for mean|Δ| <= 1e-4 against fp32:
    enforced, the check stops the session in one line (the test-only timer only reports it)."""
    code, out = _cli(_tune_args(tune_env, "--trials", "1", "--seeds", "1",
                                "--oracle-check", "enforce"))
    err = capsys.readouterr().err
    assert code == 2 and "rank" not in out
    assert "tilegen tune: error:" in err and "does not pass the fp32 oracle" in err


# ============================================================================ sessions


def _tune_args(tmp: Path, *extra: str) -> list[str]:
    return ["tune", "--spec", str(tmp / "tiny.toml"), "--target", "sm_90",
            "--timer", "fake-deterministic", "--timeout", "60", *extra]


def _cli(argv: list[str]) -> tuple[int, str]:
    from tilegen.db.cli import add_db_parser
    from tilegen.tune.cli import add_tune_parser

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


def _counted(study) -> list:
    """Trials with a result (the budget): COMPLETE (passed) and PRUNED (failed or infeasible)."""
    return [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]


def _measured(study) -> list:
    return [t for t in _counted(study) if t.user_attrs.get("duplicate_of") is None]


def test_failure_classes_are_recorded_and_the_session_goes_on(tune_env: Path) -> None:
    """Every failure class in one session (compile error, out of resources, wrong result,
    timeout, illegal memory access, a crashed worker): each is a PRUNED trial with its class and
    message in Optuna's trial log, the worker is respawned where needed, and the best passing
    config wins."""
    from tilegen.db import TuningDB
    from tilegen.tune.session import TuneOptions, run_session

    res = run_session(TuneOptions(
        spec=TINY, target="sm_90", timer="fake-deterministic", trials=8, timeout_s=8,
        seeds=1, space=FAULT_SPACE, op_factory="test_tune:faulty_op", progress=io.StringIO(),
        out=io.StringIO()))
    assert res.exhausted and res.trials_counted == 8 and res.sampler.startswith("exhaustive")
    assert res.counts == {"pass": 2, "compile_error": 1, "out_of_resources": 1,
                          "illegal_memory_access": 1, "timeout": 1, "runtime_error": 1,
                          "fail_correctness": 1}
    study = _study(tune_env)
    by_fault = {}
    for t in _measured(study):
        cfg = json.loads(t.user_attrs["config_json"])
        by_fault[FAULTS[(cfg["block_n"], cfg["num_stages"])]] = t
        assert t.user_attrs["timer"] == "fake-deterministic"
        assert t.user_attrs["variant"]["config"] == t.user_attrs["config"]
    for fault, t in by_fault.items():
        assert t.user_attrs["status"] == fault
        assert t.state.name == ("COMPLETE" if fault == "pass" else "PRUNED")
    assert "power of 2" in by_fault["compile_error"].user_attrs["error"]
    assert "shared memory" in by_fault["out_of_resources"].user_attrs["error"]
    assert "illegal memory access" in by_fault["illegal_memory_access"].user_attrs["error"]
    assert "exceeded 8 s" in by_fault["timeout"].user_attrs["error"]
    assert "SIGSEGV" in by_fault["runtime_error"].user_attrs["error"]
    wrong = by_fault["fail_correctness"].user_attrs
    assert "-> FAIL" in wrong["error"] and not wrong["scores"][0]["passed"]
    assert all(s["passed"] for s in by_fault["pass"].user_attrs["scores"])
    # the winner is the faster of the two passing configs, recorded with its timer
    best = min((t for t in _measured(study) if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert res.best is not None and res.best.config_name == best.user_attrs["config"]
    with TuningDB.open() as db:
        (w,) = db.winners(TINY.hash)
        assert (w.config_name, w.timer, w.trial_number) == (
            best.user_attrs["config"], "fake-deterministic", best.number)
        assert w.study == res.study and w.env_key is not None
        assert db.show(TINY.hash).workload.n_candidates == 8  # every config a worker ran


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
    assert "left out 1 winner(s) timed by a test-only timer" in out
    shipped = json.loads(export.read_text())
    assert [w["spec_hash"] for w in shipped["winners"]] == [other.hash]  # no fake winner
    progress = capsys.readouterr().err
    assert "tune [" in progress and "/8" in progress and "best" in progress
    assert "vs fp32 oracle" in progress
    assert "rank" in out and "TFLOP/s" in out and "winner" in out and "PASS" in out
    assert "[timer fake-deterministic: test only" in out
    summary = json.loads((tmp / "s.json").read_text())
    assert summary["trials_counted"] == 8 and summary["timer"] == "fake-deterministic"
    assert summary["seeds"][0]["label"] == "target default = reference"

    study = _study(tmp)
    assert len(_counted(study)) == 8 and not [t for t in study.trials
                                              if t.state.name == "RUNNING"]
    names = [t.user_attrs["config"] for t in _measured(study)]
    assert len(set(names)) == len(names)  # no config measured twice
    assert len({t.user_attrs["pid"] for t in _counted(study)}) == 1  # one session, 2 workers
    best = min((t for t in _measured(study) if t.state.name == "COMPLETE"),
               key=lambda t: t.value)
    # the fake timer is a function of the name, and it is what the objective saw
    assert best.value == fake_deterministic_ms(best.user_attrs["config"])
    assert study.trials[0].user_attrs["config"] == default_config(get_target("sm_90")).name
    assert study.trials[0].user_attrs["label"] == "target default = reference"

    winner_cfg = KernelConfig.from_dict(json.loads(best.user_attrs["config_json"]))
    # recorded, with its timer, but never used by tilegen.load (test-only timing)
    assert lookup_config(TINY, get_target("sm_90")) is None
    res = find_winner(TINY, get_target("sm_90"), shipped_dir=tmp / "none")
    assert res.status == "miss"
    with TuningDB.open() as db:
        (w,) = db.list_workloads()
        assert w.n_winners == 1 and w.n_studies == 1
        (win,) = db.winners(TINY.hash)
        assert win.config_name == winner_cfg.name and win.timer == "fake-deterministic"
    code, out = _cli(["db", "list"])
    assert code == 0 and TINY.short_hash in out
    code, out = _cli(["db", "show", TINY.hash[:8]])
    assert code == 0 and winner_cfg.name in out and "fake-deterministic" in out
    assert "fastest passing trials" in out and study.study_name in out  # read from Optuna
    code, out = _cli(["db", "export", "--out", str(tmp / "all.json"), "--include-fake"])
    assert code == 0 and len(json.loads((tmp / "all.json").read_text())["winners"]) == 1
    code, out = _cli(["db", "--db", str(tmp / "other.sqlite"), "import", str(tmp / "all.json")])
    assert code == 0 and "winners +1 new" in out
    code, out = _cli(["db", "show", "ffffffff"])
    assert code == 1


def test_failing_trial_never_wins(tune_env: Path) -> None:
    """Exhaustive search of the tiny space (32 points <= 40 trials, BruteForceSampler):
    infeasible configs are pruned before compiling, and the config the timer ranks fastest
    fails the gate."""
    from tilegen.tune.session import TuneOptions, run_session

    out = io.StringIO()
    res = run_session(TuneOptions(
        spec=TINY, target="sm_90", timer="fake-deterministic", trials=40, timeout_s=60,
        seeds=1, space=PINNED_SPACE,
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


def _wait_for(what: str, ready, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    """Poll ``ready()`` until it holds; fail early if the process ended, or after timeout_s
    (a generous bound on a loaded machine, never the thing that decides the outcome)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the session ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.05)


def test_resume_after_kill(tune_env: Path) -> None:
    """Kill a session mid-trial (SIGKILL), re-run the same command: the killed trial's
    heartbeat stops, Optuna fails it and queues its config again (its retry callback), and the
    study ends with exactly --trials counted trials, the interrupted config measured.

    The kill waits on state, not on time: held_op holds the fourth build until the kill, so
    the killed trial is known to be RUNNING with its config recorded. Optuna's own beat thread
    writes each first beat 3 s late in the killed session (tests/hooks/late_heartbeat), as it
    did on a loaded CI machine: the trial must be stale all the same (the objective beats
    first)."""
    import optuna

    tmp = tune_env
    hold = tmp / "hold"
    hold.mkdir()
    (hold / "armed").touch()
    env = {**os.environ, HOLD_DIR_ENV: str(hold)}
    cmd = [sys.executable, "-m", "tilegen.tune.cli", *_tune_args(
        tmp, "--trials", "9", "--sampler", "tpe", "--seeds", "1", "--heartbeat", "1",
        "--op-factory", "test_tune:held_op")]
    late_beat = str(Path(__file__).parent / "hooks" / "late_heartbeat")
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            env={**env, "PYTHONPATH": os.pathsep.join(
                                filter(None, (late_beat, env.get("PYTHONPATH"))))})
    try:
        _wait_for("a held build", (hold / "held").exists, proc)
    finally:
        proc.kill()  # SIGKILL: no cleanup at all
        proc.wait(60)
    held_config = (hold / "held").read_text()
    killed = _study(tmp)
    (running,) = [t for t in killed.trials if t.state.name == "RUNNING"]
    assert running.user_attrs["config"] == held_config and running.params
    # Stale once no heartbeat came for the grace period (3 x 1 s): the killed process sends
    # none, so waiting longer only adds margin.
    time.sleep(3 * 1 + 1.5)

    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming" in again.stderr and "interrupted" in again.stderr

    study = optuna.load_study(study_name=killed.study_name,
                              storage=f"sqlite:///{tmp / 'optuna.sqlite'}")
    assert not [t for t in study.trials if t.state.name == "RUNNING"]
    assert study.trials[running.number].state.name == "FAIL"
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == running.number]
    assert [t.state.name for t in retries] in (["COMPLETE"], ["PRUNED"])
    assert retries[0].params == running.params  # the interrupted config, measured after resume
    assert retries[0].user_attrs["config"] == held_config
    assert len(_counted(study)) == 9
    names = [t.user_attrs["config"] for t in _measured(study)]
    assert len(set(names)) == len(names)  # nothing measured twice


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


# ============================================================================ tune --export


def _store_winner(db, spec: Spec, cfg: KernelConfig, ms: float) -> None:
    from tilegen import backends

    key = backends.get("triton").variant_key(spec, cfg, get_target("sm_90")).to_dict()
    db.upsert_workload(spec.hash, spec.kernel_hash, spec.to_dict())
    cid = db.add_candidate(key, cfg.to_dict())
    db.set_winner(spec.hash, cid, device_name="NVIDIA H200", median_ms=ms, timer="do_bench")


def test_tune_export_merges_into_an_existing_file(tune_env: Path) -> None:
    """`tilegen tune --export F` for spec A, then spec B to the same F: both specs' winners are
    in F; exporting A again gives the same bytes."""
    from tilegen.db import TuningDB
    from tilegen.tune.session import SessionError, export_spec

    spec_a, spec_b = TINY, TINY.replace(num_heads=4)
    assert spec_a.hash != spec_b.hash and spec_a.kernel_hash == spec_b.kernel_hash
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
        assert both == db.export_json()  # deterministic: the sorted union
        out = io.StringIO()
        export_spec(db, spec_a, dest, out)  # idempotent
        assert dest.read_text() == both and "(no change)" in out.getvalue()

        # A destination that is not an export: a SessionError naming it, the file untouched.
        junk = tune_env / "notes.json"
        junk.write_text('{"hello": 1}\n')
        with pytest.raises(SessionError, match="notes.json.*not a tilegen tuning DB export"):
            export_spec(db, spec_a, junk, io.StringIO())
        assert junk.read_text() == '{"hello": 1}\n'


def test_a_trial_waits_for_a_lower_one_still_suggesting(tmp_path: Path) -> None:
    """Two workers start the same config at once: the higher-numbered trial looks while the
    lower one has not recorded its config yet. It must wait and defer, not measure it too."""
    import threading

    import optuna

    from tilegen.tune.ledger import TrialLedger

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'o.sqlite'}")
    space = SearchSpace.from_target(TINY, get_target("sm_90"), PINNED_SPACE)
    ledger = TrialLedger(optuna, study, space, sampler_seed=0)
    low, high = study.ask(), study.ask()
    high.set_user_attr("config", "bm64_bn64_w4_s3")
    # the lower trial records its config only once the higher one is known to be looking
    late = threading.Timer(0.3, lambda: low.set_user_attr("config", "bm64_bn64_w4_s3"))
    late.start()
    prior = ledger.same_config(high.number, "bm64_bn64_w4_s3")
    late.join()
    assert prior is not None and prior.number == low.number
    assert ledger.same_config(low.number, "bm64_bn64_w4_s3") is None  # the lower one runs
    other = study.ask()
    other.set_user_attr("config", "bm32_bn64_w4_s2")
    assert ledger.same_config(other.number, "bm32_bn64_w4_s2") is None
