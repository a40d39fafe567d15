"""The Gluon family's 8-bit kernel (issue #19): INT8 Q.K^T and e4m3 P.V on Hopper's wgmma
(IGMMA, QGMMA), rendered from templates/gluon/lut_ws_quant.py.j2, for ``Spec(quant="int8_fp8")``.

The op quantizes q, k and v with `tilegen.quant.quantize` (two launches, no host sync), plans the
tiles in 32-key halves (`prepass._plan_halves`: LUT rows or sliding-tile windows), then
runs the kernel. A model that keeps its K/V quantized passes the pre-pass's output instead
(`GluonQuantAttention.from_quantized`). Forward only: a call that needs gradients is refused.

The knobs (`KernelConfig.options`, over `DEFAULTS`; constexpr parameters of the kernel):

    num_consumers   query cubes a CTA, each its own consumer warpgroup, producer warp and rings
                    (rendered into the source); the CTA's warps pad to whole warpgroups, so 1
                    is 8 warps (2 CTAs an SM at 128 registers) and 3 is 16 (3 consumers an SM)
    k_stages        K_STAGES: K ring depth (at least 2: O is staged in two of its slots)
    v_stages        V_STAGES: V^T ring depth
    qk_ahead        QK_AHEAD: S of tile j+1 issued before the softmax of tile j (one more S
                    accumulator live), not after it
    pack_halves     the pre-pass packs cubes of at most 32 tokens two to a tile
    key_tma         KEY_TMA: the producer loads each K half's scales and key biases with it
                    (TMA into the K stage), so the consumer's loop reads no global memory;
                    off: the consumer loads scales and fills a tile ahead (not with qk_ahead)
    wide_s          WIDE_S: S of a tile in one m64n64 IGMMA chain and P one 64x64 tile (its
                    32-key column halves feed the P.V halves), not two m64n32 halves (key_tma)
    joint_free      JOINT_FREE: one consumer arrive a tile frees its K stage and the previous
                    tile's V stage (Gluon's arrive is a warpgroup bar.sync: one less a tile);
                    needs wide_s and k_stages == v_stages
    two_level       TWO_LEVEL: each tile's P.V into a fresh fp32 accumulator added to O after
                    (Hopper's 8-bit MMA adds at reduced precision); off: the MMA adds into O
                    itself, 64 fewer live registers a thread (what lets num_consumers 3 build
                    without spills) at a cost in accuracy (H200: mean error 1.7x the
                    emulation's, against 1.02x; bench/NOTES.md); needs wide_s
    l_mma           L_MMA: the softmax's row sums by the MMA (P x a column of ones, one m64n8
                    QGMMA pair a tile) instead of FADDs, over the e4m3 P that P.V multiplies;
                    needs wide_s
    q_regs          Q_REGS: S's A operand (the int8 query tile) from registers, loaded once,
                    not read from shared memory by every S; needs wide_s
    vt_tiled        VT_TILED: V^T read as the pre-pass's 32-key tiles (each a run of bytes in the
                    P.V operand's shared-memory order) by boxes of 128-byte rows, not as head_dim
                    rows of 32 bytes
    poly_exp        POLY_EXP: quarters of each tile's exp2 (0, 1 or 2) computed on the FMA pipe
                    (exponent bits and a degree-2 polynomial) instead of the MUFU; built for
                    sm_90a, not yet run on the H200 (so not in the tuning space)
    q_in_kernel     Q_BF16: the kernel reads q in its dtype and quantizes each query cube itself
                    (the pre-pass then does K and V only); `from_quantized` runs it off, on the
                    given q8
    store_lse       STORE_LSE: write the base-2 log-sum-exp
    consumer_regs   CONSUMER_REGS: the consumer warpgroups' registers (the launch's maxnreg
                    leaves them that; the setmaxnreg of consumers past the first)
    producer_regs   PRODUCER_REGS: the producer warp's setmaxnreg

Rendering needs no torch or triton, so it works anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tilegen.backends.gluon import render as _render
from tilegen.backends.gluon.prepass import HALF_FILL_SHIFT
from tilegen.config import KernelConfig
from tilegen.render import Source, render, spec_basename
from tilegen.spec import Spec
from tilegen.targets import Target

TEMPLATE = "gluon/lut_ws_quant.py.j2"
KERNEL_NAME = "tilegen_gluon_lut_ws_quant"
#: the quant modes this kernel computes; "int8" (INT8 Q.K, bf16 P.V) has no kernel yet
QUANT_KERNELS = ("int8_fp8",)
#: the knobs, with their defaults (the measured best on the H200: bench/NOTES.md; key_tma and
#: wide_s session 15's, -6.8% and -5.9% on the kernel)
DEFAULTS: dict[str, Any] = {
    "num_consumers": 1,
    "k_stages": 4,
    "v_stages": 2,
    "qk_ahead": False,
    "pack_halves": True,
    "key_tma": True,
    "q_in_kernel": True,
    "wide_s": True,
    "joint_free": False,
    "two_level": True,
    "l_mma": False,
    "q_regs": False,
    "vt_tiled": False,
    "poly_exp": 0,
    "store_lse": False,
    "consumer_regs": 232,
    "producer_regs": 24,
}
CONSTEXPR_NAMES: dict[str, str] = {
    "k_stages": "K_STAGES",
    "v_stages": "V_STAGES",
    "qk_ahead": "QK_AHEAD",
    "key_tma": "KEY_TMA",
    "q_in_kernel": "Q_BF16",
    "wide_s": "WIDE_S",
    "joint_free": "JOINT_FREE",
    "two_level": "TWO_LEVEL",
    "l_mma": "L_MMA",
    "q_regs": "Q_REGS",
    "vt_tiled": "VT_TILED",
    "poly_exp": "POLY_EXP",
    "store_lse": "STORE_LSE",
    "consumer_regs": "CONSUMER_REGS",
    "producer_regs": "PRODUCER_REGS",
}
#: log2 of P's e4m3 scale (`tilegen.quant.P_SCALE`, e4m3's largest value 448)
LOG2_P_SCALE = math.log2(448.0)


def resolve(cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """`cfg` over the defaults; unknown keys are an error (the bf16 kernel's knobs included:
    a config of one kernel must not pass silently as the other's)."""
    cfg = dict(cfg or {})
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown 8-bit Gluon config key(s) {unknown}; known: "
                         f"{sorted(DEFAULTS)}")
    return {**DEFAULTS, **cfg}


