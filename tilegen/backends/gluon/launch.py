"""Launch the warp-specialized Gluon kernel: the GPU pre-pass, then the kernel; no host sync.

Padded query rows (past vbs[q_cube]) are computed the way the reference kernel computes them
(softmax over the real keys with whatever q holds there), which is what the scoring rule
compares (`zero_pad_rows=True` writes zeros instead).

Bad values (index outside [0, NKV), vbs outside 1..64, counts outside 0..TOPK) are found by the
pre-pass on the GPU: the row comes out NaN and the error word gets a bit (1 index, 2 vbs,
4 counts); the op reads it without a sync (`tilegen.inputs.DeviceErrorFlag`).

`compile_offline` compiles the kernel for the target with no GPU (Triton's bundled ptxas).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading
from typing import Any

from tilegen import cache
from tilegen.backends.gluon import render as _render
from tilegen.backends.gluon.prepass import (
    pair_prepass_buffers,
    prepass_buffers,
    run_pair_prepass,
    run_prepass,
    run_window_prepass,
)
from tilegen.reference import LOG2E
from tilegen.render import Source
from tilegen.targets import Target

_lock = threading.Lock()
_modules: dict[str, Any] = {}


def load_kernel(source: Source, name: str = _render.KERNEL_NAME):
    """Import the rendered source from the kernel cache (Gluon's jit reads the source file) and
    return its kernel `name` (the forward kernel by default)."""
    with _lock:
        # stored under every name it is loaded as (one text serves the configs whose knobs are
        # constexprs), imported once per text
        path = cache.store("gluon", source.sha256, source.name, source.text,
                           meta={"template": source.template, "sha256": source.sha256})
        mod = _modules.get(source.sha256)
        if mod is None:
            mod_name = f"tilegen_gluon_{source.sha256[:16]}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = mod
            spec.loader.exec_module(mod)
            _modules[source.sha256] = mod
    return getattr(mod, name)


def _layout(rows: int, head_dim: int, gl_dtype):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl_dtype)


@functools.cache
def shared_layout(rows: int, cols: int, torch_dtype) -> Any:
    """The NVMMA shared layout of a (rows, cols) tile of a 16-bit torch dtype (cached)."""
    from triton.experimental.gluon import language as gl

    gdt = gl.bfloat16 if str(torch_dtype) == "torch.bfloat16" else gl.float16
    return _layout(rows, cols, gdt)


@functools.cache
def o32_layout() -> Any:
    """The forward's O32_SMEM: the fp32 O tile unswizzled (TMA's swizzle modes stop at 128-byte
    rows; the tile's are 512)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def bshd_descriptor(t, rows: int, layout: Any = None) -> Any:
    """A TMA descriptor over the (B*S, H*D) view of a BSHD tensor with a (rows, D) box, in
    ``layout`` (default: the NVMMA layout of the 16-bit tile; the fp32 O takes `o32_layout`).
    Built per call: a cached descriptor would keep the caller's tensor alive (the layout is
    cached)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, S, H, D = t.shape
    return TensorDescriptor(t.view(B * S, H * D), [B * S, H * D], [H * D, 1], [rows, D],
                            layout if layout is not None else shared_layout(rows, D, t.dtype))


#: the widest LUT the pair pre-pass takes (its row x row compare lives in one program's registers)
PAIR_MAX_TOPK = 256

#: box heights of the K/V descriptors: whole cubes, then the packed partial sizes (those three
#: with PACK_PARTIALS only; None otherwise)
DESCRIPTOR_ROWS = (64, 32, 16, 8)


class GluonLaunch:
    """One rendered variant, launchable on CUDA tensors of a target with wgmma or tcgen05."""

    def __init__(self, source: Source, opts: dict[str, Any], head_dim: int,
                 target: Target, separate_kv: bool = False) -> None:
        self.source = source
        self.cfg = opts
        #: the source takes K/V of their own shape and a q_vbs (`KernelConfig.separate_kv`)
        self.separate_kv = separate_kv
        self.kernel = load_kernel(source)
        self.maxnreg = _render.maxnreg_for(opts, target)
        self.num_warps = target.fact("warps_per_warpgroup")  # the default partition: a consumer
        self.head_dim = head_dim
        self._bufs: dict = {}

    def _buffers(self, device, rows: int, topk: int):
        key = (str(device), rows, topk)
        b = self._bufs.get(key)
        if b is None:
            make = pair_prepass_buffers if self.cfg["share_kv"] else prepass_buffers
            b = self._bufs[key] = make(device, rows, topk)
        return b

    def _desc(self, t, rows: int):
        return bshd_descriptor(t, rows)

    def _o32(self, o32):
        """The kernel's o32_out: None, the fp32 tensor, or the TMA descriptor of the fp32 O or
        (in the input dtype) of its rounding residual (`o32_store_kind`)."""
        import torch

        if o32 is None or _render.o32_store_kind(self.cfg) == 1:
            return o32
        if o32.dtype != torch.float32:
            return bshd_descriptor(o32, 64)
        return bshd_descriptor(o32, 64, o32_layout())

    def __call__(self, q, k, v, topk_idx, vbs, counts, o, lse, err, sm_scale: float,
                 zero_pad_rows: bool = False, max_prob_out=None, windows=None,
                 cube_grid: tuple[int, int, int] | None = None, topk: int = 0,
                 o32=None, q_vbs=None) -> None:
        """Pre-pass and kernel on validated inputs (`tilegen.inputs.validate_inputs`). A
        sliding-tile call passes `windows` (`tilegen.encodings.window_table`), the cube grid and
        the largest window volume as `topk` instead of a LUT. ``o32`` (fp32, q's shape) also
        receives O before its rounding (a call that needs gradients: the backward's delta).
        A source of separate K/V takes ``q_vbs`` (the query cubes' real rows) and reads k, v
        of their own length and heads."""
        B, S, H, D = q.shape
        nq, nkv = S // 64, vbs.shape[0]
        if self.separate_kv != (q_vbs is not None):
            raise ValueError("q_vbs: a Gluon launch of separate K/V takes it, any other none")
        sep: tuple[tuple, tuple, tuple] = ((q_vbs,), (k.shape[1],), (k.shape[2],)) \
            if self.separate_kv else ((), (), ())
        if windows is None:
            topk = topk_idx.shape[3]
        share = self.cfg["share_kv"]
        nc = self.cfg["num_consumers"]
        if share and topk > PAIR_MAX_TOPK:
            raise ValueError(f"share_kv: the pair pre-pass compares two LUT rows entry by entry "
                             f"in one program, up to {PAIR_MAX_TOPK} entries a row; this LUT has "
                             f"{topk} (a mask spec's LUT is NKV wide): use a config without "
                             "share_kv")
        rows = B * H * (-(-nq // nc) if share else nq)
        bufs = self._buffers(q.device, rows, topk)
        if windows is not None:
            run_window_prepass(windows, vbs, bufs, rows, H, nq, cube_grid, topk, err,
                               pack=self.cfg["pack_partials"])
        elif share:
            run_pair_prepass(topk_idx, vbs, counts, bufs, rows, nq, nkv, topk, err,
                             pack=self.cfg["pack_partials"])
        else:
            run_prepass(topk_idx, vbs, counts, bufs, rows, nkv, topk, err,
                        pack=self.cfg["pack_partials"])
        packed = self.cfg["pack_partials"]
        kd = [self._desc(k, r) if packed or r == 64 else None for r in DESCRIPTOR_ROWS]
        vd = [self._desc(v, r) if packed or r == 64 else None for r in DESCRIPTOR_ROWS]
        mp = max_prob_out if self.cfg["store_max_prob"] else (None, None)
        grid = (-(-nq // nc), B * H)
        self.kernel[grid](
            self._desc(q, 64), *kd, *vd, self._desc(o, 64),
            bufs["sidx"], bufs["tinfo"], bufs["tmask"] if share else None, bufs["meta"], vbs,
            *sep[0], lse if lse is not None else bufs["meta"], *mp, self._o32(o32),
            S, *sep[1], H, *sep[2], nq, topk, float(sm_scale) * LOG2E,
            **_render.constexprs(self.cfg, zero_pad_rows=bool(zero_pad_rows) and (
                nkv == nq or self.separate_kv), store_o32=o32 is not None,
                residual=o32 is not None and str(o32.dtype) != "torch.float32"),
            num_warps=self.num_warps, maxnreg=self.maxnreg,
        )


# ----------------------------------------------------------------------------- offline compile


def signature(opts: dict, head_dim: int, dtype: str, store_o32: bool = False,
              separate_kv: bool = False, residual: bool = False) -> tuple[dict, dict]:
    """Kernel signature strings for triton.compile (no tensors needed), and the constexpr
    values: the knobs (`render.constexprs`) and the None of each parameter the options leave
    unused (the packed-cube descriptors, tmask_ptr, mp_ptr, mpc_ptr and o32_out). A source of
    separate K/V adds q_vbs_ptr, kv_seq_len and num_kv_heads."""
    from triton.experimental.gluon import language as gl

    gdt = gl.bfloat16 if dtype == "bf16" else gl.float16

    def td(rows):
        return f"tensordesc<{dtype}[{rows}, {head_dim}],{_layout(rows, head_dim, gdt)!r}>"

    packed = opts["pack_partials"]
    args: dict[str, str | None] = {"q_desc": td(64)}
    for t in ("k", "v"):
        for rows, part in zip(DESCRIPTOR_ROWS, ("full", "half", "quarter", "eighth"),
                              strict=True):
            args[f"{t}_{part}"] = td(rows) if packed or rows == 64 else None
    args.update({"o_desc": td(64), "sidx_ptr": "*i32", "tinfo_ptr": "*i32",
                 "tmask_ptr": "*i32" if opts["share_kv"] else None, "meta_ptr": "*i32",
                 "vbs_ptr": "*i32"})
    if separate_kv:
        args["q_vbs_ptr"] = "*i32"
    args["lse_ptr"] = "*fp32"
    for name in ("mp_ptr", "mpc_ptr"):
        args[name] = "*fp32" if opts["store_max_prob"] else None
    if not store_o32:
        args["o32_out"] = None
    elif _render.o32_store_kind(opts, residual) == 1:
        args["o32_out"] = "*fp32"
    elif _render.o32_store_kind(opts, residual) == 3:  # the residual, like o_desc
        args["o32_out"] = td(64)
    else:
        args["o32_out"] = f"tensordesc<fp32[64, {head_dim}],{o32_layout()!r}>"
    args["seq_len"] = "i32"
    if separate_kv:
        args["kv_seq_len"] = "i32"
    args["num_heads"] = "i32"
    if separate_kv:
        args["num_kv_heads"] = "i32"
    args.update({"num_q_blocks": "i32", "topk": "i32", "qk_scale": "fp32"})
    consts: dict = {name: None for name, kind in args.items() if kind is None}
    consts.update(_render.constexprs(opts, store_o32=store_o32, residual=residual))
    sig = {name: kind or "constexpr" for name, kind in args.items()}
    sig.update({name: "constexpr" for name in _render.constexprs(opts)})
    return sig, consts


def compile_offline(source: Source, opts: dict, head_dim: int, dtype: str, target: Target,
                    separate_kv: bool = False):
    """Compile for the target here (no GPU needed): Triton's CompiledKernel (asm: ttgir, llir,
    ptx, cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = load_kernel(source)
    sig, consts = signature(opts, head_dim, dtype, separate_kv=separate_kv)
    src = GluonASTSource(fn, sig, consts)
    return triton.compile(src, target=GPUTarget(target.triton_backend, target.triton_arch,
                                                target.warp_size),
                          options={"num_warps": target.fact("warps_per_warpgroup"),
                                   "maxnreg": _render.maxnreg_for(opts, target)})
