"""The README's Python examples run as written, on the CPU, each in a fresh interpreter.

Every ```python block of README.md is run with `python3 -c` from a temporary folder, with this
checkout first on the path and without TRITON_INTERPRET (a CPU user's default: the PyTorch path).
A block whose first lines hold `# needs: gpu` is skipped without CUDA; any other `# needs: X`
marks a block that cannot run here and is skipped with that reason. There are none of the
latter today: keep it so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tilegen.paths import PACKAGE_DIR

README = PACKAGE_DIR.parent / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks() -> list[tuple[int, str]]:
    """(line number, code) of every ```python block in README.md."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def _needs(code: str) -> list[str]:
    return re.findall(r"^# needs: (.+)$", code, re.M)


def test_readme_has_python_examples():
    assert python_blocks(), f"no ```python block in {README}"


@pytest.mark.parametrize("line,code", python_blocks(),
                         ids=[f"README.md:{n}" for n, _ in python_blocks()])
def test_readme_python_block_runs(line, code, tmp_path):
    for need in _needs(code):
        if need.strip() == "gpu":
            if not torch.cuda.is_available():
                pytest.skip(f"README.md:{line} needs a GPU")
        else:
            pytest.skip(f"README.md:{line} needs {need.strip()}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PACKAGE_DIR.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (f"README.md:{line}: the python block failed\n"
                                 f"{res.stdout}\n{res.stderr}")
