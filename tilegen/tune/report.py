"""What a session prints and draws: the progress lines, the rows of the final table, the tuning
history plot. A test-only timer's figures are labelled fake wherever they appear."""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from tilegen.tune.objective import (
    FAILURE_CLASSES,
    FAKE_NOTE,
    is_fake_timer,
    ms_unit,
)


@dataclass
class TrialRow:
    """One trial of the study, as the table and the summary show it."""

    number: int
    config_name: str
    config: dict[str, Any]
    status: str
    ms: float | None
    tflops: float | None
    label: str = ""
    message: str = ""
    duplicate_of: int | None = None  # answered from that earlier trial of the same config

    @property
    def passed(self) -> bool:
        return self.status == "pass"


@dataclass
class SessionResult:
    """What a session did; `to_dict` is the ``--summary`` JSON."""

    study: str
    storage: str
    device_name: str
    target: str
    backend: str
    timer: str
    sampler: str
    trials_requested: int
    trials_counted: int
    trials_this_session: int
    wall_s: float
    counts: dict[str, int]
    space: str
    exhausted: bool
    best: TrialRow | None
    seeds: list[TrialRow]
    rows: list[TrialRow]
    winner: str
    captures: list[dict[str, Any]]
    speedup_vs: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("rows")
        # a reader of the JSON alone must see that a test-only timer's figures are not measured
        d["fake_timer"] = is_fake_timer(self.timer)
        if d["fake_timer"]:
            d["note"] = (f"{FAKE_NOTE}: timer {self.timer} derives every ms (fake-ms), tflops "
                         "and speedup_vs figure here from config names")
        return d


def print_summary(result: SessionResult, out: IO[str], *, top: int, spec_short_hash: str,
                  space_size: int) -> None:
    """The end of a session: the header, the table of the best configs, the counts, speedups
    and the winner (labelled fake under a test-only timer)."""
    fake_note = f" ({FAKE_NOTE})" if is_fake_timer(result.timer) else ""
    print(f"\ntilegen tune: spec {spec_short_hash} on {result.device_name} "
          f"({result.target}, {result.backend}), timer {result.timer}{fake_note}, study "
          f"{result.study}", file=out)
    rows = result.rows
    print_table(rows, top, out, spec_short_hash, timer=result.timer)
    if result.exhausted and len(rows) < result.trials_requested:
        print(f"\nsearch space exhausted: all {space_size} configs tried in "
              f"{len(rows)} trials (asked for {result.trials_requested})", file=out)
    dups = sum(r.duplicate_of is not None for r in rows)
    print(f"\ntrials: {len(rows)} in the study ({result.trials_this_session} run by a worker "
          f"now; {dups} repeated proposals answered from earlier results), "
          f"{', '.join(f'{k} {v}' for k, v in sorted(result.counts.items()))}; "
          f"wall {result.wall_s:.1f} s", file=out)
    for label, factor in result.speedup_vs.items():
        print(f"speedup of the best over {label}: {factor:.3f}x{fake_note}", file=out)
    print(f"winner: {result.winner}", file=out)


