"""Rows of a bench run, their JSON, the text table and the progress reporter."""

from __future__ import annotations

import dataclasses
import datetime
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tilegen import captures
from tilegen.bench.plan import BACKWARD_FLOPS_FORMULA, FLOPS_FORMULA, Plan

# ============================================================================ rows


@dataclass
class Row:
    """One line of the bench: one variant on one capture (see the module docstring)."""

    capture: str
    variant: str
    kind: str  # "tilegen", "peer", "oracle" or "backward"
    backend: str
    config: str
    topk: int
    num_kv_blocks: int
    sparsity: float  # 1 - TOPK / NKV
    grid: list[int]
    heads: int
    batch: int
    seq_len: int
    head_dim: int
    seed: int | None = None
    config_source: str | None = None
    ms_op: float | None = None
    ms_bare: float | None = None
    ms_custom_op: float | None = None
    ms_mask: float | None = None
    first_call_s: float | None = None
    flops: float | None = None
    flops_slots: float | None = None
    tflops: float | None = None
    tflops_bare: float | None = None
    tflops_slots: float | None = None
    speedup: float | None = None
    speedup_bare: float | None = None
    passed: bool | None = None  # None: not scored (dense peers)
    scored_against: str | None = None
    finite: bool | None = None
    min_head_cos: float | None = None
    max_abs: float | None = None
    mean_abs: float | None = None
    score: str | None = None
    #: "bf16" (contract's rule) or "quantized" (the 8-bit rows: `captures.quant_score`)
    rule: str | None = None
    cos: float | None = None
    rel_l1: float | None = None
    emul_max_ratio: float | None = None
    emul_mean_ratio: float | None = None
    heads_checked: list[int] | None = None
    error: str | None = None
    note: str | None = None
    device: str | None = None
    torch: str | None = None
    triton: str | None = None
    date: str | None = None

    def set_score(self, s: captures.Score, against: str) -> None:
        self.passed, self.scored_against, self.finite = s.passed, against, s.finite
        self.min_head_cos, self.max_abs, self.mean_abs = s.min_head_cos, s.max_abs, s.mean_abs
        self.score, self.rule = str(s), "bf16"

    def set_quant_score(self, s: captures.QuantScore, against: str) -> None:
        """The quantized rule's result and its margins (an 8-bit row)."""
        self.passed, self.scored_against, self.finite = s.passed, against, s.finite
        self.min_head_cos, self.cos, self.rel_l1 = s.min_head_cos, s.cos, s.rel_l1
        self.emul_max_ratio, self.emul_mean_ratio = s.emul_max_ratio, s.emul_mean_ratio
        self.score, self.rule = str(s), "quantized"

    def set_flops(self, flops: float, flops_slots: float) -> None:
        self.flops, self.flops_slots = flops, flops_slots
        self.update_rates()

    def update_rates(self) -> None:
        if self.flops is not None and self.ms_op:
            self.tflops = self.flops / self.ms_op / 1e9
            self.tflops_slots = (self.flops_slots / self.ms_op / 1e9
                                 if self.flops_slots is not None else None)
        if self.flops is not None and self.ms_bare:
            self.tflops_bare = self.flops / self.ms_bare / 1e9

    def add_note(self, text: str) -> None:
        text = " ".join(str(text).split())[:1000]
        self.note = text if not self.note else f"{self.note}; {text}"

    def fail(self, exc: BaseException | str) -> None:
        """Record an error: the row failed (tilegen rows) or did not run (peers)."""
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        text = " ".join(text.split())[:2000]
        self.error = text if self.error is None else f"{self.error}; {text}"
        if not self.is_peer or self.passed is not None:
            self.passed = False

    @property
    def is_peer(self) -> bool:
        """Peers (forward, and the backward's flex row) never change the exit status."""
        return self.kind == "peer" or (self.kind == "backward" and self.backend == "flex")

    @property
    def ok(self) -> bool:
        """Counts toward the exit status: tilegen and oracle rows must pass, with no error;
        backward rows must have no error and not fail their score (the inverse map and a
        ``fwd+bwd`` that could not run this spec's kernel are timed only)."""
        if self.is_peer:
            return True
        if self.kind == "backward":
            return self.error is None and self.passed is not False
        return self.passed is True and self.error is None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def fill_speedups(rows: list[Row]) -> None:
    """speedup = the reference variant's ms / this row's ms, per capture (op and bare)."""
    refs = {r.capture: r for r in rows if r.variant == "reference" and r.kind == "tilegen"}
    for r in rows:
        if r.kind == "backward":
            continue  # the forward reference is no base for a backward timing
        ref = refs.get(r.capture)
        if ref is None:
            continue
        if r.ms_op and ref.ms_op:
            r.speedup = ref.ms_op / r.ms_op
        if r.ms_bare and ref.ms_bare:
            r.speedup_bare = ref.ms_bare / r.ms_bare


