import os

# Triton decides interpreter mode when triton.language is first imported (see
# tilegen.jit.check_interpreter_mode), so the whole test session runs with it on: CPU tensors go
# through Triton's interpreter unless a test turns the variable off to take the PyTorch path.
# AOT compilation (triton.compile for a GPUTarget) is unaffected by it.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


# Kernels and cubins land in a per-session temp cache, never in the developer's ~/.cache.
@pytest.fixture(autouse=True, scope="session")
def _tilegen_cache(tmp_path_factory):
    os.environ.setdefault("TILEGEN_CACHE_DIR", str(tmp_path_factory.mktemp("tilegen-cache")))
    # A fresh Triton cache too: compiles must really happen in the tests, as on a new machine.
    os.environ.setdefault("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
    os.environ.setdefault("TILEGEN_DB", str(tmp_path_factory.mktemp("tilegen-db") / "t.sqlite"))
    yield


@pytest.fixture
def interpreter(monkeypatch):
    """Run generated Triton kernels under Triton's CPU interpreter (explicitly, per test)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
