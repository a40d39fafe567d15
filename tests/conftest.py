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
