"""The JIT loader: cache files, atomic writes, and the interpreter-mode guard."""

import subprocess
import sys

from tilegen import KernelConfig, Spec, cache
from tilegen.backends.triton.jit import load_triton
from tilegen.backends.triton.render import render_triton


def test_rendered_source_lands_in_cache_under_its_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(tmp_path))
    src = render_triton(Spec(head_dim=64), KernelConfig(), None)
    fn = load_triton(src)
    path = tmp_path / "triton" / src.sha256[:2] / src.sha256 / src.name
    assert path.read_text() == src.text
    assert (path.parent / "meta.json").exists()
    assert fn is load_triton(src)  # imported once per process
    assert not list(tmp_path.rglob("*.tmp"))


def test_atomic_write_replaces_whole_file(tmp_path):
    p = cache.atomic_write(tmp_path / "a" / "f.txt", "one")
    cache.atomic_write(p, "two")
    assert p.read_text() == "two" and [x.name for x in p.parent.iterdir()] == ["f.txt"]


def test_interpreter_turned_on_after_import_gives_a_clear_error():
    code = ("import os, triton.language\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "from tilegen import Spec, KernelConfig\n"
            "from tilegen.backends.triton.jit import load_triton\n"
            "from tilegen.backends.triton.render import render_triton\n"
            "load_triton(render_triton(Spec(), KernelConfig(), None))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode != 0
    assert "set after triton was imported" in res.stderr
