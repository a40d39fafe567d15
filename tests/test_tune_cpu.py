"""Tuning on a CPU: the smoke session that ``tilegen tune --help`` names (and the README's
"Tuning on a CPU"), run as written through the real command line, and the labels of the
test-only timer's figures.

The fake-deterministic timer derives each latency from the config's name. Wherever its figures
are printed (progress lines, the final table, speedups, the winner line, the summary JSON, the
plot) they carry a fake label, so that no one takes them for measurements: never a bare "ms".
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tilegen.spec import Spec
from tilegen.tune.objective import FAKE_NOTE
from tilegen.tune.report import Progress, TrialRow, history_labels, plot_history, print_table
from tilegen.tune.session import SessionResult

ROOT = Path(__file__).resolve().parents[1]
# a figure in plain milliseconds ("1.8956 ms"); "1.8956 fake-ms" does not match
PLAIN_MS = re.compile(r"\d ms\b")


def _smoke_command() -> tuple[dict[str, str], list[str]]:
    """The environment and argv of the CPU smoke command in ``tune --help``'s epilog."""
    from tilegen.tune.cli import TUNE_EPILOG

    text = TUNE_EPILOG.replace("\\\n", " ")  # the shell's line continuation
    (line,) = [ln for ln in text.splitlines() if "cpu_smoke.toml" in ln]
    words = shlex.split(line)
    env = {}
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def test_the_help_names_the_shipped_cpu_spec() -> None:
    env, argv = _smoke_command()
    assert env == {"TRITON_INTERPRET": "1"} and argv[:2] == ["tilegen", "tune"]
    spec_file = ROOT / argv[argv.index("--spec") + 1]
    assert spec_file.is_file() and spec_file.parent == ROOT / "bench" / "specs"
    spec = Spec.from_file(spec_file)
    # the tiny workload of tests/test_tune.py: 2x2x2 cubes, small enough for the interpreter
    assert (spec.grid, spec.num_heads, spec.head_dim, spec.topk) == ((4, 4, 8), 2, 64, 2)
    assert argv[argv.index("--timer") + 1] == "fake-deterministic"
    assert "--target" in argv and "--db" in argv  # the interpreter needs a target


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, dict]:
    """The smoke command as written, from the repo root, but with its DB under a tmp dir (and
    a summary JSON beside it); returns stdout, stderr and the summary."""
    tmp = tmp_path_factory.mktemp("smoke")
    env_vars, argv = _smoke_command()
    argv[argv.index("--db") + 1] = str(tmp / "tuning.sqlite")
    argv += ["--summary", str(tmp / "summary.json")]
    exe = shutil.which("tilegen")
    cmd = ([exe] if exe else [sys.executable, "-m", "tilegen.cli"]) + argv[1:]
    env = {**os.environ, **env_vars, "TILEGEN_CACHE_DIR": str(tmp / "cache")}
    env.pop("TILEGEN_DB", None)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(p.name for p in tmp.iterdir() if p.suffix == ".sqlite") == [
        "optuna.sqlite", "tuning.sqlite"]  # Optuna's storage beside --db, nothing elsewhere
    return res.stdout, res.stderr, json.loads((tmp / "summary.json").read_text())


def test_smoke_session_runs_and_labels_progress_lines(smoke: tuple[str, str, dict]) -> None:
    _, err, summary = smoke
    lines = [ln for ln in err.splitlines() if ln.startswith("tune [")]
    assert len(lines) == summary["trials_requested"] == 4
    for ln in lines:
        assert "fake-ms" in ln and "| best " in ln and not PLAIN_MS.search(ln), ln
    assert f"latencies below are fake-ms, derived from config names ({FAKE_NOTE})" in err
    assert not PLAIN_MS.search(err)


def test_smoke_session_labels_the_table_speedups_and_winner(
        smoke: tuple[str, str, dict]) -> None:
    out, _, _ = smoke
    assert not PLAIN_MS.search(out), out
    header = next(ln for ln in out.splitlines() if ln.startswith("rank"))
    assert header.split()[3:5] == ["fake-ms", "fake-TFLOP/s"], header
    assert f"timer fake-deterministic ({FAKE_NOTE})" in out
    assert f"({FAKE_NOTE}: timer fake-deterministic derives each fake-ms latency" in out
    speedups = [ln for ln in out.splitlines() if ln.startswith("speedup of the best")]
    assert speedups and all(ln.endswith(f"x ({FAKE_NOTE})") for ln in speedups), speedups
    (winner,) = [ln for ln in out.splitlines() if ln.startswith("winner: ")]
    assert re.search(r"\(\d\.\d{4} fake-ms\) \[timer fake-deterministic: test only", winner)


