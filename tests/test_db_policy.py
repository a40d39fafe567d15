"""`tilegen.db.policy.decide`: which winner to keep, as a pure function (no DB, no files)."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tilegen.db.policy import REAL_TIMERS, WinnerRecord, decide, explain, is_real_timer

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def key(config: str = "cfg", sha: str = "a" * 64, tool: str = "triton=3.6.0") -> dict:
    return {"kernel_hash": "k" * 64, "backend": "triton", "config": config,
            "source_sha256": sha, "toolchain": tool, "target": "sm_90"}


def rec(ms: float, *, config: str = "cfg", sha: str = "a" * 64, tool: str = "triton=3.6.0",
        timer: str = "do_bench", when: datetime = T0, current: bool | None = None
        ) -> WinnerRecord:
    return WinnerRecord(key(config, sha, tool), ms, timer, when, current)


@pytest.mark.parametrize(("old", "new", "force", "want"), [
    # 1. nothing stored
    (None, rec(2.0), False, ("inserted", "new")),
    # 2. the same winner again
    (rec(2.0), rec(2.0), False, ("kept", "same")),
    # 3. force
    (rec(1.0), rec(2.0), True, ("replaced", "forced")),
    # 4. timers: real never replaced by fake, fake always replaced by real
    (rec(2.0), rec(1.0, config="b", timer="fake-deterministic"), False, ("kept", "fake timer")),
    (rec(1.0, timer="fake-deterministic"), rec(2.0, config="b"), False,
     ("replaced", "real timer")),
    # 5. currency known: the current one wins, whatever the times
    (rec(1.0, current=False), rec(2.0, config="b", current=True), False,
     ("replaced", "current")),
    (rec(2.0, current=True), rec(1.0, config="b", current=False), False, ("kept", "stale")),
    # 6. comparable: both current, or unknown with the same toolchain -> faster wins
    (rec(2.0, current=True), rec(1.0, config="b", current=True), False, ("replaced", "faster")),
    (rec(1.0, current=True), rec(2.0, config="b", current=True), False, ("kept", "slower")),
    (rec(2.0), rec(1.0, config="b"), False, ("replaced", "faster")),
    (rec(1.0), rec(2.0, config="b"), False, ("kept", "slower")),
    # 7. not comparable (other toolchain, currency unknown; or both stale): later recording wins
    (rec(1.0), rec(2.0, tool="triton=3.7.0", when=T0 + timedelta(days=1)), False,
     ("replaced", "newer")),
    (rec(1.0, when=T0 + timedelta(days=1)), rec(0.5, tool="triton=3.7.0"), False,
     ("kept", "older")),
    (rec(1.0), rec(0.5, tool="triton=3.7.0"), False, ("kept", "older")),  # tie keeps the old
    (rec(1.0, current=False), rec(2.0, sha="b" * 64, current=False,
                                  when=T0 + timedelta(hours=1)), False, ("replaced", "newer")),
])
def test_decide(old, new, force, want) -> None:
    d = decide(old, new, force=force)
    assert (d.action, d.reason) == want
    assert d.replace == (want[0] != "kept")


def test_explain_names_both_winners_and_the_rule() -> None:
    old, new = rec(1.0, current=True), rec(0.5, config="b", current=False)
    line = explain(decide(old, new), "winner of abc on NVIDIA H200", old, new)
    assert line.startswith("kept local winner of abc on NVIDIA H200 (cfg, 1 ms")
    assert "b, 0.5 ms" in line and "stale" in line and "only the local one matches" in line


def test_real_timers() -> None:
    assert REAL_TIMERS == ("do_bench",) and is_real_timer("do_bench")
    assert not is_real_timer("fake-deterministic") and not is_real_timer(None)


def test_policy_needs_no_sqlalchemy() -> None:
    script = ("import sys; sys.modules['sqlalchemy'] = None\n"
              "from tilegen.db import policy, errors\n"
              "print(policy.decide(None, policy.WinnerRecord({}, 1.0, 'do_bench', "
              "__import__('datetime').datetime.now())).action)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "inserted"
