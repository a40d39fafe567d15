"""Which winner to keep: one pure function, `decide`, and the names it works with.

No SQLAlchemy, no file access: `decide(old, new)` takes two `WinnerRecord`s (the stored winner,
or None, and a candidate for its place) and returns a `Decision` with a one-word reason. The DB
(`TuningDB.set_winner`), `db import` and `tilegen tune --export`'s merge all call it, so the rule
lives once and is unit-tested without a DB (tests/test_db_policy.py).

The rules, in order:

1. no stored winner: insert ("new");
2. the same variant, time and timer again: keep ("same");
3. ``force``: replace ("forced");
4. timers: a winner timed on a real device (`REAL_TIMERS`) is never replaced by one from a
   test-only timer ("fake timer"), and always replaces one ("real timer");
5. currency, where the caller knows it (``current``: the winner's variant key equals what this
   checkout renders and compiles): when exactly one of the two is current, it wins ("current" /
   "stale"): the other would only ever be reported stale;
6. comparable times (both current, or currency unknown and the same toolchain): the faster wins
   ("faster" / "slower");
7. otherwise the times are not comparable: the one recorded later wins ("newer" / "older"; a
   tie keeps the stored one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

#: The export format name (``"format"`` in every ``tilegen db export`` file).
EXPORT_FORMAT = "tilegen-tuning-db"

#: Timers that measure a real device. ``do_bench`` is `triton.testing.do_bench`: CUDA events
#: around the kernel, warmed, median. `tilegen.load` only ever uses winners timed by one of these.
REAL_TIMERS: tuple[str, ...] = ("do_bench",)

#: Test-only timers (CPU runs under the Triton interpreter): never used by `tilegen.load`, left
#: out of ``db export`` unless ``--include-fake``, never shipped.
FAKE_TIMERS: tuple[str, ...] = ("fake-deterministic",)

Action = Literal["inserted", "replaced", "kept"]


def is_real_timer(timer: str | None) -> bool:
    """True when `timer` measured a real device (see `REAL_TIMERS`)."""
    return timer in REAL_TIMERS


#: printed beside any figure a test-only timer made up
FAKE_NOTE = "fake timer: not a measurement"


def timed_figure(value: float | None, timer: str | None, fmt: str = ".4f") -> str:
    """A latency or rate as a table cell: marked "(fake)" when a test-only timer made it up."""
    if value is None:
        return "-"
    text = f"{value:{fmt}}"
    return text if is_real_timer(timer) else f"{text} (fake)"


@dataclass(frozen=True)
class WinnerRecord:
    """What the policy looks at in a winner.

    ``variant`` is the variant key as a dict (`tilegen.identity.VariantKey.to_dict`);
    ``current`` is True / False when the caller has checked the key against this checkout
    (re-render + toolchain), None when it has not.
    """

    variant: Mapping[str, Any]
    median_ms: float
    timer: str
    recorded_at: datetime
    current: bool | None = None

    @property
    def config(self) -> str:
        return str(self.variant.get("config", "?"))

    @property
    def toolchain(self) -> str:
        return str(self.variant.get("toolchain", ""))


@dataclass(frozen=True)
class Decision:
    """``replace``: take the new winner. ``reason``: the rule that decided (module docstring).
    ``inserted`` is True when there was no stored winner."""

    replace: bool
    reason: str
    inserted: bool = False

    @property
    def action(self) -> Action:
        if self.inserted:
            return "inserted"
        return "replaced" if self.replace else "kept"


def decide(old: WinnerRecord | None, new: WinnerRecord, *, force: bool = False) -> Decision:
    """Keep `old` or take `new` (see the module docstring for the rules and reasons)."""
    if old is None:
        return Decision(True, "new", inserted=True)
    if (dict(old.variant) == dict(new.variant) and old.median_ms == new.median_ms
            and old.timer == new.timer):
        return Decision(False, "same")
    if force:
        return Decision(True, "forced")
    old_real, new_real = is_real_timer(old.timer), is_real_timer(new.timer)
    if old_real != new_real:
        return Decision(new_real, "real timer" if new_real else "fake timer")
    if old.current is not None and new.current is not None and old.current != new.current:
        return Decision(bool(new.current), "current" if new.current else "stale")
    if old.current and new.current:
        comparable = True
    elif old.current is None or new.current is None:
        comparable = old.toolchain == new.toolchain
    else:  # both known stale: their times belong to other sources
        comparable = False
    if comparable:
        faster = new.median_ms < old.median_ms
        return Decision(faster, "faster" if faster else "slower")
    newer = new.recorded_at > old.recorded_at
    return Decision(newer, "newer" if newer else "older")


def explain(decision: Decision, what: str, old: WinnerRecord, new: WinnerRecord,
            new_name: str = "the imported one") -> str:
    """One line saying what happened to `old` and why (``db import``'s notes)."""

    def text(w: WinnerRecord) -> str:
        state = {True: "current", False: "stale", None: "currency unknown"}[w.current]
        return (f"{w.config}, {w.median_ms:.4g} ms, timer {w.timer}, toolchain "
                f"{w.toolchain!r}, {state}, recorded {w.recorded_at:%Y-%m-%dT%H:%M:%S}Z")

    why = {
        "forced": "--force takes the file's winner",
        "real timer": f"{new_name} was timed on a real device, the local one by a test-only timer",
        "fake timer": f"{new_name} was timed by a test-only timer",
        "current": f"only {new_name} matches the source this checkout renders and its toolchain",
        "stale": "only the local one matches the source this checkout renders and its toolchain",
        "faster": f"comparable times, {new_name} is faster",
        "slower": "comparable times, the local one is faster",
        "newer": f"times not comparable (other source or toolchain); {new_name} was recorded "
                 "later",
        "older": "times not comparable (other source or toolchain); "
                 + ("both were recorded at the same time" if old.recorded_at == new.recorded_at
                    else "the local one was recorded later"),
    }.get(decision.reason, decision.reason)
    if decision.replace:
        return f"replaced local {what} ({text(old)}) with {new_name} ({text(new)}): {why}"
    return f"kept local {what} ({text(old)}) over {new_name} ({text(new)}): {why}"


__all__ = [
    "EXPORT_FORMAT",
    "FAKE_TIMERS",
    "REAL_TIMERS",
    "Decision",
    "WinnerRecord",
    "decide",
    "explain",
    "is_real_timer",
]
