import os

import pytest


# Kernels and cubins land in a per-session temp cache, never in the developer's ~/.cache.
@pytest.fixture(autouse=True, scope="session")
def _tilegen_cache(tmp_path_factory):
    os.environ.setdefault("TILEGEN_CACHE_DIR", str(tmp_path_factory.mktemp("tilegen-cache")))
    os.environ.setdefault("TILEGEN_DB", str(tmp_path_factory.mktemp("tilegen-db") / "t.sqlite"))
    yield


@pytest.fixture
def interpreter(monkeypatch):
    """Run generated Triton kernels under Triton's CPU interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
