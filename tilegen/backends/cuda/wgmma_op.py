"""The CUDA family's Hopper kernel as an op: the Gluon family's tile plan, then the wgmma kernel.

Same call as every tilegen op: ``o, lse = op(q, k, v, topk_idx, vbs, counts=None)``. The kernel
reads the plan the Gluon family's pre-pass writes (`tilegen.backends.gluon.prepass`: values
checked on the GPU with no host sync, cubes ordered into 64-key tiles, partial cubes packed),
so the op is the Gluon op with another launch (`GluonBlockSparseAttention`'s validation, error
word and gradient hand-off; this launch in `_launch_for`): a bad value turns its row into NaN
and sets the error word that a later call, or `op.check()`, raises.

The kernel is compiled by nvcc (cached) for the device's ISA and launched through the CUDA
driver (`tilegen.backends.cuda.runtime`), its TMA tensor maps encoded per call
(`tilegen.backends.cuda.tensor_map`).

An 8-bit spec (``quant="int8_fp8"``) gets the same op with the 8-bit launch
(`WgmmaQuantLaunch`: `tilegen.quant`'s pre-pass with V^T in MMA slot order, the Gluon 8-bit
plan, the 8-bit kernel) and the 8-bit ops' entry points (`quantize`, `from_quantized`).
"""

from __future__ import annotations

import threading
from typing import Any

from tilegen.backends.cuda import wgmma
from tilegen.backends.gluon.op import GluonBlockSparseAttention
from tilegen.config import KernelConfig
from tilegen.reference import LOG2E
from tilegen.spec import Spec
from tilegen.targets import Target


