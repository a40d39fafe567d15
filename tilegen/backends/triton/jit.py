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
from tilegen.backends.triton.render import TRITON_KERNEL_NAME
from tilegen.render import Source

_lock = threading.Lock()
_modules: dict[tuple[str, bool], ModuleType] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_imported_interpreted() -> bool | None:
    """Whether `triton.language` was imported in interpreter mode (None: not imported yet).

    Triton picks compiled vs interpreted for its own library functions (tl.sum, ...) at that
    import, once per process, whatever TRITON_INTERPRET says later."""
    std = sys.modules.get("triton.language.standard")
    if std is None:
        return None
    return type(std.sum).__name__ == "InterpretedFunction"


def check_interpreter_mode() -> None:
    """TRITON_INTERPRET must be set before triton is imported. Turning it on later gives
    Triton's cryptic "Cannot call @triton.jit'd outside of the scope of a kernel"; say what to
    do instead."""
    if not interpreting():
        return
    import triton.language.standard  # noqa: F401  (decides the mode if nothing did yet)

    if not triton_imported_interpreted():
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton was imported in this process; Triton "
            "decides interpreter mode at import time. Set TRITON_INTERPRET=1 in the environment "
            "before starting Python (or before the first `import triton`).")


def load_triton(source: Source, kernel: str = TRITON_KERNEL_NAME):
    """Import the kernel function `kernel` of `source` (the module is cached per source hash and
    interpreter mode)."""
    check_interpreter_mode()
    key = (source.sha256, interpreting())
    with _lock:
        # stored under every name it is loaded as (one text serves the configs whose knobs are
        # constexprs, each named by its own file), imported once per text
        path = cache.store("triton", source.sha256, source.name, source.text,
                           meta={"template": source.template, "tilegen": __version__,
                                 "sha256": source.sha256})
        module = _modules.get(key)
        if module is None:
            mod_name = f"tilegen_generated_{source.sha256[:16]}_{int(key[1])}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            spec.loader.exec_module(module)
            _modules[key] = module
    return getattr(module, kernel)
