"""ROCm launcher for the HIP backend: load the gfx942 code object and launch it on torch tensors.

Uses hip-python (``pip install hip-python``, imported lazily: tilegen imports without it).
No AMD GPU was available while this was written, so this path has never run on hardware; the
parts that can be checked without one are pure functions the tests cover: `kernel_args` /
`pack_kernargs` (the kernarg buffer, checked against the code object's metadata) and
`launch_geometry` (grid and block, used by the CPU executor that runs the HIP source in the
tests, `tilegen.backends.hip.host`).
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tilegen.backends.hip.plan import HIP_KERNEL_NAME, HipPlan, plan_for
from tilegen.compile import Artifact
from tilegen.config import KernelConfig
from tilegen.inputs import Shapes, check_sm_scale, needs_grad, validate_inputs
from tilegen.maxprob import AttentionOutput, empty_buffers
from tilegen.reference import LOG2E
from tilegen.spec import Spec
from tilegen.targets import Target

#: The kernel's parameters in order: (name, struct format). Pointers are 8 bytes, the scalars
#: 4; each sits at the next multiple of its size (the AMDGPU kernarg ABI, same as C).
KERNEL_PARAMS: tuple[tuple[str, str], ...] = (
    ("q", "Q"), ("k", "Q"), ("v", "Q"), ("topk_idx", "Q"), ("counts", "Q"), ("vbs", "Q"),
    ("o", "Q"), ("lse", "Q"),
    ("seq_len", "i"), ("num_heads", "i"), ("num_q_blocks", "i"), ("topk", "i"),
    ("qk_scale", "f"),
)
#: Inserted after ``lse`` when the kernel is rendered with ``store_max_prob``.
MAX_PROB_PARAMS: tuple[tuple[str, str], ...] = (("max_prob", "Q"), ("max_prob_cube", "Q"))


def kernel_params(store_max_prob: bool = False) -> tuple[tuple[str, str], ...]:
    """The kernel's parameters: `KERNEL_PARAMS`, with `MAX_PROB_PARAMS` after lse when the
    kernel writes the softmax-normalizer signal."""
    if not store_max_prob:
        return KERNEL_PARAMS
    at = [name for name, _ in KERNEL_PARAMS].index("lse") + 1
    return KERNEL_PARAMS[:at] + MAX_PROB_PARAMS + KERNEL_PARAMS[at:]


@dataclass(frozen=True)
class KernArg:
    name: str
    fmt: str  # struct format character
    offset: int
    size: int


def kernel_args(store_max_prob: bool = False) -> list[KernArg]:
    """Offsets and sizes of the explicit kernel arguments in the kernarg segment."""
    out, offset = [], 0
    for name, fmt in kernel_params(store_max_prob):
        size = struct.calcsize(fmt)
        offset = -(-offset // size) * size  # natural alignment
        out.append(KernArg(name, fmt, offset, size))
        offset += size
    return out


def kernarg_size(store_max_prob: bool = False) -> int:
    last = kernel_args(store_max_prob)[-1]
    return last.offset + last.size


def pack_kernargs(values: dict[str, int | float]) -> bytes:
    """The kernarg buffer for `values` (every name of KERNEL_PARAMS, plus max_prob and
    max_prob_cube for a kernel with the signal; pointers as ints, a null counts pointer as 0),
    little-endian, laid out by `kernel_args`."""
    store_max_prob = "max_prob" in values
    missing = sorted({name for name, _ in kernel_params(store_max_prob)} - set(values))
    if missing:
        raise ValueError(f"kernel arguments missing: {missing}")
    buf = bytearray(kernarg_size(store_max_prob))
    for arg in kernel_args(store_max_prob):
        struct.pack_into("<" + arg.fmt, buf, arg.offset, values[arg.name])
    return bytes(buf)


def launch_geometry(plan: HipPlan, shapes: Shapes) -> tuple[tuple[int, int, int],
                                                           tuple[int, int, int]]:
    """(grid, block): one workgroup per (block_m rows of a query cube, batch * head)."""
    return plan.grid(shapes.batch, shapes.heads, shapes.num_q_blocks), plan.block


def kernel_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_idx: torch.Tensor,
                  vbs: torch.Tensor, counts: torch.Tensor | None, o: torch.Tensor,
                  lse: torch.Tensor | None, shapes: Shapes, qk_scale: float,
                  max_prob_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """The argument values of one launch (device pointers as ints); ``max_prob_out`` (the
    signal's buffers, the cube one zeroed) for a kernel rendered with ``store_max_prob``."""
    extra = {} if max_prob_out is None else {
        "max_prob": max_prob_out[0].data_ptr(), "max_prob_cube": max_prob_out[1].data_ptr()}
    return {**extra,
        "q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(),
        "topk_idx": topk_idx.data_ptr(), "counts": 0 if counts is None else counts.data_ptr(),
        "vbs": vbs.data_ptr(), "o": o.data_ptr(), "lse": 0 if lse is None else lse.data_ptr(),
        "seq_len": shapes.seq_len, "num_heads": shapes.heads,
        "num_q_blocks": shapes.num_q_blocks, "topk": shapes.topk, "qk_scale": qk_scale,
    }


def check_alignment(**tensors: torch.Tensor) -> None:
    """The kernel moves q, k, v and o in 16-byte pieces: their storage must be 16-byte aligned."""
    for name, t in tensors.items():
        if t.data_ptr() % 16:
            raise ValueError(f"{name} is not 16-byte aligned (data_ptr % 16 = "
                             f"{t.data_ptr() % 16}); pass {name}.clone()")


def _hip():
    try:
        from hip import hip  # type: ignore[import-not-found]
    except ImportError as exc:
        raise RuntimeError("the HIP backend's launcher needs hip-python on a ROCm machine: "
                           "pip install hip-python (matching your ROCm version)") from exc
    return hip


def _check(hip, result):
    """hip-python returns (err, *values): raise on any error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != hip.hipError_t.hipSuccess:
        raise RuntimeError(f"HIP call failed: {getattr(err, 'name', err)} ({int(err)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class HipKernel:
    """A loaded code object and its kernel function (per process; modules are never unloaded)."""

    def __init__(self, hsaco: bytes, name: str = HIP_KERNEL_NAME) -> None:
        hip = _hip()
        self._image = hsaco  # keep the bytes alive while the module exists
        self.module = _check(hip, hip.hipModuleLoadData(hsaco))
        self.function = _check(hip, hip.hipModuleGetFunction(self.module, name.encode()))
        self.name = name

    @classmethod
    def from_artifact(cls, artifact: Artifact) -> HipKernel:
        return cls(Path(artifact.path).read_bytes(), artifact.kernel_name)

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], kernargs: bytes,
               stream: int) -> None:
        """Launch with a packed kernarg buffer. hip-python builds the
        HIP_LAUNCH_PARAM_BUFFER_POINTER / _SIZE list from `extra` itself; one byte array
        (alignment 1) adds no padding, so the buffer is exactly `kernargs`."""
        hip = _hip()
        buf = (ctypes.c_ubyte * len(kernargs)).from_buffer_copy(kernargs)
        _check(hip, hip.hipModuleLaunchKernel(
            self.function, *grid, *block, 0, stream, None, extra=(buf,)))


class HipBlockSparseAttention:
    """``o, lse = op(q, k, v, topk_idx, vbs, counts=None)`` with the HIP kernel on a ROCm GPU;
    ``return_max_prob=True`` gives `tilegen.maxprob.AttentionOutput` (the config's kernel
    rendered with the signal, compiled on first use)."""

    provides_max_prob = True

    def __init__(self, spec: Spec, config: KernelConfig, artifact: Artifact, target: Target,
                 config_source: str = "explicit") -> None:
        self.spec = spec
        self.config = config
        self.target = target
        self.config_source = config_source
        self.plan = plan_for(spec, config, target)
        self.kernel = HipKernel.from_artifact(artifact)
        self._max_prob_kernel: HipKernel | None = None
        from tilegen.guard import ValueGuard

        self.guard = ValueGuard(spec)

    def max_prob_kernel(self) -> HipKernel:
        """The config's kernel with the signal (`KernelConfig.store_max_prob`), built once."""
        if self._max_prob_kernel is None:
            from tilegen.backends.hip import BACKEND
            from tilegen.paths import cache_dir

            cfg = self.config.replace(store_max_prob=True)
            artifact = BACKEND.compile(self.spec, cfg, self.target,
                                       BACKEND.render(self.spec, cfg, self.target),
                                       cache_dir() / "hip-build")
            self._max_prob_kernel = HipKernel.from_artifact(artifact)
        return self._max_prob_kernel

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 topk_idx: torch.Tensor, vbs: torch.Tensor, counts: torch.Tensor | None = None,
                 *, sm_scale: float | None = None, return_lse: bool = True,
                 return_max_prob: bool = False, check_values: bool = False) -> Any:
        """Validate shapes on the host and values on the device (`tilegen.guard`, as the CUDA
        op; ``check_values=True`` checks them eagerly), then launch; (o, lse), or o when
        return_lse=False, or `AttentionOutput` with return_max_prob=True."""
        shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                 check_values=check_values)
        check_sm_scale(sm_scale)
        if needs_grad(q, k, v):
            from tilegen.backends.triton.op import differentiable_op

            return differentiable_op(self.spec, self.target, "hip")(
                q, k, v, topk_idx, vbs, counts, sm_scale=sm_scale, return_lse=return_lse,
                return_max_prob=return_max_prob)
        if q.device.type != "cuda" or not getattr(torch.version, "hip", None):
            raise ValueError(f"the HIP backend runs on ROCm devices; q is on {q.device}")
        check_alignment(q=q, k=k, v=v)
        mp = None
        if return_max_prob:  # every row-owning wave adds to the cube: always zeroed
            mp = empty_buffers(shapes.batch, shapes.heads, shapes.seq_len, shapes.num_q_blocks,
                               q.device, zero_cube=True)
        walk, marks = self.guard.before(topk_idx, vbs, counts, shapes)
        o, lse = self.launch(q, k, v, topk_idx, vbs, walk, shapes=shapes, sm_scale=sm_scale,
                             max_prob_out=mp)
        self.guard.after(marks, o, lse, mp, shapes)
        if mp is not None:
            return AttentionOutput(o, lse if return_lse else None, *mp)
        return (o, lse) if return_lse else o

    def check(self) -> None:
        """Wait for this op's launches and raise ValueError if any met a bad value."""
        self.guard.check()

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_idx: torch.Tensor,
               vbs: torch.Tensor, counts: torch.Tensor | None = None, *,
               shapes: Shapes | None = None, sm_scale: float | None = None,
               out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
               max_prob_out: tuple[torch.Tensor, torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Launch with no input checks (validate once first), like
        `tilegen.ops.BlockSparseAttention.launch`, so bench and tune can time it.
        ``max_prob_out=(max_prob, max_prob_cube)`` (the cube buffer zeroed) runs the kernel with
        the signal into them."""
        if shapes is None:
            shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                     check_values=False)
        if out is None:
            o = torch.empty_like(q)
            lse = (torch.empty((shapes.batch, shapes.heads, shapes.seq_len),
                               dtype=torch.float32, device=q.device)
                   if self.plan.store_lse else None)
        else:
            o, lse = out
        scale = sm_scale if sm_scale is not None else self.spec.sm_scale
        values = kernel_values(q, k, v, topk_idx, vbs, counts, o, lse, shapes, scale * LOG2E,
                               max_prob_out)
        grid, block = launch_geometry(self.plan, shapes)
        stream = torch.cuda.current_stream(q.device).cuda_stream
        kernel = self.kernel if max_prob_out is None else self.max_prob_kernel()
        kernel.launch(grid, block, pack_kernargs(values), stream)
        return o, lse
