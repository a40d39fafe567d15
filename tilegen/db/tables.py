"""Tables and progress for ``tilegen db`` and ``tilegen tune``: `rich` on a terminal, plain
text otherwise (pipes, files, CI logs and tests see aligned columns without colour or boxes).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import IO, Any


def is_terminal(stream: IO[str] | None) -> bool:
    """True when `stream` is an interactive terminal (then rich renders)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):
        return False


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
                title: str | None = None, file: IO[str] | None = None,
                right: Sequence[str] = ()) -> None:
    """Print a table: a rich `Table` on a terminal, else plain aligned text.

    ``right`` names the columns aligned right (numbers). Cells are converted with ``str``;
    None prints as "-".
    """
    out = file if file is not None else sys.stdout
    cells = [["-" if c is None else str(c) for c in row] for row in rows]
    if is_terminal(out):
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for col in columns:
            table.add_column(col, justify="right" if col in right else "left")
        for row in cells:
            table.add_row(*row)
        Console(file=out).print(table)
        return
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if col in right else v.ljust(w)
                 for v, w, col in zip(values, widths, columns, strict=True)]
        return "  ".join(parts).rstrip()

    if title:
        print(title, file=out)
    print(line(list(columns)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in cells:
        print(line(row), file=out)


__all__ = ["is_terminal", "print_table"]