def test_smoke_session_summary_says_fake(smoke: tuple[str, str, dict]) -> None:
    _, _, summary = smoke
    assert summary["timer"] == "fake-deterministic" and summary["fake_timer"] is True
    assert summary["note"].startswith(FAKE_NOTE) and "speedup_vs" in summary["note"]
    assert summary["best"]["status"] == "pass" and summary["best"]["label"] == "winner"


# ------------------------------------------------------------------ a real timer stays in ms


def _rows() -> list[TrialRow]:
    return [TrialRow(0, "bm64_bn64_w4_s3_lse", {}, "pass", 1.25, 80.0, "target default"),
            TrialRow(1, "bm64_bn32_w4_s3_lse", {}, "pass", 1.5, 66.7)]


@pytest.mark.parametrize("timer", ["do_bench", "fake-deterministic"])
def test_table_and_progress_label_only_a_fake_timer(timer: str) -> None:
    fake = timer != "do_bench"
    out = io.StringIO()
    print_table(_rows(), 10, out, "abc123", timer=timer)
    header = out.getvalue().splitlines()[0].split()
    assert header[3:5] == (["fake-ms", "fake-TFLOP/s"] if fake else ["ms", "TFLOP/s"])
    assert (FAKE_NOTE in out.getvalue()) == fake
    progress = io.StringIO()
    with Progress(progress, 2, timer) as p:
        p.trial(1, _rows()[0], _rows()[0], Counter())
    assert ("1.2500 fake-ms  |" if fake else "1.2500 ms  |") in progress.getvalue()


@pytest.mark.parametrize("timer", ["do_bench", "fake-deterministic"])
def test_summary_json_labels_only_a_fake_timer(timer: str) -> None:
    best = _rows()[0]
    res = SessionResult(
        study="s", storage="sqlite:///x", device_name="cpu", target="sm_90", backend="triton",
        timer=timer, sampler="tpe", trials_requested=2, trials_counted=2,
        trials_this_session=2, wall_s=1.0, counts={"pass": 2}, space="", exhausted=False,
        best=best, seeds=[], rows=_rows(), winner="", captures=[], speedup_vs={})
    d = json.loads(json.dumps(res.to_dict(), default=str))
    assert d["fake_timer"] is (timer != "do_bench")
    assert ("note" in d) is (timer != "do_bench")


@pytest.mark.parametrize("timer", ["do_bench", "fake-deterministic"])
def test_plot_labels_only_a_fake_timer(tmp_path: Path, timer: str) -> None:
    ylabel, title = history_labels("study", timer)
    if timer == "do_bench":
        assert (ylabel, title) == ("median latency (ms)", "study")
    else:
        assert ylabel.startswith("fake latency (fake-ms") and FAKE_NOTE in title
    pytest.importorskip("matplotlib")  # in the [test] extra; bench writes PNGs with it too
    msg = plot_history(_rows(), tmp_path / "h.png", "study", timer=timer)
    assert "wrote" in msg and (tmp_path / "h.png").stat().st_size > 0


def test_a_cuda_session_prunes_what_its_space_cannot_build(tmp_path: Path) -> None:
    """The CUDA family's sm_90 space holds points its wgmma kernel refuses (kv_tile 128 for a
    16-bit spec, shared memory over the limit): the session names its study and prunes them
    without rendering a source (the kernel's traits raise for them: session 20's first GPU
    tune stopped there). On this CPU the buildable points then fail for want of a Hopper GPU,
    each as a trial, and the session ends as one with no passing config does (exit 1)."""
    cmd = [sys.executable, "-m", "tilegen.cli", "tune", "--backend", "cuda", "--target", "sm_90",
           "--timer", "fake-deterministic", "--sampler", "grid", "--trials", "24",
           "--spec", "bench/specs/cpu_smoke.toml", "--db", str(tmp_path / "tuning.sqlite"),
           "--summary", str(tmp_path / "summary.json")]
    env = {**os.environ, "TRITON_INTERPRET": "1", "TILEGEN_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TILEGEN_DB", None)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "cannot be built as the CUDA wgmma kernel" not in res.stdout + res.stderr
    assert "winner: none (no passing trial)" in res.stdout
    counts = json.loads((tmp_path / "summary.json").read_text())["counts"]
    assert counts["pruned"] > 0 and counts["runtime_error"] > 0, counts
    assert sum(counts.values()) == 24, counts
    for line in res.stdout.splitlines():  # the table: every kv_tile 128 point pruned
        if "kv_tile128" in line:
            assert " pruned " in line, line
