"""Launch the warp-specialized Gluon kernel: pre-pass + kernel, no host sync.

    from tilegen.backends.gluon.launch import GluonLaunch
    run = GluonLaunch(spec=None, cfg={"num_consumers": 2})
    o, lse = run(q, k, v, topk_idx, vbs, counts=None, sm_scale=None, store_lse=False)
    run.error_flag   # int32 device tensor, != 0 after a call that met a bad value (no sync taken)

Padded query rows (past vbs[q_cube]) are computed the way the reference kernel computes them
(softmax over the real keys with whatever q holds there), which is what the scoring rule compares
(`zero_pad_rows=True` writes zeros instead).

Bad values (index outside [0, NKV), vbs outside 1..64, counts outside 0..TOPK) are found by the
pre-pass on the GPU: the row comes out NaN and `error_flag` gets a bit (1 index, 2 vbs, 4 counts).
Reading the flag is the caller's choice (e.g. pinned memory after an event); this module never
syncs. Layouts other than BSHD, block sizes other than 64, and non-Hopper devices are refused.

`compile_offline(cfg)` compiles the kernel for sm_90a with no GPU (Triton's bundled ptxas) and
returns the artifacts, for SASS and register checks on a CPU machine.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from tilegen.backends.gluon import render as _render
from tilegen.backends.gluon.prepass import prepass_buffers, run_prepass

LOG2E = 1.4426950408889634
_lock = threading.Lock()
_modules: dict[str, Any] = {}


def _cache_dir() -> Path:
    base = os.environ.get("TILEGEN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(str(Path.home()), ".cache"), "tilegen")
    d = Path(base) / "gluon"
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_kernel(text: str):
    """Import the rendered text from a file named by its sha256 (Gluon's jit reads the file)."""
    sha = hashlib.sha256(text.encode()).hexdigest()
    with _lock:
        mod = _modules.get(sha)
        if mod is None:
            path = _cache_dir() / f"gluon_{sha[:20]}.py"
            if not path.exists() or path.read_text() != text:
                fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".py")
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.replace(tmp, path)
            name = f"tilegen_gluon_{sha[:16]}"
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            _modules[sha] = mod
    return getattr(mod, _render.KERNEL_NAME)


def _layout(rows: int, head_dim: int, gl_dtype):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl_dtype)