def environment() -> dict[str, str]:
    import tilegen

    env = {"torch": torch.__version__, "tilegen": tilegen.__version__,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        env["triton"] = "missing"
    return env


def results_json(plan: Plan, rows: list[Row], env: dict[str, str],
                 command: str | None = None) -> dict[str, Any]:
    """The JSON document `tilegen bench` writes (schema "tilegen.bench/1")."""
    doc = {
        "schema": "tilegen.bench/1",
        "date": env.get("date"),
        "command": command,
        "device": env.get("device"),
        "torch": env.get("torch"),
        "triton": env.get("triton"),
        "tilegen": env.get("tilegen"),
        "spec": plan.spec.to_dict(),
        "captures": plan.captures,
        "topks": plan.topks,
        "seeds": plan.seeds,
        "flops_formula": FLOPS_FORMULA,
        "timing": {"timer": "triton.testing.do_bench", "return_mode": "median",
                   "warmup_ms": plan.warmup_ms, "rep_ms": plan.rep_ms},
        "variants": [dataclasses.asdict(v) for v in plan.variants],
        "passed": all(r.ok for r in rows),
        "rows": [r.to_dict() for r in rows],
    }
    if plan.backward:  # only with --backward: the JSON without it is unchanged
        doc["backward_flops_formula"] = BACKWARD_FLOPS_FORMULA
        doc["backward_variants"] = [dataclasses.asdict(v) for v in plan.backward_variants]
    return doc


def write_json(path: str | Path, doc: dict[str, Any]) -> Path:
    import json

    from tilegen.cache import atomic_write

    return atomic_write(path, json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")


# ============================================================================ table and plot


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def verdict(r: Row) -> str:
    if r.error:
        return ("ERROR " if r.passed is not None else "SKIPPED ") + r.error[:90]
    if r.passed is None:
        return "not scored"
    if r.passed:
        return "PASS"
    return ("FAIL " + ("non-finite " if not r.finite else "")
            + f"cos {_fmt(r.min_head_cos, '.6f')} max {_fmt(r.max_abs, '.1e')} "
              f"mean {_fmt(r.mean_abs, '.1e')}")


TABLE_COLUMNS = ("capture", "TOPK", "sparsity", "variant", "config", "ms op", "ms bare",
                 "TFLOP/s", "x ref", "result")


def _short_capture(r: Row) -> str:
    return f"seed{r.seed}" if r.capture.startswith("synthetic_seed") else r.capture


def table_cells(rows: list[Row]) -> list[tuple[str, ...]]:
    out = []
    for r in rows:
        ms_op = _fmt(r.ms_op, ".3f")
        if r.ms_custom_op is not None:
            ms_op += f" ({r.ms_custom_op:.3f})"
        out.append((_short_capture(r), str(r.topk), f"{100 * r.sparsity:.1f}%", r.variant,
                    r.config[:40], ms_op, _fmt(r.ms_bare, ".3f"), _fmt(r.tflops, ".1f"),
                    _fmt(r.speedup, ".2f"), verdict(r)))
    return out


def format_table(rows: list[Row]) -> str:
    """The plain-text table (the rich one has the same cells)."""
    cells = [TABLE_COLUMNS, *table_cells(rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(TABLE_COLUMNS) - 1)]
    lines = []
    for n, c in enumerate(cells):
        lines.append("  ".join(x.ljust(w) if i in (0, 3, 4) else x.rjust(w)
                               for i, (x, w) in enumerate(zip(c, widths, strict=False)))
                     + "  " + c[-1])
        if n == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


TABLE_FOOTNOTE = ("ms op: the op as users call it (default: block_sparse_attention in brackets); "
                  "ms bare: op.launch with validated shapes, preallocated out, no lse; "
                  "x ref: the reference variant's ms op / this ms op; TFLOP/s on real keys")


BACKWARD_FOOTNOTE = ("backward rows: ms op is the timed call (fwd+bwd: the whole step; bwd "
                     "kernels: launch_backward, inverse map prebuilt), TFLOP/s nominal (2.5x the "
                     "forward's FLOPs per backward), result the grad rule on dq, dk, dv")


def print_table(rows: list[Row], file=None) -> None:
    file = file or sys.stdout
    backward = any(r.kind == "backward" for r in rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(rows), file=file)
        print(TABLE_FOOTNOTE, file=file)
        if backward:
            print(BACKWARD_FOOTNOTE, file=file)
        return
    console = Console(file=file, width=None if file.isatty() else 200)
    table = Table(*TABLE_COLUMNS, title="tilegen bench",
                  caption=TABLE_FOOTNOTE + ("; " + BACKWARD_FOOTNOTE if backward else ""))
    for c in table_cells(rows):
        style = ("red" if c[-1].startswith(("FAIL", "ERROR")) else
                 "green" if c[-1] == "PASS" else None)
        table.add_row(*c, style=style)
    console.print(table)


# ============================================================================ progress


class Reporter:
    """A rich progress bar when rich is importable and stdout is a terminal, else plain lines."""

    def __init__(self, total: int, plain: bool | None = None, file=None) -> None:
        self.file = file or sys.stdout
        self.total, self.done = total, 0
        self._progress = self._task = None
        if plain is None:
            plain = not (hasattr(self.file, "isatty") and self.file.isatty())
        if not plain:
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                )
            except ImportError:
                plain = True
            else:
                self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                          MofNCompleteColumn(), TimeElapsedColumn(),
                                          console=Console(file=self.file))
        self.plain = plain

    def __enter__(self) -> Reporter:
        if self._progress is not None:
            self._progress.start()
            self._task = self._progress.add_task("tilegen bench", total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def status(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=text)

    def step(self, text: str) -> None:
        """One unit of work finished; `text` says what it gave."""
        self.done += 1
        if self._progress is not None:
            self._progress.update(self._task, advance=1)
            self._progress.console.print(text, highlight=False, markup=False)
        else:
            print(f"[{self.done}/{self.total}] {text}", file=self.file, flush=True)

    def log(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=self.file, flush=True)


