"""Turn a rendered Triton source into an importable kernel (JIT path).

The source is stored in the kernel cache under its own sha256 and imported from there: Triton's
@jit reads the function's source file, so the module must live in a real file.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from types import ModuleType

from tilegen import __version__, cache
from tilegen.render import TRITON_KERNEL_NAME, Source

_lock = threading.Lock()
_modules: dict[tuple[str, bool], ModuleType] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def load_triton(source: Source):
    """Import the kernel function of `source` (cached per source hash and interpreter mode)."""
    key = (source.sha256, interpreting())
    with _lock:
        module = _modules.get(key)
        if module is None:
            path = cache.store("triton", source.sha256, source.name, source.text,
                               meta={"template": source.template, "tilegen": __version__,
                                     "sha256": source.sha256})
            mod_name = f"tilegen_generated_{source.sha256[:16]}_{int(key[1])}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            spec.loader.exec_module(module)
            _modules[key] = module
    return getattr(module, TRITON_KERNEL_NAME)
