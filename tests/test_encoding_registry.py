"""The encoding registry (`tilegen.encoding_registry`): every entry consistent with the others,
with `Spec`, with the kernel families and with the committed sources, and its functions doing
on a real (tiny, CPU) capture what the entry says. A badly registered encoding fails here."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from tilegen import backends, captures, encodings
from tilegen import encoding_registry as er
from tilegen.generated import GENERATED_SPECS
from tilegen.inputs import Shapes
from tilegen.spec import ENCODINGS, KERNEL_ENCODING, Spec

NAMES = list(er.REGISTRY)
REFS = ("validate_fn", "call_args_fn", "reference_lut_fn", "op_wrapper")


def small_spec(name: str) -> Spec:
    return Spec(encoding=name, grid=(12, 12, 16), num_heads=2, head_dim=64, dtype="fp16",
                topk=3)


# ------------------------------------------------------------------ the registry as a table

def test_registry_has_no_problems():
    assert er.problems() == []


def test_spec_constants_are_derived_from_the_registry():
    assert ENCODINGS == er.names() == tuple(er.REGISTRY)
    assert KERNEL_ENCODING == {n: e.kernel for n, e in er.REGISTRY.items()}
    assert set(er.kernel_encodings()) == set(KERNEL_ENCODING.values())


@pytest.mark.parametrize("name", NAMES)
def test_spec_follows_the_entry(name):
    e = er.REGISTRY[name]
    spec = small_spec(name)
    assert spec.encoding_info is e
    assert spec.kernel_spec.encoding == e.kernel
    assert spec.kernel_dict()["encoding"] == e.kernel
    assert spec.kernel_spec.encoding_info.kernel == e.kernel  # the kernel encoding is its own
    if e.needs_window:
        assert spec.window is not None
        assert spec.kv_per_query == sum(math.prod(w) for w in spec.windows) / spec.num_heads
    else:
        assert spec.window is None
        with pytest.raises(ValueError, match="Spec.window applies to encoding"):
            small_spec(name).replace(window=(1, 1, 1))
    if e.has_lut_rows:
        assert spec.kv_per_query == spec.topk
        with pytest.raises(ValueError, match="exceeds"):
            spec.replace(topk=spec.num_cubes + 1)
    else:
        assert spec.replace(topk=spec.num_cubes + 1).encoding == name  # topk unused


def test_get_names_the_known_encodings():
    assert er.get("mask") is er.REGISTRY["mask"]
    with pytest.raises(ValueError, match=r"allowed values: \['lut', 'mask', 'sliding_tile'\]"):
        er.get("dense")


# ---------------------------------------------------------- problems() catches bad entries

def _with(name: str, **changes) -> dict[str, er.Encoding]:
    return {**er.REGISTRY, name: dataclasses.replace(er.REGISTRY[name], **changes)}


@pytest.mark.parametrize("registry, says", [
    (_with("mask", kernel="csr"), "'csr' is not registered"),
    ({**er.REGISTRY, "mask2": dataclasses.replace(er.REGISTRY["mask"], name="mask2",
                                                   kernel="mask")},
     "runs another's kernel"),
    (_with("mask", op_wrapper=None), "names no op_wrapper"),
    (_with("lut", op_wrapper="tilegen.encodings:MaskAttention"), "names an op_wrapper"),
    (_with("sliding_tile", has_lut_rows=True), "exactly one"),
    (_with("lut", has_lut_rows=False, needs_window=True), "takes a LUT but"),
    (_with("lut", validate_fn="tilegen.inputs.validate_inputs"), "not 'module:function'"),
    (_with("lut", call_args_fn=":lut_call_args"), "not 'module:function'"),
    ({**er.REGISTRY, "LUT": er.REGISTRY["lut"]}, "another name than its own"),
])
def test_problems_finds_a_bad_entry(registry, says):
    found = er.problems(registry)
    assert any(says in p for p in found), found


# ------------------------------------------------------------- the functions the entries name

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("field", REFS)
def test_named_functions_resolve(name, field):
    ref = getattr(er.REGISTRY[name], field)
    if ref is None:
        return
    fn = er.resolve(ref)
    assert callable(fn), ref
    params = list(inspect.signature(fn).parameters.values())
    assert params and params[0].name == "spec", f"{ref} must take the spec first"
    if field == "validate_fn":
        assert "check_values" in inspect.signature(fn).parameters, ref


@pytest.mark.parametrize("name", NAMES)
def test_functions_agree_on_a_capture(name):
    """call_args -> validate -> reference_lut on one synthesized CPU capture: the op's
    arguments have the entry's pattern argument and pass its checks, and the reference LUT has
    one row per (batch, head, query cube)."""
    e = er.REGISTRY[name]
    spec = small_spec(name)
    cap = captures.synthesize_for(spec, seed=0)
    args = encodings.call_args(spec, cap)
    assert args == e.call_args(spec, cap)
    assert len(args) == (5 if e.argument is not None else 4)
    assert args[:3] == (cap["q"], cap["k"], cap["v"]) and args[-1] is cap["vbs"]
    shapes = encodings.validate(spec, *args, check_values=True)
    assert isinstance(shapes, Shapes)
    assert (shapes.batch, shapes.heads, shapes.num_q_blocks) == (
        spec.batch, spec.num_heads, spec.num_cubes)
    idx, counts = encodings.reference_lut(spec, cap)
    assert idx.dtype == torch.int32 and tuple(idx.shape[:3]) == (
        spec.batch, spec.num_heads, spec.num_cubes)
    assert counts is None or tuple(counts.shape) == tuple(idx.shape[:3])
    if e.takes_lut:  # the LUT the op takes is the reference: its checks pass on it
        encodings.validate(spec, *args[:3], idx, args[-1], check_values=True)
    # the yardstick every caller builds: the LUT spec of the reference's width is valid
    assert encodings.lut_spec(spec, idx.shape[-1]).encoding_info.takes_lut


@pytest.mark.parametrize("name", NAMES)
def test_wrap_op(name):
    e = er.REGISTRY[name]
    spec = small_spec(name)
    inner = object()
    wrapped = e.wrap_op(spec, inner)
    if e.converts:
        assert wrapped is not inner and wrapped.spec is spec
    else:
        assert wrapped is inner


# ---------------------------------------------------------------- families and committed sources

def test_every_kernel_encoding_has_a_family_and_a_committed_source():
    kernel = set(er.kernel_encodings())
    claimed: set[str] = set()
    for family in backends.names():
        own = set(backends.get(family).encodings)
        assert own <= kernel, f"{family} implements {own - kernel}, not registered kernels"
        claimed |= own
    assert kernel <= claimed, f"no family implements {kernel - claimed}"
    # the Triton family is every encoding's reference (tilegen bench, the tuner's gate)
    assert kernel <= set(backends.get("triton").encodings)
    assert {s.encoding for s in GENERATED_SPECS} == kernel
