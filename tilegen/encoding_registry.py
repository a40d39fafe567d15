"""The encoding registry: every way the op can be told which KV cubes each query cube attends.

One `Encoding` per encoding holds what the rest of tilegen asks of it: the encoding whose kernel
computes it (`Spec.kernel_spec`), its `Spec` field rules, the op's pattern argument, and its
behaviour (input checks, the op's arguments for a capture, the equivalent LUT, the op wrapper of
an encoding that runs another's kernel). The behaviour is named ``"module:function"`` and
imported on first use, as the backend registry's modules are: this module imports neither
torch nor any other tilegen module, so `tilegen.spec` builds `ENCODINGS` and `KERNEL_ENCODING`
from it.

To add an encoding: one entry in `REGISTRY` (its functions where their kind lives:
`tilegen.inputs` for the checks, `tilegen.encodings` for the rest) and, if it runs a kernel of
its own, its branch of the cursor macros (templates/triton/attention_macros.j2).
`tests/test_encoding_registry.py` checks every entry against the others.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["REGISTRY", "Encoding", "get", "kernel_encodings", "names", "problems"]


@dataclass(frozen=True)
class Encoding:
    """One encoding. The ``*_fn`` fields name functions as ``"module:function"``."""

    #: the value of `Spec.encoding`
    name: str
    #: the encoding whose kernel computes this one (itself, or one reached by a cheap
    #: conversion on the device: "mask" runs the LUT kernel)
    kernel: str
    #: one line for the docs and `tilegen spec`
    summary: str
    #: the op's pattern argument between v and vbs (``op(q, k, v, <argument>, vbs)``), or None
    #: when the spec alone decides the pattern (``op(q, k, v, vbs)``)
    argument: str | None
    #: the pattern is rows of `Spec.topk` cube ids per query cube (the LUT's, or a mask built
    #: from them): topk is bounded by the cube count and is the KV cubes per query cube
    has_lut_rows: bool
    #: `Spec.window` applies (and defaults to `tilegen.spec.DEFAULT_WINDOW`); other encodings
    #: refuse a window
    needs_window: bool
    #: ``validate(spec, *call_args, check_values=...) -> Shapes``: the op's input checks
    validate_fn: str
    #: ``call_args(spec, cap) -> tuple``: the op's positional arguments for a capture
    call_args_fn: str
    #: ``reference_lut(spec, cap) -> (idx, counts)``: the LUT that computes the same attention
    reference_lut_fn: str
    #: ``wrapper(spec, kernel_op)``: the op of an encoding that runs another encoding's kernel
    #: (None for an encoding that runs its own)
    op_wrapper: str | None = None

    @property
    def takes_lut(self) -> bool:
        """The op takes a LUT (``topk_idx``, optional counts) as its pattern argument."""
        return self.argument == "topk_idx"

    @property
    def converts(self) -> bool:
        """It runs another encoding's kernel after a conversion (`op_wrapper` does it)."""
        return self.kernel != self.name

    def validate(self, spec: Any, *args: Any, check_values: bool = False) -> Any:
        """The input checks of this encoding on `call_args`-shaped arguments."""
        return resolve(self.validate_fn)(spec, *args, check_values=check_values)

    def call_args(self, spec: Any, cap: dict) -> tuple:
        return resolve(self.call_args_fn)(spec, cap)

    def reference_lut(self, spec: Any, cap: dict) -> tuple:
        return resolve(self.reference_lut_fn)(spec, cap)

    def wrap_op(self, spec: Any, kernel_op: Any) -> Any:
        """The op of this encoding around the op of its kernel encoding's spec."""
        if self.op_wrapper is None:
            return kernel_op
        return resolve(self.op_wrapper)(spec, kernel_op)


def resolve(ref: str) -> Callable[..., Any]:
    """``"module:attr"`` -> the object (the module imported on first use)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


#: name -> encoding. Order is `ENCODINGS`' order (CLI choices, docs).
REGISTRY: dict[str, Encoding] = {e.name: e for e in (
    Encoding(
        name="lut", kernel="lut", argument="topk_idx", has_lut_rows=True, needs_window=False,
        summary="VSA: an index list of topk KV cubes per query cube, optional per-row counts",
        validate_fn="tilegen.inputs:validate_inputs",
        call_args_fn="tilegen.encodings:lut_call_args",
        reference_lut_fn="tilegen.encodings:capture_lut"),
    Encoding(
        name="mask", kernel="lut", argument="mask", has_lut_rows=True, needs_window=False,
        summary="Jenga: a (B, H, NQ, NKV) block mask, turned into a LUT with counts on the "
                "device and run by the LUT kernel",
        validate_fn="tilegen.inputs:validate_mask_inputs",
        call_args_fn="tilegen.encodings:mask_call_args",
        reference_lut_fn="tilegen.encodings:capture_lut",
        op_wrapper="tilegen.encodings:MaskAttention"),
    Encoding(
        name="sliding_tile", kernel="sliding_tile", argument=None, has_lut_rows=False,
        needs_window=True,
        summary="STA: a 3-D window of cubes around the query cube, computed from coordinates "
                "in the kernel",
        validate_fn="tilegen.inputs:validate_sliding_tile_inputs",
        call_args_fn="tilegen.encodings:sliding_tile_call_args",
        reference_lut_fn="tilegen.encodings:sliding_tile_reference_lut"),
)}


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def get(name: str) -> Encoding:
    """The encoding called `name`; unknown names raise ValueError listing the known ones."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"encoding={name!r} is not allowed; allowed values: "
                         f"{list(names())}") from None


def kernel_encodings() -> tuple[str, ...]:
    """The encodings that run a kernel of their own (what the templates implement)."""
    return tuple(n for n, e in REGISTRY.items() if e.kernel == n)


def problems(registry: dict[str, Encoding] | None = None) -> list[str]:
    """What is inconsistent in `registry` (the registry itself by default), without importing
    the functions the entries name (`tests/test_encoding_registry.py` resolves those)."""
    registry = REGISTRY if registry is None else registry
    out: list[str] = []
    for key, e in registry.items():
        where = f"encoding {key!r}"
        if e.name != key:
            out.append(f"{where}: registered under another name than its own ({e.name!r})")
        kernel = registry.get(e.kernel)
        if kernel is None:
            out.append(f"{where}: its kernel encoding {e.kernel!r} is not registered")
        elif kernel.kernel != kernel.name:
            out.append(f"{where}: its kernel encoding {e.kernel!r} runs another's kernel "
                       f"({kernel.kernel!r}); name that one")
        if e.converts and e.op_wrapper is None:
            out.append(f"{where}: runs the {e.kernel!r} kernel but names no op_wrapper to "
                       "convert its input")
        if not e.converts and e.op_wrapper is not None:
            out.append(f"{where}: runs its own kernel but names an op_wrapper")
        if e.has_lut_rows == e.needs_window:
            out.append(f"{where}: the pattern comes from LUT rows (topk) or a window, exactly "
                       f"one (has_lut_rows={e.has_lut_rows}, needs_window={e.needs_window})")
        if e.takes_lut and not e.has_lut_rows:
            out.append(f"{where}: takes a LUT but says it has no LUT rows")
        for field in ("validate_fn", "call_args_fn", "reference_lut_fn", "op_wrapper"):
            ref = getattr(e, field)
            if ref is not None and (not isinstance(ref, str) or ref.count(":") != 1
                                    or not all(ref.partition(":")[::2])):
                out.append(f"{where}: {field}={ref!r} is not 'module:function'")
    return out