def options_of(cfg: KernelConfig) -> dict[str, Any]:
    return resolve({**dict(cfg.options), "store_lse": cfg.store_lse})


def _slots(opts: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved options as `render.maxnreg_for` reads them."""
    return dict(opts)


def smem_bytes(opts: Mapping[str, Any], block: int = 64, head_dim: int = 128) -> int:
    tile = block * head_dim  # one 8-bit tile: K, V^T or Q
    rings = opts["k_stages"] + opts["v_stages"]
    meta = 4 * (opts["k_stages"] if opts["key_tma"] else 1) * block // 2 * 4
    q16 = 2 * tile if opts["q_in_kernel"] else 0
    one = tile * (1 + rings) + q16 + 2 * block * block + meta + 8 * (1 + 2 * rings)
    return opts["num_consumers"] * one + _render.COMPILER_SMEM_SLACK


def spec_problem(spec: Spec, target: Target | None) -> str | None:
    """Why the 8-bit kernel cannot compute `spec` on `target` with any config, or None."""
    if spec.quant not in QUANT_KERNELS:
        return (f"quant={spec.quant!r}: the Gluon family's 8-bit kernel computes "
                f"{list(QUANT_KERNELS)} (INT8 Q.K, e4m3 P.V); INT8 Q.K with bf16 P.V has no "
                "kernel yet")
    why = _render.spec_problem(spec)
    if why:
        return why
    if target is not None and _render.mma_kind(spec, target) != "wgmma":
        return (f"quant={spec.quant!r} on {target.name}: the 8-bit Gluon kernel is written for "
                "Hopper's wgmma (IGMMA for int8, QGMMA for e4m3); Blackwell's tcgen05 kinds "
                "i8 and f8f6f4 have no consumer yet")
    return None


def check(spec: Spec, opts: Mapping[str, Any], target: Target | None = None) -> str | None:
    """Why this spec/config cannot be rendered or launched, or None."""
    why = spec_problem(spec, target)
    if why:
        return why
    if opts["num_consumers"] not in (1, 2, 3):
        return "num_consumers must be 1, 2 or 3"
    if opts["k_stages"] < 2:
        return "k_stages must be at least 2: the 8-bit kernel stages O in two K slots"
    if opts["v_stages"] < 1:
        return "v_stages must be at least 1"
    if opts["joint_free"] and not (opts["wide_s"] and opts["k_stages"] == opts["v_stages"]):
        return ("joint_free frees a K stage and a V stage with one arrive: it needs wide_s and "
                "k_stages == v_stages")
    if opts["poly_exp"] not in (0, 1, 2):
        return "poly_exp is 0, 1 or 2 quarters of a tile's exp2"
    if opts["poly_exp"] and not opts["wide_s"]:
        return "poly_exp is written for wide_s"
    if opts["q_regs"] and not opts["wide_s"]:
        return "q_regs (Q in registers) is written for wide_s"
    if opts["l_mma"] and not opts["wide_s"]:
        return "l_mma (row sums by the MMA) is written for wide_s"
    if not opts["two_level"] and not opts["wide_s"]:
        return "two_level off (P.V into O itself) is written for wide_s"
    if opts["wide_s"] and not opts["key_tma"]:
        return "wide_s reads each tile's K scales from the K stage: it needs key_tma"
    if opts["key_tma"] and opts["qk_ahead"]:
        return ("key_tma reads a tile's K scales in its own S step; qk_ahead issues S a tile "
                "early: choose one")
    if target is not None:
        smem = smem_bytes(opts, 64, spec.head_dim)
        if smem > target.max_shared_bytes:
            return f"shared memory {smem} B over {target.max_shared_bytes}"
        slots = _slots(opts)
        threads = _render.launch_warps(slots, target) * target.warp_size
        reg = _render.maxnreg_for(slots, target)
        if reg * threads > target.registers_per_sm or reg > target.max_registers_per_thread:
            return "consumer_regs do not fit the register file"
    return None


def default_config(spec: Spec) -> KernelConfig:
    """The 8-bit kernel's default where the target has no [default.gluon_quant]: one 64x64
    consumer of 4 warps, `DEFAULTS`."""
    opts = {k: v for k, v in DEFAULTS.items() if k != "store_lse"}
    return KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=1, options=opts)


def render_quant(spec: Spec, cfg: KernelConfig, target: Target) -> Source:
    opts = options_of(cfg)
    why = check(spec, opts)
    if why:
        raise ValueError(why)
    if _render.mma_kind(spec, target) != "wgmma":
        raise ValueError(spec_problem(spec, target) or "the 8-bit kernel needs wgmma")
    name = f"{spec_basename(spec)}_{spec.quant}_{cfg.render_name}.py"
    return render(TEMPLATE, "triton", spec, cfg.render_options(), name, KERNEL_NAME, target,
                  block=spec.block_kv, head_dim=spec.head_dim, quant=spec.quant,
                  gl_dtype=_render.GL_DTYPES[spec.dtype], arch=target.arch,
                  log2_p_scale=repr(LOG2_P_SCALE), fill_shift=HALF_FILL_SHIFT,
                  num_consumers=opts["num_consumers"])


def constexprs(opts: Mapping[str, Any]) -> dict[str, Any]:
    return {name: opts[knob] for knob, name in CONSTEXPR_NAMES.items()}


# ------------------------------------------------------------------------------------ launch
def _layouts(head_dim: int, dtype: str) -> dict[str, Any]:
    from triton.experimental.gluon import language as gl

    return {"q": gl.NVMMASharedLayout.get_default_for([64, head_dim], gl.int8),
            "q16": gl.NVMMASharedLayout.get_default_for(
                [64, head_dim], gl.bfloat16 if dtype == "bf16" else gl.float16),
            "k": gl.NVMMASharedLayout.get_default_for([32, head_dim], gl.int8),
            "vt": gl.NVMMASharedLayout.get_default_for([head_dim, 32], gl.float8e4nv),
            # vt_tiled: a 32-key tile as head_dim / 4 rows of 128 bytes, copied as they lie
            "vt_linear": gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2),
            # a half's K scales or key biases: one unswizzled row of 32 fp32
            "meta": gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
            "o": gl.NVMMASharedLayout.get_default_for(
                [64, head_dim], gl.bfloat16 if dtype == "bf16" else gl.float16)}


class QuantLaunch:
    """One rendered 8-bit variant, launchable on CUDA tensors of a wgmma target. Called as
    `tilegen.backends.gluon.launch.GluonLaunch` is, plus ``quantized`` (the pre-pass's
    output, else it runs here)."""

    def __init__(self, source: Source, opts: dict[str, Any], spec: Spec,
                 target: Target) -> None:
        from tilegen.backends.gluon.launch import load_kernel

        self.source = source
        self.cfg = opts
        self.spec = spec
        self.kernel = load_kernel(source, KERNEL_NAME)
        self.maxnreg = _render.maxnreg_for(_slots(opts), target)
        self.num_warps = target.fact("warps_per_warpgroup")
        self._bufs: dict = {}
        self._layouts = _layouts(spec.head_dim, spec.dtype)

    def _buffers(self, device, rows: int, topk: int, nkv: int):
        from tilegen.backends.gluon.prepass import halves_buffers

        key = (str(device), rows, topk, nkv)
        b = self._bufs.get(key)
        if b is None:
            b = self._bufs[key] = halves_buffers(device, rows, topk, nkv)
        return b

    def __call__(self, q, k, v, topk_idx, vbs, counts, o, lse, err, sm_scale: float,
                 max_prob_out=None, windows=None, cube_grid=None, topk: int = 0,
                 quantized=None) -> None:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        from tilegen import quant
        from tilegen.backends.gluon.prepass import run_halves_prepass, run_halves_window_prepass
        from tilegen.reference import LOG2E

        # Q in the kernel unless the inputs come quantized (from_quantized: q8 given)
        q_in_kernel = bool(self.cfg["q_in_kernel"]) and quantized is None
        qi = quantized if quantized is not None else quant.quantize(
            q, k, v, vbs, self.spec.quant, with_q=not q_in_kernel,
            vt_tiles=bool(self.cfg["vt_tiled"]))
        if qi.k_tiles or qi.vt_slots:
            raise ValueError("the gluon family's 8-bit kernel reads K8 as (B, S, H, D) and V^T "
                             "with its keys in order: quantize with tilegen.quant.quantize "
                             "without k_tiles or vt_slots (or op.quantize)")
        if qi.vt_tiles != bool(self.cfg["vt_tiled"]):
            want = "32-key tiles" if self.cfg["vt_tiled"] else "(B, H, D, S)"
            raise ValueError(f"this 8-bit config (vt_tiled={bool(self.cfg['vt_tiled'])}) reads "
                             f"V^T as {want}: quantize with tilegen.quant.quantize(..., "
                             f"vt_tiles={bool(self.cfg['vt_tiled'])})")
        B, S, H, D = qi.k8.shape
        nq, nkv = S // 64, vbs.shape[0]
        if windows is None:
            topk = topk_idx.shape[3]
        rows = B * H * nq
        bufs = self._buffers(qi.k8.device, rows, topk, nkv)
        if windows is not None:
            run_halves_window_prepass(windows, vbs, bufs, rows, H, nq, cube_grid, topk, err,
                                      pack=self.cfg["pack_halves"])
        else:
            run_halves_prepass(topk_idx, vbs, counts, bufs, rows, nkv, topk, err,
                               pack=self.cfg["pack_halves"])
        lay = self._layouts

        def desc(t, box, layout):
            r, c = t.shape
            return TensorDescriptor(t, [r, c], [c, 1], box, layout)

        q_desc = (desc(q.contiguous().view(B * S, H * D), [64, D], lay["q16"]) if q_in_kernel
                  else desc(qi.q8.view(B * S, H * D), [64, D], lay["q"]))
        consts = {**constexprs(self.cfg), "Q_BF16": q_in_kernel}
        nc = self.cfg["num_consumers"]
        self.kernel[(-(-nq // nc), B * H)](
            q_desc,
            desc(qi.k8.view(B * S, H * D), [32, D], lay["k"]),
            (desc(qi.v8t.view(-1, 128), [D // 4, 128], lay["vt_linear"]) if self.cfg["vt_tiled"]
             else desc(qi.v8t.view(B * H * D, S), [D, 32], lay["vt"])),
            desc(o.view(B * S, H * D), [64, D], lay["o"]),
            desc(qi.k_scale.view(B * H, S), [1, 32], lay["meta"]),
            desc(bufs["key_bias"], [1, 32], lay["meta"]),
            bufs["plan"], bufs["meta"], vbs,
            lse if lse is not None else bufs["meta"],
            qi.k_scale if q_in_kernel else qi.q_scale, qi.k_scale, qi.v_scale, qi.v_mean,
            qi.k_mean, S, H, nq, topk, float(sm_scale) * LOG2E, **consts,
            num_warps=self.num_warps, maxnreg=self.maxnreg)
        if lse is not None and not q_in_kernel:  # with Q in the kernel, it adds the term
            add_smoothing_to_lse(lse, qi, float(sm_scale) * LOG2E)


def add_smoothing_to_lse(lse, qi, qk_scale: float) -> None:
    """The kernel's logits are of the smoothed keys k - k̄ (softmax is invariant to k̄, the
    log-sum-exp is not): add each row's q̂_i . k̄ (q̂ = q8 * q_scale, the logits' own q) back,
    in base 2, so that lse is that of q.k as every family's."""
    import torch

    qk_bar = torch.einsum("bshd,bhd->bhs", qi.q8.float(), qi.k_mean) * qi.q_scale
    lse.add_(qk_bar, alpha=qk_scale)


