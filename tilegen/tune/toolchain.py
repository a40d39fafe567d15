"""The toolchain key: which compiler a tuned winner was measured under.

This module is the one definition of the key. It is pure Python (no SQLAlchemy, Optuna or
torch), so `tilegen.winners`, which must work without SQLAlchemy, can use it, and so can
`tilegen.db` (which re-exports `toolchain_key` and `TOOLCHAIN_FIELDS`) and ``tilegen tune``.
It lives here rather than under ``tilegen/db/`` because importing anything from that package
runs ``tilegen/db/__init__.py``, which needs SQLAlchemy.

The key is ``"triton=<version>"``, for example ``"triton=3.6.0"``. Winners are Triton
configs, and Triton brings its own ptxas and LLVM, so its version pins the machine code. The
nvcc and clang versions, the driver and torch are recorded in the DB's environment rows but
are not part of the key: nvcc and clang only build the C++ backends, the driver and torch only
launch the kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Environment fields that make up the toolchain key, in key order.
TOOLCHAIN_FIELDS: tuple[str, ...] = ("triton",)


def toolchain_key(env: Mapping[str, Any]) -> str:
    """The toolchain key of an environment mapping, e.g. ``"triton=3.6.0"``.

    ``env`` holds environment fields (``tilegen.db.ENV_FIELDS``); only ``TOOLCHAIN_FIELDS``
    are read. ``"none"`` when none of them is set.
    """
    parts = [f"{f}={env[f]}" for f in TOOLCHAIN_FIELDS if env.get(f)]
    return " ".join(parts) if parts else "none"


def current_toolchain_key() -> str:
    """The toolchain key of this process, e.g. ``"triton=3.6.0"`` (imports triton)."""
    import triton

    return toolchain_key({"triton": triton.__version__})


__all__ = ["TOOLCHAIN_FIELDS", "current_toolchain_key", "toolchain_key"]