class WgmmaLaunch:
    """One rendered variant (spec, config, outputs): pre-pass and kernel on validated inputs,
    the call `GluonBlockSparseAttention` makes of its launches."""

    def __init__(self, spec: Spec, cfg: KernelConfig, target: Target) -> None:
        from tilegen.backends.cuda import BACKEND
        from tilegen.backends.cuda.nvcc import render_cuda

        self.spec = spec
        self.cfg = cfg
        self.target = target
        self.opts = wgmma.options_of(cfg)
        self.traits = wgmma.traits(spec, cfg, target)
        self.source = render_cuda(spec, cfg, target)
        self.digest = BACKEND.variant_key(spec, cfg, target, self.source).digest
        self._kernels: dict[int, Any] = {}
        self._bufs: dict = {}
        self._lock = threading.Lock()

    def kernel(self, device_index: int):
        """The kernel loaded on a device (compiled, or found in the cache, on first use)."""
        found = self._kernels.get(device_index)
        if found is None:
            with self._lock:
                found = self._kernels.get(device_index)
                if found is None:
                    from tilegen.backends.cuda.nvcc import compile_cuda
                    from tilegen.backends.cuda.runtime import CudaKernel

                    artifact = compile_cuda(self.source, self.target, None, self.digest)
                    found = self._kernels[device_index] = CudaKernel(
                        artifact, device_index, self.traits["smem_bytes"])
        return found

    def _buffers(self, device, rows: int, topk: int) -> dict:
        from tilegen.backends.gluon.prepass import prepass_buffers

        key = (str(device), rows, topk)
        bufs = self._bufs.get(key)
        if bufs is None:
            bufs = self._bufs[key] = prepass_buffers(device, rows, topk)
        return bufs

    def __call__(self, q, k, v, topk_idx, vbs, counts, o, lse, err, sm_scale: float,
                 zero_pad_rows: bool = False, max_prob_out=None, windows=None,
                 cube_grid: tuple[int, int, int] | None = None, topk: int = 0, o32=None,
                 q_vbs=None) -> None:
        """Pre-pass and kernel (`GluonLaunch.__call__`'s arguments; a sliding-tile plan comes
        from `windows`). O for a backward (``o32``) and separate K/V (``q_vbs``) are not written
        for this kernel."""
        from tilegen.backends.cuda.tensor_map import encode, tile_geometry
        from tilegen.backends.gluon.prepass import run_prepass, run_window_prepass

        if o32 is not None or q_vbs is not None:
            raise ValueError("the CUDA wgmma kernel writes no O for a backward and takes no "
                             "separate K/V: use the gluon family for those calls")
        layout = self.spec.layout
        if layout == "bshd":
            batch, seq_len, heads, _ = q.shape
        else:
            batch, heads, seq_len, _ = q.shape
        nq, nkv = seq_len // self.spec.block_q, vbs.shape[0]
        if windows is None:
            topk = topk_idx.shape[3]
        rows = batch * heads * nq
        bufs = self._buffers(q.device, rows, topk)
        pack = self.opts["pack_partials"]
        if windows is not None:
            run_window_prepass(windows, vbs, bufs, rows, heads, nq, cube_grid, topk, err,
                               pack=pack)
        else:
            run_prepass(topk_idx, vbs, counts, bufs, rows, nkv, topk, err, pack=pack)
        tensors = {"q_map": q, "k_map": k, "k8_map": k, "v_map": v, "v8_map": v, "o_map": o}
        values: dict[str, Any] = {
            name: encode(t.data_ptr(), tile_geometry(tuple(t.shape), layout,
                                                     wgmma.MAP_ROWS[name]), self.spec.dtype)
            for name, t in tensors.items()}
        values.update(sidx=bufs["sidx"].data_ptr(), tinfo=bufs["tinfo"].data_ptr(),
                      meta=bufs["meta"].data_ptr(), vbs=vbs.data_ptr(),
                      seq_len=seq_len, num_heads=heads, batch_heads=batch * heads,
                      num_q_blocks=nq, topk=topk,
                      qk_scale=float(sm_scale) * LOG2E,
                      zero_pad_rows=int(bool(zero_pad_rows) and nkv == nq))
        if lse is not None and self.cfg.store_lse:
            values["lse"] = lse.data_ptr()
        if max_prob_out is not None and self.cfg.store_max_prob:
            values["max_prob"], values["max_prob_cube"] = (t.data_ptr() for t in max_prob_out)
        self._launch(q.device, values, nq, batch, heads)

    def _launch(self, device, values: dict[str, Any], nq: int, batch: int, heads: int) -> None:
        import torch

        from tilegen.backends.cuda.runtime import LaunchParams

        index = device.index if device.index is not None else torch.cuda.current_device()
        sms = torch.cuda.get_device_properties(index).multi_processor_count
        params = LaunchParams(grid=wgmma.grid(nq, batch, heads, self.opts, self.target, sms),
                              block=(self.traits["threads"], 1, 1),
                              shared_bytes=self.traits["smem_bytes"],
                              default_shared_limit=self.target.default_shared_per_block)
        args = wgmma.kernel_args(values, self.traits["quant"],
                                 self.traits["schedule"] == "dynamic")
        self.kernel(index).launch(params, args, torch.cuda.current_stream(device).cuda_stream)


def quant_layout(bulk: bool) -> dict[str, bool]:
    """The pre-pass's layout flags (`tilegen.quant.quantize`) for the 8-bit kernel: V^T's keys
    in MMA slot order; with the bulk copies (kv_copies "bulk") K8 and V^T as tiles too."""
    return {"vt_slots": True, "vt_tiles": bulk, "k_tiles": bulk}


