"""`KernelConfig`: how one kernel variant computes a spec, and the rules that make it valid.

A config has launch parameters (block sizes, warps, pipeline stages) and render-time options
(choices baked into the generated source). Its `.name` spells out every trait, so a cache
entry, a DB row and a manifest line name the same variant the same way.

The validity rules are pure predicates `(spec, target, config) -> reason | None`. Each one says
which hardware or compiler rule it mirrors, so a pruned config in a tuning log explains itself.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tilegen.spec import Spec
from tilegen.targets import Target


@dataclass(frozen=True)
class KernelConfig:
    """One variant. Launch parameters first, then render-time options.

    - ``block_m``: query rows per program; divides ``spec.block_q`` (a query cube may be split
      across programs, each walking the same LUT row).
    - ``block_n``: KV rows per inner step; divides ``spec.block_kv`` (a KV cube is walked in
      ``block_kv // block_n`` sub-tiles; sub-tiles wholly past ``vbs`` are skipped).
    - ``num_warps``, ``num_stages``: Triton launch / software-pipelining depth.
    - ``store_lse``: render the epilogue that writes ``lse`` (off when the caller drops it).
    - ``store_max_prob``: render the epilogue that writes the softmax-normalizer signal
      ``max_prob = 1 / l`` per row and its mean over the real rows of each query cube (on when
      the caller asks, ``return_max_prob=True``). Off, the rendered source is the one without the
      option, byte for byte: no extra arguments, stores or registers, and tuned winners stay
      current.
    - ``separate_kv``: render the kernels for K and V of their own length and head count
      (cross-attention ``S_q != S_kv``, GQA/MQA with query head h reading KV head
      ``h // (H_q // H_kv)``, packed variable-length batches) with the query cubes' real rows
      in their own ``q_vbs``. The op turns it on for such calls; off, the source is the one
      without it, byte for byte (no extra arguments), as for ``store_max_prob``.
    - ``options``: render-time options of one kernel family beyond the common ones, as sorted
      (name, value) pairs (e.g. the Gluon family's ring depths and pipeline switches; see
      `tilegen.backends.gluon.OPTIONS`). Empty for the Triton and C++ families.
    - ``interp_bf16``: bf16 under Triton 3.6's CPU interpreter, whose bf16 ``tl.dot``
      multiplies raw bits and whose fp32 -> bf16 cast truncates. The tiles are upcast to fp32
      before each dot, P is rounded to bf16 (nearest even) with integer ops, and the op writes
      ``o`` to an fp32 buffer that torch rounds to bf16: the same operands and roundings as the
      GPU kernel. Never built for a GPU (see `interpreter_only_options`).
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    store_lse: bool = True
    store_max_prob: bool = False
    separate_kv: bool = False
    interp_bf16: bool = False
    options: tuple[tuple[str, bool | int | str], ...] = ()

    def __post_init__(self) -> None:
        opts = self.options.items() if isinstance(self.options, dict) else self.options
        try:
            pairs = tuple(sorted((str(k), v) for k, v in opts))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"KernelConfig.options must be (name, value) pairs or a dict, "
                             f"got {self.options!r}") from exc
        for k, v in pairs:
            if type(v) not in (bool, int, str) or not k.isidentifier():
                raise ValueError(f"KernelConfig.options[{k!r}]={v!r}: names are identifiers and "
                                 "values bool, int or str")
        object.__setattr__(self, "options", pairs)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "options":
                continue
            if f.type in ("int", int):
                if type(value) is not int or value < 1:
                    raise ValueError(f"KernelConfig.{f.name} must be a positive int, "
                                     f"got {value!r}")
            elif type(value) is not bool:
                raise ValueError(f"KernelConfig.{f.name} must be a bool, got {value!r}")

    @property
    def name(self) -> str:
        """Every trait: launch parameters, then the render-time options."""
        return f"{self.launch_name}_{self.render_name}"

    @property
    def launch_name(self) -> str:
        """The launch parameters alone (what a compiled binary of one source differs by)."""
        return f"bm{self.block_m}_bn{self.block_n}_w{self.num_warps}_s{self.num_stages}"

    @property
    def render_name(self) -> str:
        """The render-time options alone, which name the source file: configs that share it
        share one source text (configs that do not may share one too, where the family passes
        an option as a constexpr at launch: the variant key hashes the text, not the name)."""
        parts = [f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in self.options]
        parts.append("lse" if self.store_lse else "nolse")
        if self.store_max_prob:
            parts.append("maxprob")
        if self.separate_kv:
            parts.append("sepkv")
        if self.interp_bf16:
            parts.append("interpbf16")
        return "_".join(parts)

    def option(self, name: str, default: Any = None) -> Any:
        """The value of render-time option `name` (``default`` when unset)."""
        return dict(self.options).get(name, default)

    def render_options(self) -> KernelConfig:
        """This config with launch parameters reset, so equal render options compare equal."""
        defaults = KernelConfig()
        return self.replace(block_m=defaults.block_m, block_n=defaults.block_n,
                            num_warps=defaults.num_warps, num_stages=defaults.num_stages)

    @property
    def launch(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["options"] = dict(self.options)
        if not d["options"]:
            del d["options"]  # the common families' dicts stay as they were
        for flag in ("store_max_prob", "separate_kv"):
            if not d[flag]:
                del d[flag]  # likewise: configs without the option keep their JSON
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown KernelConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def replace(self, **changes: Any) -> KernelConfig:
        return dataclasses.replace(self, **changes)


#: The reference variant: the contract's reference kernel (64x64 tiles, one program per query
#: cube and batch*head, online softmax with exp2, fp32 accumulation, (o, lse) out).
REFERENCE_CONFIG = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)


def fit_to_spec(cfg: KernelConfig, spec: Spec | None) -> KernelConfig:
    """Shrink the tile to the spec's blocks where it is larger (a spec with 32-token cubes
    cannot take a 64-row tile); everything else stays."""
    if spec is None:
        return cfg
    return cfg.replace(block_m=min(cfg.block_m, spec.block_q),
                       block_n=min(cfg.block_n, spec.block_kv))


def from_fields(values: dict[str, Any]) -> KernelConfig:
    """A config from flat fields: KernelConfig's own fields as they are, every other name as a
    family option (how target.toml tables and tuning points become configs)."""
    own = {f.name for f in dataclasses.fields(KernelConfig)} - {"options"}
    return KernelConfig(**{k: v for k, v in values.items() if k in own},
                        options={k: v for k, v in values.items() if k not in own})


def default_config(target: Target, spec: Spec | None = None,
                   backend: str | None = None) -> KernelConfig:
    """The target's default config for `backend` (targets/<name>/target.toml [default], or
    [default.<backend>]), fitted to `spec`."""
    fields = target.default_for(backend) if backend else dict(target.default)
    return fit_to_spec(from_fields(fields), spec)


def reference_config(spec: Spec | None = None) -> KernelConfig:
    """The reference variant for `spec` (REFERENCE_CONFIG, fitted to the spec's blocks)."""
    return fit_to_spec(REFERENCE_CONFIG, spec)


# -- validity predicates -----------------------------------------------------------------------
Predicate = Callable[[Spec, Target, KernelConfig], "str | None"]


def tiles_divide_cubes(spec: Spec, target: Target, cfg: KernelConfig) -> str | None:
    """block_m | block_q and block_n | block_kv: a tile never straddles two cubes, because the
    LUT names whole cubes and `vbs` is per cube."""
    if spec.block_q % cfg.block_m or spec.block_kv % cfg.block_n:
        return (f"block_m={cfg.block_m} must divide block_q={spec.block_q} and "
                f"block_n={cfg.block_n} must divide block_kv={spec.block_kv}")
    return None


def tiles_fit_mma(spec: Spec, target: Target, cfg: KernelConfig) -> str | None:
    """tl.dot needs every dimension >= 16 (Triton's `dot` semantic check); the smallest matrix
    instruction of every target (mma m16n8k16, MFMA 16x16x16) has a 16-row M and 16-deep K."""
    if min(cfg.block_m, cfg.block_n) < 16 or spec.head_dim % 16:
        return f"tile {cfg.block_m}x{cfg.block_n}x{spec.head_dim} has a dimension below 16"
    return None


def warps_fit_tile(spec: Spec, target: Target, cfg: KernelConfig) -> str | None:
    """num_warps is a power of two and each warp owns >= 16 rows of S = Q K^T at 4 warps per
    16-row MMA group (Triton's MMA layout tiles warps over M first); more warps than rows / 16 * 2
    leave warps idle. Threads per block stay within the target's max_threads_per_block."""
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        return f"num_warps={cfg.num_warps} is not a power of two in 1..16"
    if cfg.num_warps * target.warp_size > target.max_threads_per_block:
        return (f"num_warps={cfg.num_warps} x warp_size={target.warp_size} exceeds "
                f"max_threads_per_block={target.max_threads_per_block}")
    if cfg.num_warps > max(4, cfg.block_m // 8):
        return f"num_warps={cfg.num_warps} is more than a {cfg.block_m}-row tile can use"
    return None


def shared_memory_fits(spec: Spec, target: Target, cfg: KernelConfig) -> str | None:
    """Estimated shared memory (`shared_memory_estimate`) fits the target's per-block limit
    (sm_90/sm_100a: 227 KiB opt-in, cudaFuncAttributeMaxDynamicSharedMemorySize; gfx942:
    64 KiB LDS per workgroup). Triton raises OutOfResources past it; pruning here saves the
    compile."""
    need = shared_memory_estimate(spec, cfg, target)
    if need > target.max_shared_bytes:
        return (f"needs ~{need} B of shared memory, target {target.name} has "
                f"{target.max_shared_bytes}")
    return None


def pipeline_depth_valid(spec: Spec, target: Target, cfg: KernelConfig) -> str | None:
    """num_stages >= 1; Triton treats 0 and 1 alike (no software pipelining)."""
    if cfg.num_stages < 1 or cfg.num_stages > 8:
        return f"num_stages={cfg.num_stages} outside 1..8"
    return None


def interpreter_only_options(spec: Spec, target: Target, cfg: KernelConfig) -> str | None:
    """interp_bf16 exists only to work around the Triton 3.6 CPU interpreter's bf16 dot."""
    if cfg.interp_bf16:
        return "interp_bf16 is an interpreter-only workaround and is never built for a GPU target"
    return None


PREDICATES: tuple[Predicate, ...] = (
    tiles_divide_cubes,
    tiles_fit_mma,
    warps_fit_tile,
    shared_memory_fits,
    pipeline_depth_valid,
    interpreter_only_options,
)


def shared_memory_estimate(spec: Spec, cfg: KernelConfig, target: Target) -> int:
    """Upper bound on the shared memory / LDS Triton 3.6 allocates for the LUT kernel.

    Calibrated against `triton.compile` (tests/test_config.py checks it is never below the
    compiler's figure): on NVIDIA the Q tile stays in shared memory (a wgmma operand) and the
    pipeliner keeps up to max(stages, 3) K/V buffers, plus barriers; on AMD, Q lives in
    registers, the stream pipeliner keeps max(stages - 2, 1) K/V buffers, and a layout
    conversion scratch of max(8 KiB, BM x BN x 2) comes on top. On NVIDIA targets with
    mma.sync only (sm_80, sm_89, sm_120: Q and V reach the MMA through registers) one stage
    holds Q, K and P, stages 2-4 add one 64-row tile of the head dim and every stage past 4
    a K and a V tile (the same figures on all three, measured at head dims 64 and 128), with
    2 KiB on top for the barriers."""
    elem = 2  # bf16 / fp16
    kv_tile = 2 * cfg.block_n * spec.head_dim * elem  # one K and one V tile
    if target.vendor == "amd":
        return max(cfg.num_stages - 2, 1) * kv_tile + max(8192, cfg.block_m * cfg.block_n * elem)
    q_tile = cfg.block_m * spec.head_dim * elem
    if not any(m.kind in ("wgmma", "tcgen05") for m in target.mma):
        one_stage = q_tile + kv_tile // 2 + cfg.block_m * cfg.block_n * elem + 2048
        return (one_stage + (64 * spec.head_dim * elem if cfg.num_stages >= 2 else 0)
                + max(cfg.num_stages - 4, 0) * kv_tile)
    return q_tile + max(cfg.num_stages, 3) * kv_tile + 1024


def violations(spec: Spec, target: Target, cfg: KernelConfig) -> list[str]:
    """Every rule the config breaks, as readable reasons (empty when valid)."""
    return [r for r in (p(spec, target, cfg) for p in PREDICATES) if r]


def check(spec: Spec, target: Target, cfg: KernelConfig) -> None:
    problems = violations(spec, target, cfg)
    if problems:
        raise ValueError(f"config {cfg.name} is invalid for {target.name}: " + "; ".join(problems))
