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


def test_every_template_file_is_in_the_wheel():
    """Each file under templates/ (Jinja templates and the C++ families' static headers)
    matches a package-data glob, so the installed package renders and compiles what the
    checkout does."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = setuptools["package-data"]["tilegen._data.templates"]
    root = ROOT / setuptools["package-dir"]["tilegen._data.templates"]
    missing = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
               and "__pycache__" not in p.parts
               and not any(p.relative_to(root).match(g) or p.match(g) for g in globs)]
    assert not missing, f"template files no package-data glob ships: {missing}"
