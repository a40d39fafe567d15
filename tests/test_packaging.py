"""The wheel's package list (pyproject.toml [tool.setuptools] packages) covers every package of
the tree; .ci/wheel_check.sh then installs the wheel and uses it outside the checkout."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_in_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "tilegen").rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    data = {"tilegen._data.templates", "tilegen._data.targets", "tilegen._data.tuning_db"}
    assert listed - found == data