class Progress:
    """One line per finished trial on a non-terminal stream (logs, tests); a rich progress bar
    on a terminal."""

    def __init__(self, stream: IO[str], total: int, timer: str = "do_bench") -> None:
        from tilegen.db.tables import is_terminal

        self.stream, self.total = stream, total
        self.unit = ms_unit(timer)  # "fake-ms" for a test-only timer: never a bare "ms"
        self.lock = threading.Lock()
        self.bar: Any = None
        if is_terminal(stream):
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(TextColumn("tune"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("{task.description}"),
                                console=Console(file=stream), transient=False)
            self.task = self.bar.add_task("", total=total)

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def say(self, text: str) -> None:
        with self.lock:
            if self.bar is not None:
                self.bar.console.print(text, markup=False, highlight=False)
            else:
                print(text, file=self.stream, flush=True)

    def trial(self, done: int, row: TrialRow, best: TrialRow | None, fails: Counter) -> None:
        unit = self.unit
        what = f"{row.ms:.4f} {unit}" if row.passed and row.ms is not None else row.status
        if row.duplicate_of is not None:
            what += f" (same config as #{row.duplicate_of})"
        best_text = (f"{best.ms:.4f} {unit} (#{best.number} {best.config_name})" if best
                     else "-")
        fail_text = " ".join(f"{k}={fails[k]}" for k in (*FAILURE_CLASSES, "pruned")
                             if fails[k]) or "none"
        with self.lock:
            if self.bar is not None:
                self.bar.update(self.task, completed=min(done, self.total),
                                description=f"#{row.number} {row.config_name}: {what} | best "
                                            f"{best_text} | failures: {fail_text}")
                return
            width = 20
            filled = min(width, round(width * done / max(1, self.total)))
            print(f"tune [{'#' * filled}{'-' * (width - filled)}] {done}/{self.total}  "
                  f"#{row.number} {row.config_name}: {what}  | best {best_text}  "
                  f"| failures: {fail_text}", file=self.stream, flush=True)


def print_table(rows: list[TrialRow], top: int, out: IO[str], short_hash: str, *,
                timer: str = "do_bench") -> None:
    """The top passing configs (and the seeds), then failed or pruned ones. A test-only
    timer's columns are headed ``fake-ms`` and ``fake-TFLOP/s``, with a note under them."""
    from tilegen.db.tables import print_table as table

    fake = is_fake_timer(timer)
    ms_col, tf_col = ("fake-ms", "fake-TFLOP/s") if fake else ("ms", "TFLOP/s")

    passing = sorted((r for r in rows if r.passed and r.ms is not None
                      and r.duplicate_of is None), key=lambda r: (r.ms, r.number))
    shown: list[TrialRow] = []
    seen: set[str] = set()
    for r in passing:
        if r.config_name not in seen:
            seen.add(r.config_name)
            shown.append(r)
    shown = shown[:top]
    names = {r.config_name for r in shown}
    extra = [r for r in rows if r.label and r.config_name not in names and r.duplicate_of is None]
    extra = list({r.config_name: r for r in reversed(extra)}.values())
    cells = []
    for i, r in enumerate(shown + extra):
        note = r.label if r.passed else f"{r.label + ': ' if r.label else ''}{r.status}"
        cells.append([str(i + 1) if i < len(shown) else "-", r.number, r.config_name,
                      f"{r.ms:.4f}" if r.ms is not None else None,
                      f"{r.tflops:.4g}" if r.tflops is not None else None,
                      "PASS" if r.passed else "FAIL", note])
    table(["rank", "trial", "config", ms_col, tf_col, "gate", "note"], cells, file=out,
          right=("rank", "trial", ms_col, tf_col))
    if fake:
        print(f"({FAKE_NOTE}: timer {timer} derives each {ms_col} latency, and so each "
              f"{tf_col}, from the config's name; only the gate is real)", file=out)
    failed = [r for r in rows if r.status != "pass" and r.duplicate_of is None]
    if failed:
        print("", file=out)
        table(["trial", "config", "status", "message"],
              [[r.number, r.config_name, r.status, r.message] for r in failed[:20]],
              title="failed or pruned:", file=out, right=("trial",))
        if len(failed) > 20:
            print(f"  ... {len(failed) - 20} more (tilegen db show {short_hash})", file=out)


def history_labels(title: str, timer: str) -> tuple[str, str]:
    """The history plot's y label and title: a test-only timer's say its latencies are fake."""
    if not is_fake_timer(timer):
        return "median latency (ms)", title
    note = f"[{FAKE_NOTE}: timer {timer}]"
    return "fake latency (fake-ms, not a measurement)", f"{title}\n{note}" if title else note


def plot_history(rows: Sequence[TrialRow], path: str | Path, title: str = "", *,
                 timer: str = "do_bench") -> str:
    """Write a PNG of the tuning history (latency per trial, best so far, failures); a
    test-only timer's axis says its latencies are fake.

    Returns a one-line message; never raises for a missing matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (f"--plot {path}: matplotlib is not installed (pip install matplotlib); "
                "no plot written")
    rows = sorted(rows, key=lambda r: r.number)
    ok = [r for r in rows if r.passed and r.ms is not None]
    bad = [r for r in rows if not r.passed]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if ok:
        ax.scatter([r.number for r in ok], [r.ms for r in ok], s=18, label="pass")
        best, xs, ys = math.inf, [], []
        for r in rows:
            if r.passed and r.ms is not None:
                best = min(best, r.ms)
            if math.isfinite(best):
                xs.append(r.number)
                ys.append(best)
        ax.step(xs, ys, where="post", color="C2", label="best so far")
    if bad:
        top = max((r.ms for r in ok), default=1.0) * 1.05
        ax.scatter([r.number for r in bad], [top] * len(bad), marker="x", color="C3",
                   label="failed / pruned")
    ax.set_xlabel("trial")
    ylabel, title = history_labels(title, timer)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"tune: wrote tuning history plot {path}"
