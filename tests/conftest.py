import os

# Triton decides interpreter mode when triton.language is first imported (see
# tilegen.backends.triton.jit.check_interpreter_mode), so the whole test session runs with it on:
# CPU tensors go through Triton's interpreter unless a test turns the variable off to take the
# PyTorch path.
# AOT compilation (triton.compile for a GPUTarget) is unaffected by it.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


# Kernels, cubins, Triton's own cache and the tuning DB land in per-session temp folders, never
# in the developer's ~/.cache (and compiles really happen, as on a new machine).
@pytest.fixture(autouse=True, scope="session")
def _tilegen_cache(tmp_path_factory):
    os.environ["TILEGEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("tilegen-cache"))
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    os.environ["TILEGEN_DB"] = str(tmp_path_factory.mktemp("tilegen-db") / "t.sqlite")
    yield


@pytest.fixture
def interpreter(monkeypatch):
    """Run generated Triton kernels under Triton's CPU interpreter (explicitly, per test)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def pytorch_path_run(tmp_path):
    """``run(module, call)``: ``module.call`` in a fresh process without TRITON_INTERPRET,
    so the CPU op takes its PyTorch path (the variable is read once, at Triton's import); the
    test fails with the child's stderr unless the call returns."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))

    def run(module: str, call: str) -> None:
        code = (f"import sys; sys.path.insert(0, {tests!r})\n"
                f"import {module} as t\nt.{call}\nprint('ok')\n")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(tests)] + [p for p in [env.get("PYTHONPATH")] if p])
        res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]

    return run
