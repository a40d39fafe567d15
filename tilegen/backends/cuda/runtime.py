"""Run the CUDA C++ backend on torch tensors: nvcc JIT (cached) + the CUDA driver API.

The kernel is rendered for (spec, config), compiled by `tilegen.backends.cuda.nvcc` for the current
device's ISA (sm_90a on Hopper, sm_100a on Blackwell), loaded with ``cuModuleLoadData`` through
cuda-python (``cuda.bindings.driver``) and launched on torch's current stream with the
tensors' device pointers. Nothing here needs a GPU or cuda-python at import time: the host-side
launch arithmetic (`launch_params`, `kernel_args`) is plain Python and unit-tested on a CPU.

    op = CudaBlockSparseAttention(Spec())
    o, lse = op(q, k, v, topk_idx, vbs)          # validated
    op.launch(q, k, v, topk_idx, vbs, out=(o, lse))  # no checks, for timing
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

from tilegen.backends.cuda.nvcc import compile_cuda, cuda_traits, render_cuda
from tilegen.compile import Artifact
from tilegen.config import KernelConfig
from tilegen.reference import LOG2E
from tilegen.spec import Spec
from tilegen.targets import Target

#: The kernel's parameters in order: (name, kind) with kind "ptr", "i32" or "f32".
KERNEL_SIGNATURE: tuple[tuple[str, str], ...] = (
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("lut", "ptr"), ("counts", "ptr"), ("vbs", "ptr"),
    ("o", "ptr"), ("lse", "ptr"), ("seq_len", "i32"), ("num_heads", "i32"),
    ("num_q_blocks", "i32"), ("topk", "i32"), ("qk_scale", "f32"),
)
#: Inserted after ``lse`` when the kernel is rendered with ``store_max_prob``.
MAX_PROB_PARAMS: tuple[tuple[str, str], ...] = (("max_prob", "ptr"), ("max_prob_cube", "ptr"))
_CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "f32": ctypes.c_float}


class CudaRuntimeMissing(RuntimeError):
    """cuda-python's driver bindings (or a CUDA device) are not available."""


