"""Progress and tables come from rich on a terminal and are plain text otherwise (issue 7)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

from tilegen.db.tables import is_terminal, print_table


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_when_not_a_terminal() -> None:
    out = io.StringIO()
    print_table(["config", "ms"], [["bm64_bn64_w4_s3_lse", "1.2500"], ["bm32", None]],
                title="winners:", file=out, right=("ms",))
    assert out.getvalue() == ("winners:\n"
                              "config                   ms\n"
                              "-------------------  ------\n"
                              "bm64_bn64_w4_s3_lse  1.2500\n"
                              "bm32                      -\n")


def test_rich_on_a_terminal() -> None:
    out = _Tty()
    assert is_terminal(out) and not is_terminal(io.StringIO()) and not is_terminal(None)
    print_table(["config", "ms"], [["bm64_bn64_w4_s3_lse", "1.2500"]], file=out)
    text = out.getvalue()
    assert "bm64_bn64_w4_s3_lse" in text and "─" in text  # a rich box, not dashes


def test_tune_progress_is_a_rich_bar_on_a_terminal() -> None:
    from collections import Counter

    from tilegen.tune.report import Progress, TrialRow

    row = TrialRow(0, "bm64_bn64_w4_s3_lse", {}, "pass", 1.5, None)
    plain = io.StringIO()
    with Progress(plain, 4) as p:
        p.trial(1, row, row, Counter())
    assert plain.getvalue().startswith("tune [#####---------------] 1/4  #0 bm64_bn64_w4_s3_lse")
    tty = _Tty()
    with Progress(tty, 4) as p:
        assert p.bar is not None
        p.trial(1, row, row, Counter())
    assert "━" in tty.getvalue() and "#####" not in tty.getvalue()  # a rich bar


def test_db_package_never_imports_tune() -> None:
    """tilegen/db is below tilegen/tune: no import of tilegen.tune anywhere in it."""
    root = Path(__file__).resolve().parents[1] / "tilegen" / "db"
    offenders = [p.name for p in root.glob("*.py") if "tilegen.tune" in p.read_text()]
    assert offenders == []
    import subprocess

    code = ("import sys, tilegen.db.cli, tilegen.db.records, tilegen.db.exchange; "
            "print(any(m.startswith('tilegen.tune') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=root.parents[1])
    assert out.stdout.strip() == "False", out.stderr