class GluonLaunch:
    """One rendered variant, callable on CUDA tensors (sm_90)."""

    def __init__(self, spec: Any = None, cfg: dict | None = None, target: str = "sm_90"):
        self.cfg = _render.resolve(cfg)
        self.spec = spec
        self.text = _render.render_gluon(spec, self.cfg, target)
        self.kernel = load_kernel(self.text)
        self.maxnreg = _render.maxnreg_for(self.cfg)
        self.dtype = _render._spec_value(spec, "dtype", "bf16")
        self.head_dim = _render._spec_value(spec, "head_dim", 128)
        self.num_warps = 4
        self.error_flag = None
        self._bufs: dict = {}

    def _buffers(self, device, rows: int, topk: int):
        key = (str(device), rows, topk)
        b = self._bufs.get(key)
        if b is None:
            b = prepass_buffers(device, rows, topk)
            self._bufs[key] = b
        return b

    def descriptors(self, q, k, v, o):
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        B, S, H, D = q.shape
        gdt = gl.bfloat16 if str(q.dtype) == "torch.bfloat16" else gl.float16

        def desc(t, rows):
            t2 = t.view(B * S, H * D)
            return TensorDescriptor(t2, [B * S, H * D], [H * D, 1], [rows, D], _layout(rows, D, gdt))

        q_d = desc(q, 64)
        o_d = desc(o, 64)
        kd = [desc(k, 64)]
        vd = [desc(v, 64)]
        if self.cfg["pack_partials"]:
            kd += [desc(k, r) for r in (32, 16, 8)]
            vd += [desc(v, r) for r in (32, 16, 8)]
        return q_d, kd, vd, o_d

    def __call__(self, q, k, v, topk_idx, vbs, counts=None, sm_scale=None, store_lse=None,
                 out=None, zero_pad_rows=False):
        import torch

        if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
            raise ValueError("q, k, v must share one (B, S, H, D) shape (BSHD)")
        if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
            raise ValueError("q, k, v must be contiguous BSHD")
        B, S, H, D = q.shape
        want = "torch.bfloat16" if self.dtype == "bf16" else "torch.float16"
        if str(q.dtype) != want or k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"this Gluon variant was rendered for {self.dtype}; got q {q.dtype}, "
                            f"k {k.dtype}, v {v.dtype}")
        if D != self.head_dim:
            raise ValueError(f"this Gluon variant was rendered for head_dim {self.head_dim}, got {D}")
        if not q.is_cuda:
            raise ValueError("the Gluon kernel runs on CUDA tensors (sm_90) only")
        if S % 64:
            raise ValueError("S must be a multiple of 64")
        NQ = S // 64
        NKV = vbs.shape[0]
        if NKV * 64 != S:
            raise ValueError("len(vbs) * 64 must equal S")
        if topk_idx.dim() != 4 or tuple(topk_idx.shape[:3]) != (B, H, NQ):
            raise ValueError(f"topk_idx must be (B, H, NQ, TOPK)=({B}, {H}, {NQ}, TOPK)")
        TOPK = topk_idx.shape[3]
        if TOPK > 0xFFFF:
            raise ValueError("TOPK over 65535 is not supported by the Gluon kernel")
        want_lse = self.cfg["store_lse"] if store_lse is None else bool(store_lse)
        if want_lse and not self.cfg["store_lse"]:
            raise ValueError("this Gluon variant was rendered with store_lse=False")
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(D)
        rows = B * H * NQ
        bufs = self._buffers(q.device, rows, TOPK)
        self.error_flag = bufs["err"]
        idx = topk_idx if topk_idx.dtype == torch.int32 and topk_idx.is_contiguous() else \
            topk_idx.to(torch.int32).contiguous()
        vbs32 = vbs if vbs.dtype == torch.int32 and vbs.is_contiguous() else vbs.to(torch.int32).contiguous()
        cnt = None
        if counts is not None:
            cnt = counts if counts.dtype == torch.int32 and counts.is_contiguous() else \
                counts.to(torch.int32).contiguous()
        run_prepass(idx, vbs32, cnt, bufs, rows, NKV, TOPK, pack=self.cfg["pack_partials"])
        o = torch.empty_like(q) if out is None else out
        lse = torch.empty((B, H, S), device=q.device, dtype=torch.float32) if want_lse else None
        q_d, kd, vd, o_d = self.descriptors(q, k, v, o)
        nc = self.cfg["num_consumers"]
        grid = (triton_cdiv(NQ, nc), B * H)
        self.kernel[grid](
            q_d, *kd, *vd, o_d,
            bufs["sidx"], bufs["tinfo"], bufs["meta"], vbs32, lse if lse is not None else bufs["meta"],
            S, H, NQ, TOPK, float(sm_scale) * LOG2E,
            ZERO_PAD_ROWS=bool(zero_pad_rows) and NKV == NQ,
            num_warps=self.num_warps, maxnreg=self.maxnreg,
        )
        return o, lse


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- offline compile


def signature(cfg: dict, head_dim: int = 128, dtype: str = "bf16") -> tuple[dict, dict]:
    """Kernel signature strings for triton.compile (no tensors needed)."""
    from triton.experimental.gluon import language as gl

    gdt = gl.bfloat16 if dtype == "bf16" else gl.float16
    tdt = "bf16" if dtype == "bf16" else "fp16"

    def td(rows):
        return f"tensordesc<{tdt}[{rows}, {head_dim}],{_layout(rows, head_dim, gdt)!r}>"

    sig: dict[str, str] = {"q_desc": td(64), "k_full": td(64)}
    if cfg["pack_partials"]:
        sig.update({"k_half": td(32), "k_quarter": td(16), "k_eighth": td(8)})
    sig["v_full"] = td(64)
    if cfg["pack_partials"]:
        sig.update({"v_half": td(32), "v_quarter": td(16), "v_eighth": td(8)})
    sig.update({"o_desc": td(64), "sidx_ptr": "*i32", "tinfo_ptr": "*i32", "meta_ptr": "*i32",
                "vbs_ptr": "*i32", "lse_ptr": "*fp32", "seq_len": "i32", "num_heads": "i32",
                "num_q_blocks": "i32", "topk": "i32", "qk_scale": "fp32",
                "ZERO_PAD_ROWS": "constexpr"})
    return sig, {"ZERO_PAD_ROWS": False}


def compile_offline(cfg: dict | None = None, spec: Any = None, arch: int = 90):
    """Compile for sm_90a here (no GPU needed). Returns triton's CompiledKernel (asm: ttgir,
    llir, ptx, cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    c = _render.resolve(cfg)
    text = _render.render_gluon(spec, c, "sm_90")
    fn = load_kernel(text)
    sig, consts = signature(c)
    src = GluonASTSource(fn, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 4, "maxnreg": _render.maxnreg_for(c)})
