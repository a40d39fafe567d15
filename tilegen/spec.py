"""`Spec`: the declarative description of one block-sparse attention kernel family.

A spec says *what* to compute (encoding, tile granularity of the sparsity pattern, head dim,
dtype, layout) plus the workload shape the kernel is tuned and benchmarked on. *How* to compute
it (block sizes, warps, stages, template options) lives in `tilegen.config.KernelConfig`.

Specs are frozen, validated on construction, hashable, and have a stable content hash that keys
the kernel cache, the tuning DB and the build manifests.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tilegen import encoding_registry

#: How the op is told which KV cubes each query cube attends (README "Encodings"), from the
#: encoding registry (`tilegen.encoding_registry`): "lut" (VSA: index list + optional counts),
#: "mask" (Jenga: a (B, H, NQ, NKV) block mask, turned into a LUT + counts on the device and run
#: by the LUT kernel) and "sliding_tile" (STA: a 3-D window of cubes around the query cube,
#: computed from coordinates in the kernel).
ENCODINGS = encoding_registry.names()
#: The encoding whose kernel computes each encoding: "mask" runs the LUT kernel (tilegen.encodings)
KERNEL_ENCODING = {name: e.kernel for name, e in encoding_registry.REGISTRY.items()}
#: The sliding_tile window when a spec gives none: STA's (3, 3, 3) cubes around the query cube
DEFAULT_WINDOW = (3, 3, 3)
HEAD_DIMS = (64, 128)
DTYPES = ("bf16", "fp16")
LAYOUTS = ("bshd", "bhsd")
#: Tokens per cube. 256 ((4, 8, 8): FastVideo's VSA-256, seed 002's Blackwell tiles) and 384
#: ((6, 8, 8): STA on HunyuanVideo's 30x48x80) are the Triton family's (`Backend.max_cube`).
BLOCK_SIZES = (16, 32, 64, 128, 256, 384)
#: 8-bit variants (issue #19, `tilegen.quant`): "none", INT8 Q.K with bf16 P.V, INT8 Q.K with
#: e4m3 P.V. A quantized variant meets the quantized rule (contract.md), not the bf16 one.
QUANT_MODES = ("none", "int8", "int8_fp8")

# Bumped when the meaning of a field changes, so old hashes never alias new kernels.
SPEC_SCHEMA = 1

#: Fields that change the generated kernel. Two specs with equal kernel fields compile to the
#: same source, so a winner tuned for one workload is a sound choice for another.
KERNEL_FIELDS = ("encoding", "block_q", "block_kv", "cube", "head_dim", "dtype", "layout",
                 "variable_block_sizes", "quant")
#: Fields that only describe the shape tuning and benchmarks run on (the kernel takes any).
WORKLOAD_FIELDS = ("grid", "num_heads", "topk", "batch", "window", "num_kv_heads")


def _as_int_tuple(name: str, value: Any, length: int) -> tuple[int, ...]:
    try:
        items = list(value)
    except TypeError as exc:
        raise ValueError(f"Spec.{name} must be a sequence of {length} ints, got {value!r}") from exc
    # exact ints only: 4.5 must not become 4, and True is not 1
    if len(items) != length or any(type(v) is not int or v <= 0 for v in items):
        raise ValueError(f"Spec.{name} must be {length} positive ints, got {value!r}")
    return tuple(items)


def _choice(name: str, value: Any, allowed: tuple) -> None:
    # type check first: True == 1 and 128.0 == 128 would otherwise slip through `in`
    if type(value) is not type(allowed[0]) or value not in allowed:
        raise ValueError(f"Spec.{name}={value!r} is not allowed; allowed values: {list(allowed)}")


@dataclass(frozen=True)
class Spec:
    """One kernel family. The defaults are the Wan2.2 T2V-A14B VSA fine stage (contract.md).

    Kernel fields: ``encoding``, ``block_q``/``block_kv`` (tokens per query / KV cube, i.e. the
    granularity of the sparsity pattern), ``cube`` (t, h, w cube shape; its volume is the block
    size), ``head_dim``, ``dtype``, ``layout`` and ``variable_block_sizes`` (mask the padding
    tail of partial cubes using ``vbs``; off means every cube is full and ``vbs`` is ignored)
    and ``quant`` (``QUANT_MODES``: "none", or an 8-bit recipe of `tilegen.quant`; bf16/fp16 in
    and out either way).

    Workload fields (the shape tuning and benchmarks use; the kernel accepts any shape):
    ``grid`` (latent t, h, w, in tokens; the cube grid is ``cube_grid``), ``num_heads``,
    ``topk`` (KV cubes per query cube of lut/mask; unused by sliding_tile), ``batch`` and
    ``window`` (sliding_tile only: the window in cubes, odd sizes per side, no larger than the
    cube grid; one (t, h, w) triple for every head, or a list of ``num_heads`` triples, STA's
    head specialization; None for the other encodings, (3, 3, 3) when sliding_tile gives none).
    The sliding_tile kernel reads the cube grid and the windows at run time, so they are
    workload fields too: its source does not depend on them. ``num_kv_heads`` (GQA/MQA: query
    head h reads KV head ``h // (num_heads // num_kv_heads)``; None for as many as the query
    heads) is a workload field: `tilegen.ops.block_sparse_attention` takes any group.
    """

    encoding: str = "lut"
    block_q: int = 64
    block_kv: int = 64
    cube: tuple[int, int, int] = (4, 4, 4)
    head_dim: int = 128
    dtype: str = "bf16"
    layout: str = "bshd"
    variable_block_sizes: bool = True
    grid: tuple[int, int, int] = (21, 30, 52)
    num_heads: int = 40
    topk: int = 78
    batch: int = 1
    window: Any = None
    quant: str = "none"
    num_kv_heads: int | None = None
    _hash: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _choice("encoding", self.encoding, ENCODINGS)
        _choice("head_dim", self.head_dim, HEAD_DIMS)
        _choice("dtype", self.dtype, DTYPES)
        _choice("layout", self.layout, LAYOUTS)
        _choice("block_q", self.block_q, BLOCK_SIZES)
        _choice("block_kv", self.block_kv, BLOCK_SIZES)
        _choice("quant", self.quant, QUANT_MODES)
        if not isinstance(self.variable_block_sizes, bool):
            raise ValueError(
                f"Spec.variable_block_sizes must be a bool, got {self.variable_block_sizes!r}"
            )
        object.__setattr__(self, "cube", _as_int_tuple("cube", self.cube, 3))
        object.__setattr__(self, "grid", _as_int_tuple("grid", self.grid, 3))
        for name in ("num_heads", "topk", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Spec.{name} must be a positive int, got {value!r}")
        if math.prod(self.cube) != self.block_kv:
            raise ValueError(
                f"Spec.cube={self.cube} holds {math.prod(self.cube)} tokens but "
                f"Spec.block_kv={self.block_kv}; a KV block is one cube"
            )
        if self.block_q != self.block_kv:
            raise ValueError(
                f"Spec.block_q={self.block_q} must equal Spec.block_kv={self.block_kv} for "
                "encoding 'lut': each LUT row belongs to one query cube"
            )
        object.__setattr__(self, "window", self._checked_window())
        if self.num_kv_heads is not None:
            kvh = self.num_kv_heads
            if isinstance(kvh, bool) or not isinstance(kvh, int) or kvh <= 0 \
                    or self.num_heads % kvh:
                raise ValueError(f"Spec.num_kv_heads must be a positive int dividing "
                                 f"num_heads={self.num_heads} (GQA/MQA), got {kvh!r}")
            if kvh == self.num_heads:
                object.__setattr__(self, "num_kv_heads", None)  # plain MHA: one spelling
        if self.encoding_info.has_lut_rows and self.topk > self.num_cubes:
            raise ValueError(
                f"Spec.topk={self.topk} exceeds the {self.num_cubes} KV cubes of "
                f"grid {self.grid} with cube {self.cube}"
            )
        digest = hashlib.sha256(self.canonical_json().encode()).hexdigest()
        object.__setattr__(self, "_hash", digest)

    def _checked_window(self) -> tuple | None:
        """The window in canonical form: a tuple of 3 ints, or a tuple of num_heads of them."""
        if not self.encoding_info.needs_window:
            if self.window is not None:
                windowed = ", ".join(repr(n) for n, e in encoding_registry.REGISTRY.items()
                                     if e.needs_window)
                raise ValueError(f"Spec.window applies to encoding {windowed} only, got "
                                 f"window={self.window!r} with encoding={self.encoding!r}")
            return None
        window = DEFAULT_WINDOW if self.window is None else self.window
        try:
            items = list(window)
        except TypeError:
            raise ValueError(f"Spec.window must be a (t, h, w) triple of odd ints or a list of "
                             f"them (one per head), got {window!r}") from None
        per_head = bool(items) and all(not isinstance(w, int) for w in items)
        triples = [_as_int_tuple("window", w, 3) for w in items] if per_head else [
            _as_int_tuple("window", items, 3)]
        if per_head and len(triples) != self.num_heads:
            raise ValueError(f"Spec.window lists {len(triples)} windows but Spec.num_heads="
                             f"{self.num_heads}; give one window per head, or one triple")
        grid = self.cube_grid
        for w in triples:
            if any(x % 2 == 0 for x in w):
                raise ValueError(f"Spec.window {w} has an even size; window sizes are odd "
                                 "(the query cube sits in the middle)")
            if any(x > g for x, g in zip(w, grid, strict=True)):
                raise ValueError(f"Spec.window {w} is larger than the cube grid {grid} of "
                                 f"grid {self.grid} with cube {self.cube}")
        return tuple(triples) if per_head else triples[0]

    # -- derived quantities ------------------------------------------------------------------
    @property
    def encoding_info(self) -> encoding_registry.Encoding:
        """The registry entry of the spec's encoding (`tilegen.encoding_registry`)."""
        return encoding_registry.REGISTRY[self.encoding]

    @property
    def kernel_spec(self) -> Spec:
        """The spec whose kernel computes this one: a "mask" spec runs the LUT kernel after an
        on-device mask -> LUT conversion (`tilegen.encodings`); other specs are their own."""
        if KERNEL_ENCODING[self.encoding] == self.encoding:
            return self
        return self.replace(encoding=KERNEL_ENCODING[self.encoding])

    @property
    def windows(self) -> tuple[tuple[int, int, int], ...]:
        """sliding_tile: one (t, h, w) window per head (`num_heads` of them)."""
        if self.window is None:
            raise ValueError(f"Spec.window is unset: encoding {self.encoding!r} has no window")
        if isinstance(self.window[0], tuple):
            return self.window
        return (self.window,) * self.num_heads

    @property
    def kv_per_query(self) -> float:
        """KV cubes each query cube attends: topk (lut, mask) or the mean window volume."""
        if self.encoding_info.has_lut_rows:
            return float(self.topk)
        return sum(math.prod(w) for w in self.windows) / self.num_heads

    @property
    def cube_grid(self) -> tuple[int, int, int]:
        return tuple(-(-g // c) for g, c in zip(self.grid, self.cube, strict=True))  # type: ignore[return-value]

    @property
    def num_cubes(self) -> int:
        return math.prod(self.cube_grid)

    @property
    def seq_len(self) -> int:
        """Padded, cube-major sequence length S = cubes x block."""
        return self.num_cubes * self.block_kv

    @property
    def torch_dtype(self):
        """The torch dtype of q, k, v and o (imports torch on first use)."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def hash(self) -> str:
        """sha256 of the canonical JSON: stable across processes, Python versions and hosts."""
        return self._hash

    @property
    def short_hash(self) -> str:
        return self._hash[:12]

    # -- kernel fields vs workload fields ------------------------------------------------------
    def kernel_dict(self) -> dict[str, Any]:
        """The fields that decide the generated kernel (`KERNEL_FIELDS`). A "mask" spec's
        kernel is the LUT kernel (`kernel_spec`): its kernel fields say encoding "lut", so the
        two share a kernel hash, compiled variants and tuned winners."""
        d = self.to_dict()
        d["encoding"] = KERNEL_ENCODING[self.encoding]
        return {k: d[k] for k in KERNEL_FIELDS if k in d}  # quant only where it is set

    def workload_dict(self) -> dict[str, Any]:
        """The fields that only describe the tuned / benchmarked shape (`WORKLOAD_FIELDS`)."""
        d = self.to_dict()
        return {k: d[k] for k in WORKLOAD_FIELDS if k in d}  # window only where it is set

    @property
    def kernel_hash(self) -> str:
        """sha256 of the kernel fields alone: what names a kernel in the variant key."""
        return _digest({"schema": SPEC_SCHEMA, **self.kernel_dict()})

    @property
    def workload_hash(self) -> str:
        return _digest({"schema": SPEC_SCHEMA, **self.workload_dict()})

    def workload_distance(self, other: Spec) -> float:
        """How far apart two workloads are, for picking the nearest tuned one: the sum of the
        absolute log ratios of query tokens, heads, KV cubes per query cube (`kv_per_query`)
        and batch (0 for equal workloads)."""
        def tokens(s: Spec) -> int:
            return math.prod(s.grid)

        pairs = ((tokens(self), tokens(other)), (self.num_heads, other.num_heads),
                 (self.kv_per_query, other.kv_per_query), (self.batch, other.batch))
        return sum(abs(math.log(a / b)) for a, b in pairs)

    # -- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            if not f.init:
                continue
            value = getattr(self, f.name)
            if value is None or (f.name == "quant" and value == "none"):
                continue  # window of a non-sliding_tile spec, quant "none": left out, so the
                # hashes of the specs that predate them are unchanged
            out[f.name] = _plain(value)
        return out

    def canonical_json(self) -> str:
        return json.dumps({"schema": SPEC_SCHEMA, **self.to_dict()}, sort_keys=True,
                          separators=(",", ":"))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_toml(self) -> str:
        lines = ["# tilegen kernel spec"]
        for key, value in self.to_dict().items():
            lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Spec:
        if not isinstance(data, dict):
            raise ValueError(f"a spec is a JSON object / TOML table of Spec fields, got "
                             f"{type(data).__name__}")
        data = dict(data)
        data.pop("schema", None)
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown Spec field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    @classmethod
    def from_json(cls, text: str) -> Spec:
        """A spec from JSON text: an object of fields. ValueError (with the line) on bad JSON."""
        return cls.from_dict(_parse_json(text))

    @classmethod
    def from_toml(cls, text: str) -> Spec:
        """A spec from TOML text: top-level fields or a ``[spec]`` table. ValueError (with the
        line) on bad TOML."""
        return cls.from_dict(_spec_table(_parse_toml(text)))

    @classmethod
    def from_file(cls, path: str | Path) -> Spec:
        """Read a spec from a ``.toml`` or ``.json`` file (a TOML file may use a [spec] table).

        Every problem with the file's contents (empty, not UTF-8 text, a parse error, a top
        level that is not an object/table, no fields, an unknown or invalid field) is a
        ValueError naming the file, and the line where it is known; so is a path that is a
        directory or cannot be read. A missing file is a FileNotFoundError.
        """
        path = Path(path)
        if path.suffix not in (".json", ".toml"):
            raise ValueError(f"spec file {path} must end in .toml or .json")
        if path.is_dir():
            raise ValueError(f"spec file {path} is a directory, not a file")
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise
        except OSError as exc:  # a path under a regular file, no permission, ...
            raise ValueError(f"spec file {path} cannot be read ({exc.strerror or exc})") from None
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            line = raw[:exc.start].count(b"\n") + 1
            raise ValueError(f"spec file {path}: not a text file: byte {exc.start} (line {line}) "
                             f"is not valid UTF-8; a spec file is TOML or JSON text") from None
        if not text.strip():
            raise ValueError(f"spec file {path} is empty; write the Spec fields it sets (e.g. "
                             f"head_dim = 64), or give no file for the default spec")
        try:
            if path.suffix == ".json":
                data = _parse_json(text)
            else:
                data = _spec_table(_parse_toml(text))
            if isinstance(data, dict) and not {k for k in data if k != "schema"}:
                raise ValueError("holds no Spec fields; write the fields it sets (e.g. "
                                 "head_dim = 64), or give no file for the default spec")
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"spec file {path}: {exc}") from None

    def replace(self, **changes: Any) -> Spec:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_file_or_default(cls, path: str | Path | None) -> Spec:
        """`from_file(path)`, or the default spec when no path is given (the CLI's --spec)."""
        return cls.from_file(path) if path else cls()


def _plain(value: Any) -> Any:
    """Tuples (nested too: per-head windows) as lists, for JSON and TOML."""
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def _digest(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON at line {exc.lineno}, column {exc.colno}: "
                         f"{exc.msg}") from None


def _parse_toml(text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # its message ends "(at line N, column M)"
        raise ValueError(f"invalid TOML: {exc}") from None


def _spec_table(data: dict[str, Any]) -> Any:
    """The ``[spec]`` table of a TOML document, or its top level when it has none."""
    if "spec" not in data:
        return data
    if not isinstance(data["spec"], dict):
        raise ValueError(f"'spec' must be a [spec] table of Spec fields, got "
                         f"{type(data['spec']).__name__}")
    return data["spec"]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _reject_unknown_fields(init):
    """Wrap the dataclass __init__ so an unknown keyword is a ValueError naming the field and
    the known ones (the contract's promise for invalid specs), not a bare TypeError."""
    known = tuple(f.name for f in dataclasses.fields(Spec) if f.init)

    @functools.wraps(init)  # keeps the field signature for help() and IDEs
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ValueError(f"unknown Spec field(s) {unknown}; known fields: {list(known)}")
        init(self, *args, **kwargs)

    return __init__


Spec.__init__ = _reject_unknown_fields(Spec.__init__)  # type: ignore[method-assign]
