"""Issue #19, session 36: per-instruction stall samples of one kernel launch, from
`ncu --section SourceCounters --section WarpStateStats --page source --print-source sass --csv`
(gpu_s37_ncu_source.sh writes it).

The source page has one row a SASS instruction: its address, its text and, with SourceCounters,
the warp-state sampling counts (all samples, not-issued samples, and one column a stall reason
where ncu gives them). This prints, from whatever columns of those kinds the file has:
  - the samples by opcode (the first word of the instruction, predicate and modifiers stripped);
  - the instructions that hold 1% or more of the samples, in address order, each with its stall
    columns, so that the loop's chain (which instruction waits, and on what) reads top to bottom;
  - the samples inside [--lo, --hi) (addresses, hex: the loop body from the SASS) against all;
  - where the file has one column a stall reason (`stall_*`; ncu writes the issued and the
    "(Not Issued)" share of each), the reasons' shares of the kernel, and each listed
    instruction's three largest. ncu 2025 writes no column for the GMMA stall, so an MMA
    instruction's samples can exceed what its reason columns add up to: the rest is that stall.
Column names are matched loosely (ncu's change between versions), and the columns found are
printed first, so a mismatch shows as a missing column, not a wrong number.

    python3 bench/experiments/ncu_source_summary.py FILE.csv [--lo 5a30 --hi 84e0]
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import defaultdict
from pathlib import Path


def rows_of(path: Path) -> tuple[list[str], list[list[str]]]:
    """The header and data rows of the file's source table (the first row naming "Source")."""
    lines = Path(path).read_text(errors="replace").splitlines()
    table = list(csv.reader(x for x in lines if x.startswith('"')))
    for i, row in enumerate(table):
        if any(c.strip() == "Source" for c in row):
            return row, [r for r in table[i + 1:] if len(r) == len(row)]
    raise SystemExit(f"{path}: no row names a 'Source' column (is it `--page source --csv`?)")


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--lo", default="", help="first address of a range (hex)")
    ap.add_argument("--hi", default="", help="end address of the range (hex, exclusive)")
    ap.add_argument("--min-share", type=float, default=0.01)
    args = ap.parse_args()
    header, rows = rows_of(Path(args.csv))
    col = {name: i for i, name in enumerate(header)}
    src = col["Source"]
    addr = next((i for n, i in col.items() if n.strip().lower() in ("address", "#", "pc")), None)
    sampled = [n for n in header if re.search(r"sampl", n, re.I)]
    total_col = next((n for n in sampled if re.search(r"all", n, re.I)),
                     sampled[0] if sampled else None)
    print(f"{len(rows)} instructions; address column: "
          f"{header[addr] if addr is not None else None}; sampling columns: {sampled}")
    if total_col is None:
        print("no sampling column: was SourceCounters collected?")
        return 1
    total = sum(number(r[col[total_col]]) for r in rows) or 1.0
    by_op: dict[str, float] = defaultdict(float)
    for r in rows:
        by_op[opcode(r[src])] += number(r[col[total_col]])
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    if reasons:
        shares = {c: sum(number(r[col[c]]) for r in rows) for c in reasons}
        print("\nstall reasons, share of the samples (the rest is reasons with no column):")
        for c, n in sorted(shares.items(), key=lambda kv: -kv[1]):
            if n / total >= 0.001:
                print(f"  {c[len('stall_'):]:<20} {100 * n / total:5.1f}%")
    print(f"\nsamples by opcode ({total_col}, {total:.0f} in all):")
    for op, n in sorted(by_op.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {op:<12} {n:10.0f}  {100 * n / total:5.1f}%")
    print(f"\ninstructions with >= {100 * args.min_share:.1f}% of the samples, in address order:")
    for r in rows:
        n = number(r[col[total_col]])
        if n / total >= args.min_share:
            where = r[addr] if addr is not None else ""
            if reasons:
                top = sorted(((number(r[col[c]]), c) for c in reasons), reverse=True)[:3]
                others = " ".join(f"{c[len('stall_'):]}:{100 * v / n:.0f}%" for v, c in top if v)
            else:
                others = ", ".join(f"{c}={r[col[c]]}" for c in sampled if c != total_col)
            print(f"  {where[-6:]:>6} {100 * n / total:5.1f}%  {r[src].strip()[:58]:<58} {others}")
    if args.lo and args.hi and addr is not None:
        lo, hi = int(args.lo, 16), int(args.hi, 16)
        inside = sum(number(r[col[total_col]]) for r in rows
                     if lo <= int(r[addr] or "0", 16) < hi)
        print(f"\n[{args.lo}, {args.hi}): {100 * inside / total:.1f}% of the samples")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
