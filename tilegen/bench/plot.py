"""The bench plot: latency and TFLOP/s against sparsity (matplotlib, optional)."""

from __future__ import annotations

import statistics
from pathlib import Path

from tilegen.bench.report import Row


def plot_series(rows: list[Row]) -> dict[str, list[tuple[float, float, float | None]]]:
    """Per variant: sorted (sparsity %, median ms_op, median TFLOP/s) over the captures of each
    TOPK (rows with a timing only; backward rows are left out of the plot)."""
    groups: dict[str, dict[float, list[Row]]] = {}
    for r in rows:
        if r.ms_op is None or r.kind == "backward":
            continue
        groups.setdefault(r.variant, {}).setdefault(round(100 * r.sparsity, 3), []).append(r)
    out = {}
    for variant, by_x in groups.items():
        series = []
        for x in sorted(by_x):
            rs = by_x[x]
            tfl = [r.tflops for r in rs if r.tflops is not None]
            series.append((x, statistics.median(r.ms_op for r in rs),  # type: ignore[misc]
                           statistics.median(tfl) if tfl else None))
        out[variant] = series
    return out


def plot(rows: list[Row], path: str | Path, title: str = "") -> str:
    """Two panels, latency and TFLOP/s against sparsity, one line per variant. Returns a
    one-line message (the path written, or why nothing was: matplotlib is optional)."""
    series = plot_series(rows)
    if not series:
        return "plot: no timed rows, nothing to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import ScalarFormatter
    except ImportError:
        return "plot: skipped (matplotlib is not installed; pip install matplotlib)"
    ticks = {round(100 * r.sparsity, 3): r.topk for r in rows
             if r.ms_op is not None and r.kind != "backward"}
    fig, (ax_ms, ax_tf) = plt.subplots(1, 2, figsize=(13, 5))
    for variant, pts in series.items():
        style = "-" if variant in ("default", "config", "reference") else "--"
        ax_ms.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=variant)
        tf = [(p[0], p[2]) for p in pts if p[2] is not None]
        if tf:
            ax_tf.plot([p[0] for p in tf], [p[1] for p in tf], style, marker="o", label=variant)
    ax_ms.set(ylabel="median ms, the op as users call it", yscale="log",
              title="latency vs sparsity")
    ax_ms.yaxis.set_major_formatter(ScalarFormatter())
    ax_ms.yaxis.set_minor_formatter(ScalarFormatter())
    ax_tf.set(ylabel="TFLOP/s on real keys", title="throughput vs sparsity")
    for ax in (ax_ms, ax_tf):
        ax.set_xticks(sorted(ticks), [f"{x:g}%\nK={ticks[x]}" for x in sorted(ticks)])
        ax.set_xlabel("sparsity (share of KV cubes skipped), TOPK")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: wrote {path}"