class WgmmaQuantLaunch(WgmmaLaunch):
    """The 8-bit variant (quant int8_fp8): the recipe's pre-pass (`tilegen.quant.quantize`, V^T
    in MMA slot order; K and V only with ``q_in_kernel``, whose kernel quantizes Q) unless the
    inputs come quantized, the Gluon family's 8-bit plan (tiles in 32-key halves), then the
    kernel, which adds lse's smoothing term itself."""

    def _buffers(self, device, rows: int, topk: int, nkv: int = 0) -> dict:
        from tilegen.backends.gluon.prepass import halves_buffers

        key = (str(device), rows, topk, nkv)
        bufs = self._bufs.get(key)
        if bufs is None:
            bufs = self._bufs[key] = halves_buffers(device, rows, topk, nkv)
            if self.opts["schedule"] == "dynamic":
                import torch

                # the count of cubes handed out past the first wave (zeroed before each launch)
                bufs["work"] = torch.zeros(1, device=device, dtype=torch.int32)
        return bufs

    def __call__(self, q, k, v, topk_idx, vbs, counts, o, lse, err, sm_scale: float,
                 zero_pad_rows: bool = False, max_prob_out=None, windows=None,
                 cube_grid: tuple[int, int, int] | None = None, topk: int = 0, o32=None,
                 q_vbs=None, quantized=None, out_rows=None) -> None:
        from tilegen import quant
        from tilegen.backends.cuda.tensor_map import byte_geometry, encode, tile_geometry
        from tilegen.backends.gluon.prepass import run_halves_prepass, run_halves_window_prepass

        if o32 is not None or q_vbs is not None or max_prob_out is not None:
            raise ValueError("the 8-bit CUDA wgmma kernel writes neither an O for a backward "
                             "nor max_prob, and takes no separate K/V")
        bulk = self.opts["kv_copies"] == "bulk"
        # Q quantized in the kernel unless the inputs come quantized (from_quantized: Q8 given)
        q_in_kernel = self.opts["q_in_kernel"] and quantized is None
        qi = quantized if quantized is not None else quant.quantize(
            q, k, v, vbs, self.spec.quant, with_q=not q_in_kernel, **quant_layout(bulk))
        if not qi.vt_slots or qi.vt_tiles != bulk or qi.k_tiles != bulk:
            raise ValueError(
                f"this CUDA wgmma 8-bit config (kv_copies={self.opts['kv_copies']!r}) reads "
                f"V^T with its keys in MMA slot order{' and K8 and V^T as tiles' if bulk else ''}"
                f": quantize with tilegen.quant.quantize(..., "
                + ", ".join(f"{k}={v}" for k, v in quant_layout(bulk).items())
                + ") (or op.quantize)")
        batch, seq_len, heads, dim = (q if q_in_kernel else qi.q8).shape
        if bulk:  # a bulk copy reads raw bytes (a TMA box clips at the tensor's edge)
            want = {"k8": (batch, heads, seq_len // 32, 32, dim),
                    "v8t": (batch, heads, seq_len // 32, dim, 32)}
            for name, shape in want.items():
                t = getattr(qi, name)
                if tuple(t.shape) != shape or not t.is_contiguous():
                    raise ValueError(f"kv_copies 'bulk' reads {name} as contiguous tiles of shape "
                                     f"{shape}; got {tuple(t.shape)}"
                                     f"{'' if t.is_contiguous() else ', not contiguous'}")
        # (B, H, D): lse's q.k̄ term, in the kernel, which reads it 16 bytes at a time
        if tuple(qi.k_mean.shape) != (batch, heads, dim) or qi.k_mean.device != qi.k8.device:
            raise ValueError(f"quantized inputs: k_mean must be ({batch}, {heads}, {dim}) on "
                             f"{qi.k8.device}, got {tuple(qi.k_mean.shape)} on "
                             f"{qi.k_mean.device}")
        k_mean = qi.k_mean.float().contiguous()
        if k_mean.data_ptr() % 16:
            k_mean = k_mean.clone()
        nq, nkv = seq_len // self.spec.block_q, vbs.shape[0]
        if windows is None:
            topk = topk_idx.shape[3]
        rows = batch * heads * nq
        bufs = self._buffers(qi.k8.device, rows, topk, nkv)
        pack = self.opts["pack_partials"]
        if windows is not None:
            run_halves_window_prepass(windows, vbs, bufs, rows, heads, nq, cube_grid, topk, err,
                                      pack=pack)
        else:
            run_halves_prepass(topk_idx, vbs, counts, bufs, rows, nkv, topk, err, pack=pack)
        cols = heads * dim
        if q_in_kernel:  # the 16-bit q, as o's panels: the kernel quantizes it
            q8_map = encode(q.data_ptr(), tile_geometry(tuple(q.shape), "bshd", 64),
                            self.spec.dtype)
        else:
            q8_map = encode(qi.q8.data_ptr(),
                            byte_geometry(cols, batch * seq_len, (dim, 64), 128), "u8")
        if bulk:  # the copies read the tiles; q8's map stands in for the maps never read
            k8_map = vt_map = q8_map
        else:
            k8_map = encode(qi.k8.data_ptr(), byte_geometry(cols, batch * seq_len, (dim, 32), 128),
                            "u8")
            vt_map = encode(qi.v8t.data_ptr(),
                            byte_geometry(seq_len, batch * heads * dim, (32, dim), 32), "u8")
        values: dict[str, Any] = {
            "q8_map": q8_map, "k8_map": k8_map, "vt_map": vt_map,
            "k8_tiles": qi.k8.data_ptr() if bulk else 0,
            "vt_tiles": qi.v8t.data_ptr() if bulk else 0,
            "o_map": encode(o.data_ptr(), tile_geometry(tuple(o.shape), "bshd", 64),
                            self.spec.dtype),
            # o in token order: the kernel stores each slot's row to out_rows[slot] of o
            "o_tokens": o.data_ptr() if out_rows is not None else 0,
            "out_rows": out_rows.data_ptr() if out_rows is not None else 0,
            "out_seq_len": o.shape[1] if out_rows is not None else 0,
            "plan": bufs["plan"].data_ptr(), "meta": bufs["meta"].data_ptr(),
            "vbs": vbs.data_ptr(), "q_scale": 0 if q_in_kernel else qi.q_scale.data_ptr(),
            "k_mean": k_mean.data_ptr(), "q_in_kernel": int(q_in_kernel),
            "k_scale": qi.k_scale.data_ptr(), "v_scale": qi.v_scale.data_ptr(),
            "v_mean": qi.v_mean.data_ptr(), "seq_len": seq_len, "num_heads": heads,
            "batch_heads": batch * heads, "num_q_blocks": nq, "topk": topk,
            "qk_scale": float(sm_scale) * LOG2E,
            "zero_pad_rows": int(bool(zero_pad_rows) and nkv == nq)}
        if lse is not None and self.cfg.store_lse:
            values["lse"] = lse.data_ptr()
        if self.opts["schedule"] == "dynamic":
            bufs["work"].zero_()
            values["work_counter"] = bufs["work"].data_ptr()
        self._launch(qi.k8.device, values, nq, batch, heads)


class CudaWgmmaAttention(GluonBlockSparseAttention):
    """The CUDA family's Hopper kernel (``mainloop = "wgmma"``) as an op: the Gluon op's call,
    validation and error word over this family's launch. Forward only: a call that needs
    gradients goes to the Triton family's op, as from every family without backward kernels.
    K/V of q's shape only (no cross-attention, GQA or packed varlen here)."""

    backend = "cuda"
    runs_on = "Hopper GPUs (sm_90a) for its wgmma mainloop"
    takes_separate_kv = False
    provides_max_prob = True

    def __init__(self, spec: Spec, config: KernelConfig, target: Target | None,
                 config_source: str = "explicit") -> None:
        if target is None:
            raise ValueError("the CUDA family's wgmma kernel needs a Hopper target: run on "
                             "such a GPU or pass target=...")
        problems = wgmma.violations(spec.kernel_spec, config, target)
        if problems:
            raise ValueError("; ".join(problems))
        super().__init__(spec, config, target, config_source)

    def __repr__(self) -> str:
        return (f"CudaWgmmaAttention(spec={self.spec.short_hash}, config={self.config.name}, "
                f"target={self.target.name}, from={self.config_source})")

    def _launch_for(self, store_lse: bool, store_max_prob: bool = False,
                    separate_kv: bool = False):
        if separate_kv:
            raise ValueError("the CUDA wgmma kernel takes K/V of q's shape only: use the gluon "
                             "family for cross-attention, GQA or packed varlen")
        key = (store_lse, store_max_prob, separate_kv)
        run = self._launches.get(key)
        if run is None:
            cfg = self.config.replace(store_lse=store_lse, store_max_prob=store_max_prob)
            run = self._launches[key] = WgmmaLaunch(self.spec.kernel_spec, cfg, self.target)
        return run

    def __call__(self, q, k, v, topk_idx, vbs, counts=None, *, sm_scale: float | None = None,
                 return_lse: bool = True, return_max_prob: bool = False,
                 check_values: bool = False, q_vbs=None):
        """(o, lse), or o with return_lse=False; with return_max_prob=True an
        `AttentionOutput(o, lse, max_prob, max_prob_cube)`."""
        from tilegen.inputs import validate_inputs

        if q_vbs is not None:
            raise ValueError("q_vbs: the CUDA wgmma kernel takes K/V of q's shape only")
        shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                 check_values=check_values)
        return self._call(q, k, v, vbs, (topk_idx, vbs, counts), shapes,
                          dict(topk_idx=topk_idx, counts=counts), sm_scale, return_lse,
                          return_max_prob, check_values)

    def forward_for_grad(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("the CUDA wgmma kernel is forward only: a call that needs "
                                  "gradients runs the Triton family's op (tilegen.backends."
                                  "triton.op.differentiable_op)")

    def launch(self, q, k, v, topk_idx, vbs, counts=None, *, shapes=None,
               sm_scale: float | None = None, store_lse: bool = True, out=None,
               max_prob_out=None, q_vbs=None):
        """Pre-pass and kernel with no input checks (validate once first)."""
        from tilegen.inputs import validate_inputs

        if q_vbs is not None:
            raise ValueError("q_vbs: the CUDA wgmma kernel takes K/V of q's shape only")
        if shapes is None:
            shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                     check_values=False)
        return self._launch_plan(q, k, v, vbs, shapes, dict(topk_idx=topk_idx, counts=counts),
                                 sm_scale, store_lse, out, max_prob_out)


def _quant_op_class():
    from tilegen.backends.gluon.quant import _QuantLutOp

    class CudaWgmmaQuantAttention(_QuantLutOp, CudaWgmmaAttention):
        """The 8-bit op (``Spec(quant="int8_fp8")``) on the CUDA family's Hopper kernel:
        ``o, lse = op(q, k, v, topk_idx, vbs, counts=None)`` with bf16/fp16 q, k, v of one
        shape (BSHD), quantized here by `tilegen.quant`'s pre-pass; o in q's dtype. Forward
        only; `from_quantized` takes inputs already quantized (`quantize`)."""

        def _quant_launch(self, cfg: KernelConfig):
            return WgmmaQuantLaunch(self.spec.kernel_spec, cfg, self.target)

        def quantize(self, q, k, v, vbs, *, with_q: bool = True, sources=None,
                     pool: bool = False, norm_rope=None):
            """The pre-pass in the layout this kernel reads (V^T keys in MMA slot order):
            what `from_quantized` takes. Q is always quantized (``with_q`` must be True).
            ``sources``: token-order inputs reordered by the same pass; ``pool``: the cube
            means of q and k as well; ``norm_rope``: q and k are projections the pass puts
            through Wan's prologue (`quant.quantize`)."""
            from tilegen import quant

            if not with_q:
                raise ValueError("with_q=False: the CUDA 8-bit kernel reads Q quantized by the "
                                 "pre-pass")
            bulk = wgmma.options_of(self.config)["kv_copies"] == "bulk"
            return quant.quantize(q, k, v, vbs, self.spec.quant, **quant_layout(bulk),
                                  sources=sources, pool=pool, norm_rope=norm_rope)

        writes_token_order = True  # the epilogue stores o's rows at ``out_rows``

        def from_quantized(self, quantized, topk_idx, vbs, counts=None, *, sm_scale=None,
                           return_lse: bool = True, out_rows=None, out_len: int | None = None):
            """As the 8-bit op's (`_QuantLutOp.from_quantized`, ``out_rows`` included); K's
            scales must be the pre-pass's, one a 32-key half (``quantized.k_scale_group``):
            this kernel reads one scale a half, so per-key scales would be read wrong, and are
            refused."""
            from tilegen import quant

            if quantized.k_scale_group != quant.K_SCALE_GROUP:
                raise ValueError(
                    f"the CUDA wgmma 8-bit kernel reads one K scale a {quant.K_SCALE_GROUP}-key "
                    f"half; these inputs have one a group of {quantized.k_scale_group} "
                    "(QuantizedInputs.k_scale_group): quantize with tilegen.quant.quantize "
                    "(or op.quantize)")
            return super().from_quantized(quantized, topk_idx, vbs, counts, sm_scale=sm_scale,
                                          return_lse=return_lse, out_rows=out_rows,
                                          out_len=out_len)

    return CudaWgmmaQuantAttention


def make_wgmma_op(spec: Spec, cfg: KernelConfig, target: Target | None,
                  config_source: str = "explicit"):
    """The op of a wgmma config: the 8-bit one for a quantized spec."""
    if spec.quant != "none":
        return _quant_op_class()(spec, cfg, target, config_source)
    return CudaWgmmaAttention(spec, cfg, target, config_source)