def signature(opts: Mapping[str, Any], head_dim: int, dtype: str) -> tuple[dict, dict]:
    """Kernel signature strings for triton.compile (no tensors needed) and the constexprs."""
    lay = _layouts(head_dim, dtype)

    def td(dt, box, layout):
        return f"tensordesc<{dt}[{box[0]}, {box[1]}],{layout!r}>"

    q_desc = (td(dtype, [64, head_dim], lay["q16"]) if opts["q_in_kernel"]
              else td("i8", [64, head_dim], lay["q"]))
    sig = {"q_desc": q_desc,
           "k_desc": td("i8", [32, head_dim], lay["k"]),
           "vt_desc": (td("fp8e4nv", [head_dim // 4, 128], lay["vt_linear"]) if opts["vt_tiled"]
                       else td("fp8e4nv", [head_dim, 32], lay["vt"])),
           "o_desc": td(dtype, [64, head_dim], lay["o"]),
           "ksc_desc": td("fp32", [1, 32], lay["meta"]),
           "kbias_desc": td("fp32", [1, 32], lay["meta"]),
           "plan_ptr": "*i32", "meta_ptr": "*i32", "vbs_ptr": "*i32",
           "lse_ptr": "*fp32", "qsc_ptr": "*fp32", "ksc_ptr": "*fp32", "vsc_ptr": "*fp32",
           "vmean_ptr": "*fp32", "kmean_ptr": "*fp32", "seq_len": "i32", "num_heads": "i32",
           "num_q_blocks": "i32", "topk": "i32", "qk_scale": "fp32"}
    consts = constexprs(opts)
    sig.update({name: "constexpr" for name in consts})
    return sig, consts


def compile_offline(source: Source, opts: Mapping[str, Any], head_dim: int, dtype: str,
                    target: Target):
    """Compile for the target here (no GPU needed): Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from tilegen.backends.gluon.launch import load_kernel

    fn = load_kernel(source, KERNEL_NAME)
    sig, consts = signature(opts, head_dim, dtype)
    return triton.compile(GluonASTSource(fn, sig, consts),
                          target=GPUTarget(target.triton_backend, target.triton_arch,
                                           target.warp_size),
                          options={"num_warps": target.fact("warps_per_warpgroup"),
                                   "maxnreg": _render.maxnreg_for(_slots(opts), target)})


# ---------------------------------------------------------------------------------------- op
def _no_grad_error() -> ValueError:
    return ValueError("the 8-bit kernels compute the forward only (no backward): train with "
                      "Spec(quant='none'), or call under torch.no_grad() / with inputs that do "
                      "not require grad")


class _QuantOp:
    """What the 8-bit ops change of the bf16 Gluon ops (mixed in before them)."""

    #: K/V of q's shape only (the kernel addresses K/V by q's rows and heads)
    takes_separate_kv = False
    provides_max_prob = False

    def __init__(self, spec: Spec, config: KernelConfig, target: Target | None,
                 config_source: str = "explicit") -> None:
        if target is None:
            from tilegen.targets import TARGET_NAMES, get_target

            having = [n for n in TARGET_NAMES
                      if spec_problem(spec, get_target(n)) is None
                      and "gluon" in get_target(n).backends]
            raise ValueError(f"quant={spec.quant!r}: the 8-bit kernel needs a target with "
                             f"Hopper's wgmma ({having}): run on such a GPU, or pass one as "
                             "target= to build it here")
        super().__init__(spec, config, target, config_source)  # type: ignore[call-arg]

    def _launch_for(self, store_lse: bool, store_max_prob: bool = False,
                    separate_kv: bool = False):
        if store_max_prob or separate_kv:
            raise ValueError("the 8-bit kernel writes no max_prob and reads no separate K/V")
        key = (store_lse, False, False)
        run = self._launches.get(key)
        if run is None:
            run = self._launches[key] = self._quant_launch(
                self.config.replace(store_lse=store_lse))
        return run

    def _quant_launch(self, cfg: KernelConfig):
        """The launch of one 8-bit variant: this family's (the CUDA family's op overrides it)."""
        return QuantLaunch(render_quant(self.spec, cfg, self.target), options_of(cfg),
                           self.spec, self.target)

    def _call(self, q, k, v, vbs, cubes, shapes, plan, sm_scale, return_lse, return_max_prob,
              check_values, grad_kwargs=None):
        import torch

        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise _no_grad_error()
        if return_max_prob:
            raise ValueError("return_max_prob: the 8-bit kernel does not write the softmax "
                             "signal; use Spec(quant='none')")
        return super()._call(q, k, v, vbs, cubes, shapes, plan, sm_scale, return_lse,  # type: ignore[misc]
                             False, check_values, grad_kwargs)

    def forward_for_grad(self, *args, **kwargs):
        raise _no_grad_error()

    def quantize(self, q, k, v, vbs, *, with_q: bool = True, sources=None, pool: bool = False,
                 norm_rope=None):
        """The pre-pass (`tilegen.quant.quantize`) in the layout this op's kernel reads (V^T
        tiled or not, the config's ``vt_tiled``): what `from_quantized` takes. ``sources``
        (`tilegen.layout.cube_sources`): q, k, v in token order, reordered to cubes by the
        same pass; ``pool``: the cube means of q and k as well, for the selection;
        ``norm_rope`` (`tilegen.prologue.NormRope`): q and k are projections the pass puts
        through Wan's prologue."""
        from tilegen import quant

        return quant.quantize(q, k, v, vbs, self.spec.quant, with_q=with_q,
                              vt_tiles=bool(options_of(self.config)["vt_tiled"]),
                              sources=sources, pool=pool, norm_rope=norm_rope)


def _check_quantized(spec: Spec, qi, vbs) -> None:
    """The pre-quantized inputs' own shapes and mode (the op's call checks q, k, v otherwise)."""
    if qi.mode != spec.quant:
        raise ValueError(f"quantized inputs of mode {qi.mode!r}; this op computes "
                         f"quant={spec.quant!r}")
    if qi.q8 is None or qi.q_scale is None:
        raise ValueError("quantized inputs without q8/q_scale (quantize(..., with_q=False)): "
                         "from_quantized takes Q quantized too (with_q=True, the default)")
    from tilegen.quant import k8_shape

    if qi.v8t is None or k8_shape(qi) != tuple(qi.q8.shape):
        raise ValueError("quantized inputs: k8 must have q8's shape and v8t must be set "
                         "(tilegen.quant.quantize(q, k, v, vbs, 'int8_fp8'))")
    B, S, H, D = qi.q8.shape
    if D != spec.head_dim or S % 64 or vbs.shape != (S // 64,):
        raise ValueError(f"quantized inputs of shape {tuple(qi.q8.shape)} and vbs "
                         f"{tuple(vbs.shape)}: want head_dim {spec.head_dim} and one vbs entry "
                         "per 64-token cube")


def _from_quantized(op, qi, vbs, plan: dict, *, sm_scale, return_lse: bool,
                    out_len: int | None = None):
    import torch

    _check_quantized(op.spec, qi, vbs)
    B, S, H, D = qi.q8.shape
    dtype = torch.bfloat16 if op.spec.dtype == "bf16" else torch.float16
    dev = qi.q8.device
    # out_len: o in the model's token order (a launch that takes out_rows writes it so)
    o = torch.empty((B, S if out_len is None else out_len, H, D), dtype=dtype, device=dev)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=dev) if return_lse else None
    op.errors.raise_pending(dev)
    scale = sm_scale if sm_scale is not None else op.spec.sm_scale
    plan = {"topk_idx": None, "counts": None, **plan}
    op._launch_for(return_lse)(None, None, None, plan.pop("topk_idx"), vbs, plan.pop("counts"),
                              o, lse, op.errors.buffer(dev), scale, quantized=qi, **plan)
    op.errors.after_launch(dev)
    return (o, lse) if return_lse else o


class _QuantLutOp(_QuantOp):
    """The 8-bit LUT op's call and pre-quantized entry point, over any family's 8-bit launch
    (this family's, and the CUDA family's wgmma kernel: `tilegen.backends.cuda.wgmma_op`)."""

    def __repr__(self) -> str:
        return "Quant" + super().__repr__()

    def __call__(self, q, k, v, topk_idx, vbs, counts=None, *, sm_scale=None,
                 return_lse: bool = True, return_max_prob: bool = False,
                 check_values: bool = False, q_vbs=None):
        if q_vbs is not None or k.shape != q.shape or v.shape != q.shape:
            raise ValueError(f"the 8-bit kernel takes q, k and v of one shape (got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
                             f"{', and q_vbs' if q_vbs is not None else ''})")
        return super().__call__(q, k, v, topk_idx, vbs, counts, sm_scale=sm_scale,  # type: ignore[misc]
                                return_lse=return_lse, return_max_prob=return_max_prob,
                                check_values=check_values)

    #: whether the launch stores o in the caller's token order (``from_quantized``'s
    #: ``out_rows``): the CUDA wgmma kernel's epilogue does, this family's does not
    writes_token_order = False

    def from_quantized(self, quantized, topk_idx, vbs, counts=None, *, sm_scale=None,
                       return_lse: bool = True, out_rows=None, out_len: int | None = None):
        """The kernel on inputs already quantized by the recipe (`quantize`, or a model's own
        K/V kept in its format across steps): ``quantized`` is a
        `tilegen.quant.QuantizedInputs` in the layout this op reads. Index values are checked
        on the GPU, as in a call; shapes here.

        ``out_rows`` (int32 ``(S,)`` on the inputs' device, with ``out_len``; ops whose
        ``writes_token_order`` is set): o comes out ``(B, out_len, H, D)`` with slot ``s``'s
        row at token ``out_rows[s]`` (the kernel's epilogue stores it there, so no reorder
        follows); a slot whose entry lies outside ``[0, out_len)`` (-1: a padded slot) is not
        written, and a token no slot names is left unwritten (`tilegen.layout.slot_tokens`
        names each token once). lse, when asked, stays in slot order."""
        import torch

        B, S, H, _ = quantized.q8.shape
        if topk_idx.dim() != 4 or tuple(topk_idx.shape[:3]) != (B, H, S // 64):
            raise ValueError(f"topk_idx of shape {tuple(topk_idx.shape)}: want "
                             f"({B}, {H}, {S // 64}, topk)")
        plan = {"topk_idx": topk_idx, "counts": counts}
        if out_rows is None:
            if out_len is not None:
                raise ValueError("out_len goes with out_rows")
        else:
            if not self.writes_token_order:
                raise ValueError(f"out_rows: {type(self).__name__}'s kernel stores o in slot "
                                 "order (layout.from_cubes reorders it); the CUDA wgmma 8-bit "
                                 "kernel takes out_rows")
            if not isinstance(out_rows, torch.Tensor) or out_rows.dtype != torch.int32 \
                    or tuple(out_rows.shape) != (S,) or out_rows.device != quantized.q8.device \
                    or not out_rows.is_contiguous():
                raise ValueError(f"out_rows must be a contiguous int32 ({S},) tensor on "
                                 f"{quantized.q8.device} (tilegen.layout.slot_tokens)")
            if isinstance(out_len, bool) or not isinstance(out_len, int) or out_len < 1:
                raise ValueError(f"out_len must be a positive int (the tokens of o), got "
                                 f"{out_len!r}")
            plan["out_rows"] = out_rows
        return _from_quantized(self, quantized, vbs, plan, sm_scale=sm_scale,
                               return_lse=return_lse, out_len=out_len)


def _lut_op():
    from tilegen.backends.gluon.op import GluonBlockSparseAttention

    class GluonQuantAttention(_QuantLutOp, GluonBlockSparseAttention):
        """The 8-bit op, LUT encoding: ``o, lse = op(q, k, v, topk_idx, vbs, counts=None)`` with
        bf16/fp16 q, k, v of one shape (quantized here), o in q's dtype. Forward only."""

    return GluonQuantAttention


def _window_op():
    from tilegen.backends.gluon.op import GluonSlidingTileAttention

    class GluonQuantSlidingTileAttention(_QuantOp, GluonSlidingTileAttention):
        """The 8-bit op, sliding-tile encoding: ``o, lse = op(q, k, v, vbs)``. Forward only."""

        def __repr__(self) -> str:
            return "Quant" + super().__repr__()

        def from_quantized(self, quantized, vbs, *, sm_scale=None, return_lse: bool = True):
            """As `GluonQuantAttention.from_quantized`, with the windows from the spec."""
            import math

            B, S, H, _ = quantized.q8.shape
            if S // 64 != self.spec.num_cubes:
                raise ValueError(f"quantized inputs hold {S // 64} cubes; the spec's grid "
                                 f"{self.spec.grid} has {self.spec.num_cubes}")
            plan = dict(windows=self.windows(quantized.q8.device, H),
                        cube_grid=self.spec.cube_grid,
                        topk=max(math.prod(w) for w in self.spec.windows))
            return _from_quantized(self, quantized, vbs, plan, sm_scale=sm_scale,
                                   return_lse=return_lse)

    return GluonQuantSlidingTileAttention


def make_op(spec: Spec, cfg: KernelConfig, target: Target | None, config_source: str):
    cls = _window_op() if spec.encoding == "sliding_tile" else _lut_op()
    return cls(spec, cfg, target, config_source)