# -- host-side launch arithmetic (pure) --------------------------------------------------------
@dataclass(frozen=True)
class LaunchParams:
    """Grid, block and dynamic shared memory of one launch."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    #: shared memory a block may use without opting in (target.toml default_shared_per_block)
    default_shared_limit: int

    def needs_opt_in(self, static_bytes: int = 0) -> bool:
        """Whether the dynamic limit must be raised past the target's default cap minus the
        static shared memory (the launcher raises it unconditionally; this says when it
        matters)."""
        return self.shared_bytes + static_bytes > self.default_shared_limit


def launch_params(spec: Spec, cfg: KernelConfig, target: Target, batch: int, heads: int,
                  num_q_blocks: int) -> LaunchParams:
    """Grid (query cubes * block_q / block_m, batch * heads): one CTA per BLOCK_M slice of a
    query cube and (batch, head), as the Triton kernel's programs; block = num_warps warps."""
    t = cuda_traits(spec, cfg, target)
    grid_x = num_q_blocks * (spec.block_q // cfg.block_m)
    grid_y = batch * heads
    max_x, max_y, _ = target.max_grid
    if not 0 < grid_x <= max_x or not 0 < grid_y <= max_y:
        raise ValueError(f"grid ({grid_x}, {grid_y}) is outside {target.name}'s limits "
                         f"(x <= {max_x}, y = batch*heads <= {max_y})")
    return LaunchParams(grid=(grid_x, grid_y, 1), block=(t["threads"], 1, 1),
                        shared_bytes=t["smem_bytes"],
                        default_shared_limit=target.default_shared_per_block)


def kernel_signature(store_max_prob: bool = False) -> tuple[tuple[str, str], ...]:
    """The kernel's parameters: `KERNEL_SIGNATURE`, with `MAX_PROB_PARAMS` after lse when the
    kernel writes the signal."""
    if not store_max_prob:
        return KERNEL_SIGNATURE
    at = [name for name, _ in KERNEL_SIGNATURE].index("lse") + 1
    return KERNEL_SIGNATURE[:at] + MAX_PROB_PARAMS + KERNEL_SIGNATURE[at:]


def kernel_args(ptrs: dict[str, int], seq_len: int, num_heads: int, num_q_blocks: int,
                topk: int, qk_scale: float, store_max_prob: bool = False,
                ) -> list[tuple[str, str, int | float]]:
    """The kernel's arguments in `kernel_signature` order as (name, kind, value). ``ptrs`` maps
    q, k, v, lut, counts, vbs, o, lse (and max_prob, max_prob_cube) to device addresses (0 =
    nullptr: counts absent, lse not stored)."""
    scalars = {"seq_len": seq_len, "num_heads": num_heads, "num_q_blocks": num_q_blocks,
               "topk": topk, "qk_scale": qk_scale}
    out: list[tuple[str, str, int | float]] = []
    for name, kind in kernel_signature(store_max_prob):
        value = ptrs.get(name, 0) if kind == "ptr" else scalars[name]
        if kind == "i32" and not 0 <= int(value) < 2**31:
            raise ValueError(f"{name}={value} does not fit the kernel's int32 argument")
        out.append((name, kind, value))
    return out


def pack_args(args: list[tuple[str, str, Any]]) -> tuple[Any, list[Any]]:
    """ctypes ``void*[]`` of pointers to each argument's value (cuLaunchKernel's kernelParams),
    plus the value objects, which must stay alive until the launch returns. A "map" argument
    is a `tilegen.backends.cuda.tensor_map.TensorMap` (its 128 bytes, passed by value)."""
    values: list[Any] = []
    addresses: list[int] = []
    for _, kind, value in args:
        if kind == "map":
            values.append(value)
            addresses.append(value.address)
        else:
            v = _CTYPES[kind](value)
            values.append(v)
            addresses.append(ctypes.addressof(v))
    array = (ctypes.c_void_p * len(addresses))(*addresses)
    return array, values


def target_for_capability(major: int, minor: int, max_shared: int | None = None) -> Target:
    """The tilegen target with a CUDA backend whose ISA runs on this compute capability: its
    own, or the closest lower one of its major version whose shared memory per block fits
    `max_shared` (`tilegen.targets.target_for_capability`)."""
    from tilegen.targets import TARGET_NAMES, get_target
    from tilegen.targets import target_for_capability as found_for

    target = found_for(major * 10 + minor, max_shared, backend="cuda")
    if target is not None:
        return target
    with_cuda = [get_target(n) for n in TARGET_NAMES if "cuda" in get_target(n).backends]
    raise CudaRuntimeMissing(
        f"no CUDA backend for compute capability {major}.{minor}; the CUDA kernels are built "
        f"for {[t.name for t in with_cuda]}")


# -- driver API ---------------------------------------------------------------------------------
def driver() -> Any:
    """``cuda.bindings.driver`` (cuda-python >= 12.8), imported on first use."""
    try:
        from cuda.bindings import driver as cuda  # type: ignore[import-not-found]
    except ImportError:
        try:
            from cuda import cuda  # type: ignore[import-not-found, no-redef]  # cuda-python < 12.6
        except ImportError as exc:
            raise CudaRuntimeMissing(
                "the CUDA backend's launcher needs cuda-python's driver bindings: "
                "pip install cuda-bindings (or cuda-python>=12.8)") from exc
    return cuda


def check(result: Any, call: str) -> Any:
    """Unpack a cuda-python result tuple ``(CUresult, *values)``; raise with the error name."""
    cuda = driver()
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != cuda.CUresult.CUDA_SUCCESS:
        name_res = cuda.cuGetErrorName(err)
        name = name_res[1].decode() if name_res[0] == cuda.CUresult.CUDA_SUCCESS else str(err)
        raise RuntimeError(f"{call} failed: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


class CudaKernel:
    """One cubin loaded into one device's primary context (the one torch uses)."""

    def __init__(self, artifact: Artifact, device_index: int, shared_bytes: int) -> None:
        cuda = driver()
        self.artifact = artifact
        self.device_index = device_index
        check(cuda.cuInit(0), "cuInit")
        dev = check(cuda.cuDeviceGet(device_index), "cuDeviceGet")
        self.context = check(cuda.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self.make_current()
        image = artifact.path.read_bytes()
        self._image = ctypes.create_string_buffer(image, len(image))
        self.module = check(cuda.cuModuleLoadData(ctypes.addressof(self._image)),
                            "cuModuleLoadData")
        self.function = check(cuda.cuModuleGetFunction(self.module,
                                                       artifact.kernel_name.encode()),
                              f"cuModuleGetFunction({artifact.kernel_name})")
        # Always raise the dynamic limit to what the kernel takes: the default cap is 48 KiB
        # *minus the static shared memory*, so 48 KiB of dynamic memory already needs it.
        attr = cuda.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(cuda.cuFuncSetAttribute(self.function, attr, shared_bytes),
              f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={shared_bytes})")

    def make_current(self) -> None:
        """Bind this device's primary context to the calling thread if another one is bound."""
        cuda = driver()
        current = check(cuda.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if current is None or int(current) != int(self.context):
            check(cuda.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def launch(self, params: LaunchParams, args: list[tuple[str, str, Any]],
               stream: int) -> None:
        cuda = driver()
        self.make_current()
        array, _keep = pack_args(args)
        check(cuda.cuLaunchKernel(self.function, *params.grid, *params.block,
                                  params.shared_bytes, cuda.CUstream(stream),
                                  ctypes.addressof(array), 0),
              f"cuLaunchKernel({self.artifact.kernel_name})")


# -- the op -------------------------------------------------------------------------------------
class CudaBlockSparseAttention:
    """The CUDA C++ backend as an op: ``o, lse = op(q, k, v, topk_idx, vbs, counts=None)``;
    ``return_max_prob=True`` gives `tilegen.maxprob.AttentionOutput` (the kernel rendered with
    the signal).

    ``config`` defaults to the device target's default config. The kernel is compiled (or
    found in the cache) and loaded on the first call on each device.
    """

    def __init__(self, spec: Spec | None = None, config: KernelConfig | None = None,
                 config_source: str = "explicit") -> None:
        self.spec = spec or Spec()
        self._config = config
        self.config_source = config_source
        self._kernels: dict[tuple[int, bool, bool], tuple[CudaKernel, KernelConfig]] = {}
        self._targets: dict[int, Target] = {}
        self._lock = threading.Lock()
        from tilegen.guard import ValueGuard

        self.guard = ValueGuard(self.spec)

    def __repr__(self) -> str:
        cfg = self._config.name if self._config else "target default"
        return f"CudaBlockSparseAttention(spec={self.spec.short_hash}, config={cfg})"

    def config_for(self, target: Target) -> KernelConfig:
        from tilegen.config import check as check_config
        from tilegen.config import default_config

        cfg = self._config or default_config(target, self.spec)
        check_config(self.spec, target, cfg)
        cuda_traits(self.spec, cfg, target)  # CUDA's own tiling rules
        return cfg

    provides_max_prob = True

    def kernel(self, device: Any, store_lse: bool = True,
               store_max_prob: bool = False) -> tuple[CudaKernel, KernelConfig]:
        """The loaded kernel and its config for a torch CUDA device (compiled for the device's
        arch, or found in the cache, on first use)."""
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, store_lse, store_max_prob)
        found = self._kernels.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._kernels.get(key)
            if found is None:
                props = torch.cuda.get_device_properties(index)
                target = target_for_capability(
                    *torch.cuda.get_device_capability(index),
                    getattr(props, "shared_memory_per_block_optin", None))
                cfg = self.config_for(target).replace(store_lse=store_lse,
                                                      store_max_prob=store_max_prob)
                from tilegen.backends.cuda import BACKEND

                src = render_cuda(self.spec, cfg, target)
                artifact = compile_cuda(src, target, None,
                                        BACKEND.variant_key(self.spec, cfg, target, src).digest)
                torch.cuda.init()
                kern = CudaKernel(artifact, index,
                                  cuda_traits(self.spec, cfg, target)["smem_bytes"])
                self._targets[index] = target
                found = self._kernels[key] = (kern, cfg)
        return found

    def __call__(self, q, k, v, topk_idx, vbs, counts=None, *, sm_scale: float | None = None,
                 return_lse: bool = True, return_max_prob: bool = False,
                 check_values: bool = False):
        """Validate shapes on the host (`tilegen.inputs.validate_inputs`) and values on the
        device (`tilegen.guard`: a bad row comes out NaN, the error is raised by a later call
        or `check()`; ``check_values=True`` checks them before the launch instead, one sync),
        then launch. Returns (o, lse), or o when return_lse=False, or `AttentionOutput` with
        return_max_prob=True (the same call as the Triton op)."""
        from tilegen.inputs import check_sm_scale, needs_grad, validate_inputs

        shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                 check_values=check_values)
        check_sm_scale(sm_scale)
        if needs_grad(q, k, v):
            from tilegen.backends.triton.op import differentiable_op
            from tilegen.targets import detect_target

            return differentiable_op(self.spec, detect_target(), "cuda")(
                q, k, v, topk_idx, vbs, counts, sm_scale=sm_scale, return_lse=return_lse,
                return_max_prob=return_max_prob)
        if q.device.type != "cuda":
            raise ValueError(f"q is on {q.device}; the CUDA backend needs CUDA tensors")
        mp = None
        if return_max_prob:
            from tilegen.maxprob import empty_buffers

            split = self.spec.block_q // self.kernel(q.device, return_lse, True)[1].block_m > 1
            mp = empty_buffers(shapes.batch, shapes.heads, shapes.seq_len, shapes.num_q_blocks,
                               q.device, zero_cube=split)
        walk, marks = self.guard.before(topk_idx, vbs, counts, shapes)
        o, lse = self.launch(q, k, v, topk_idx, vbs, walk, sm_scale=sm_scale,
                             store_lse=return_lse, shapes=shapes, max_prob_out=mp)
        self.guard.after(marks, o, lse if return_lse else None, mp, shapes)
        if mp is not None:
            from tilegen.maxprob import AttentionOutput

            return AttentionOutput(o, lse if return_lse else None, *mp)
        return (o, lse) if return_lse else o

    def check(self) -> None:
        """Wait for this op's launches and raise ValueError if any met a bad value."""
        self.guard.check()

    def launch(self, q, k, v, topk_idx, vbs, counts=None, *, sm_scale: float | None = None,
               store_lse: bool = True, out=None, shapes=None, max_prob_out=None):
        """Launch with no input checks (validate once first). ``out=(o, lse)`` reuses buffers;
        ``max_prob_out=(max_prob, max_prob_cube)`` runs the kernel with the signal into them (the
        cube buffer zeroed when block_m < block_q)."""
        import torch

        kern, cfg = self.kernel(q.device, store_lse, max_prob_out is not None)
        if shapes is None:
            if self.spec.layout == "bshd":
                batch, seq_len, heads, _ = q.shape
            else:
                batch, heads, seq_len, _ = q.shape
            num_q_blocks, topk = seq_len // self.spec.block_q, topk_idx.shape[-1]
        else:
            batch, seq_len, heads = shapes.batch, shapes.seq_len, shapes.heads
            num_q_blocks, topk = shapes.num_q_blocks, shapes.topk
        if out is None:
            o = torch.empty_like(q)
            lse = (torch.empty((batch, heads, seq_len), dtype=torch.float32, device=q.device)
                   if store_lse else None)
        else:
            o, lse = out
        scale = sm_scale if sm_scale is not None else self.spec.sm_scale
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        params = launch_params(self.spec, cfg, self._targets[index], batch, heads, num_q_blocks)
        ptrs = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(),
                "lut": topk_idx.data_ptr(), "counts": counts.data_ptr() if counts is not None
                else 0, "vbs": vbs.data_ptr(), "o": o.data_ptr(),
                "lse": lse.data_ptr() if (store_lse and lse is not None) else 0}
        if max_prob_out is not None:
            ptrs["max_prob"], ptrs["max_prob_cube"] = (t.data_ptr() for t in max_prob_out)
        args = kernel_args(ptrs, seq_len, heads, num_q_blocks, topk, scale * LOG2E,
                           store_max_prob=max_prob_out is not None)
        kern.launch(params, args, torch.cuda.current_stream(q.device).cuda_stream)
        return o, lse
