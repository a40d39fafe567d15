"""Render the warp-specialized Gluon kernel (templates/gluon/lut_ws_kernel.py.j2) for sm_90a
(wgmma consumer) or sm_100a (tcgen05 consumer).

`render_gluon(spec, cfg, target)` returns the kernel source. The source holds the facts of the
spec and the target as module constants (block, head dim, dtype, and MMA: the consumer's
tensor-core instructions), and num_consumers; every other knob is a constexpr parameter of the
kernel, with a compile-time ``if`` where it changes the code. `constexprs(opts)` gives their
values from the KernelConfig's `options` (`options_of`); the launch (`launch.GluonLaunch`) and
the AOT compile (`launch.compile_offline`) pass them:

    num_consumers   NUM_CONSUMERS: consumer warpgroups per CTA, each on its own query cube (1-3);
                    a module constant of the source, not a parameter: each consumer's buffers
                    and partitions are written out (warp_specialize takes one literal list)
    k_stages        K_STAGES: K ring depth per consumer
    v_stages        V_STAGES: V ring depth per consumer
    pack_partials   PACK_PARTIALS: pack partial KV cubes (vbs 32/16/8 of 64) into dense 64-key
                    tiles (the kernel then takes the half/quarter/eighth-cube descriptors)
    q_in_regs       Q_IN_REGS: Q as the A operand of Q.K^T from registers (else shared memory)
    qk_ahead        QK_AHEAD: issue Q.K^T of tile j together with P.V of tile j-1, softmax
                    overlaps P.V
    fence_wait      FENCE_WAIT: put the P.V wait behind an (always true) branch so ptxas keeps
                    it after the softmax instead of hoisting it to the top of the block
    store_lse       STORE_LSE: write the base-2 log-sum-exp
    store_max_prob  STORE_MAX_PROB: write the softmax-normalizer signal 1 / l and its per-cube
                    mean (the kernel then takes mp_ptr and mpc_ptr)
    share_kv        SHARE_KV: two consumers on neighbouring query cubes share one K/V ring that
                    walks the union of their LUT rows (a cube both chose is loaded once); needs
                    num_consumers 2, q_in_regs, qk_ahead and no debug (the kernel then takes
                    tmask_ptr)
    consumer_regs   CONSUMER_REGS: setmaxnreg of the consumer warpgroups (the launch's maxnreg
                    must fit them); producer_regs (PRODUCER_REGS) that of the producer warps
    debug           DEBUG: "" (real kernel), or a timing experiment with garbage results:
                    "no_loads" (producer issues no TMA) / "no_mma" (consumer does no math)

The pointer and descriptor parameters a knob leaves unused are passed as None (constexpr None:
no kernel argument). Rendering needs no torch, triton, optuna or sqlalchemy, so it works
anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tilegen.config import KernelConfig
from tilegen.render import Source, render, spec_basename
from tilegen.spec import Spec
from tilegen.targets import Target

TEMPLATE = "gluon/lut_ws_kernel.py.j2"
KERNEL_NAME = "tilegen_gluon_lut_ws"

#: the knobs worth tuning, with their defaults (the measured best on the H200)
DEFAULTS: dict[str, Any] = {
    "num_consumers": 1,
    "k_stages": 2,
    "v_stages": 2,
    "pack_partials": True,
    "q_in_regs": True,
    "qk_ahead": True,
    "fence_wait": True,
    "store_lse": False,
    "store_max_prob": False,
    "share_kv": False,
    "consumer_regs": 232,
    "producer_regs": 24,
    "debug": "",
}
GL_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
#: shared memory the compiler adds to what `smem_bytes` counts (warp_specialize captures,
#: the tensor-memory address slot, alignment; 276-616 B in the sm_90a and sm_100a builds)
COMPILER_SMEM_SLACK = 1024
#: the consumers the template writes, in order of preference: Hopper's wgmma (registers hold
#: S and O), Blackwell's tcgen05 (S and P.V in tensor memory)
MMA_KINDS = ("wgmma", "tcgen05")
#: knobs of the wgmma consumer alone (the tcgen05 one reads Q from shared memory, waits on each
#: MMA's mbarrier and has no pair mode yet); on a tcgen05 target they must be off
WGMMA_ONLY = ("q_in_regs", "qk_ahead", "fence_wait", "share_kv")


def resolve(cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """`cfg` over the defaults; unknown keys are an error (a typo must not pass silently)."""
    cfg = dict(cfg or {})
    unknown = sorted(set(cfg) - set(DEFAULTS) - {"maxnreg", "num_warps"})
    if unknown:
        raise ValueError(f"unknown Gluon config key(s) {unknown}; known: {sorted(DEFAULTS)}")
    out = dict(DEFAULTS)
    out.update({k: v for k, v in cfg.items() if k in DEFAULTS})
    return out


def smem_bytes(cfg: Mapping[str, Any], block: int = 64, head_dim: int = 128,
               mma: str = "wgmma") -> int:
    tile = block * head_dim * 2
    rings = cfg["k_stages"] + cfg["v_stages"]
    per = tile * (1 + rings) + 8 * (1 + 2 * rings)  # Q + K/V rings, and their mbarriers
    if mma == "tcgen05":  # P staged for its MMA, and the S and P.V completion barriers
        per += block * block * 2 + 2 * 8
    if cfg.get("share_kv"):  # two Q tiles, one K ring and one V ring for both consumers
        return per + tile + 8 + COMPILER_SMEM_SLACK
    return cfg["num_consumers"] * per + COMPILER_SMEM_SLACK


def launch_warps(cfg: Mapping[str, Any], target: Target) -> int:
    """Warps the CTA launches: a warpgroup per consumer plus one producer warp each, rounded up
    to whole warpgroups (target.toml warps_per_warpgroup)."""
    n = cfg["num_consumers"]
    wg = target.fact("warps_per_warpgroup")
    return wg * (n + -(-n // wg))


def maxnreg_for(cfg: Mapping[str, Any], target: Target) -> int:
    """The kernel-wide register cap that leaves each consumer warpgroup `consumer_regs` after the
    producer warpgroup(s) drop to `producer_regs` (setmaxnreg moves registers within the CTA)."""
    n = cfg["num_consumers"]
    wg = target.fact("warps_per_warpgroup")
    wg_threads = wg * target.warp_size
    producer_wgs = -(-n // wg)
    total = n * wg_threads * cfg["consumer_regs"] + producer_wgs * wg_threads * cfg["producer_regs"]
    per_thread = -(-total // (launch_warps(cfg, target) * target.warp_size))
    return -(-per_thread // 8) * 8


def tmem_columns(cfg: Mapping[str, Any], block: int = 64, head_dim: int = 128) -> int:
    """Tensor-memory columns a tcgen05 CTA allocates: per consumer S (block columns of fp32) and
    P.V (head_dim). A 64-row tile (the only block `spec_problem` admits) uses half of the 128
    lanes, so Triton stacks the two in the lane halves of one column range (P.V at lane 16 of
    each warp's block in the SASS); the allocation is a power of two, at least 32 columns."""
    return max(32, 1 << (cfg["num_consumers"] * max(block, head_dim) - 1).bit_length())


def spec_problem(spec: Spec) -> str | None:
    """Why the kernel cannot compute `spec` with any config, or None."""
    if spec.block_q != 64 or spec.block_kv != 64:
        return "the Gluon kernel takes 64-token query and KV cubes only"
    if spec.head_dim not in (64, 128):
        return f"head_dim {spec.head_dim}: the Gluon kernel takes 64 or 128"
    if spec.dtype not in GL_DTYPES:
        return "dtype must be bf16 or fp16"
    if spec.layout != "bshd":
        return "the Gluon kernel reads BSHD only (TMA boxes over the (B*S, H*D) view)"
    if spec.encoding not in ("lut", "sliding_tile"):
        return "the Gluon kernel walks a LUT row or a sliding-tile window (pre-pass)"
    return None


def check(spec: Spec, cfg: Mapping[str, Any], target: Target | None = None,
          mma: str | None = None) -> str | None:
    """Why this spec/config cannot be rendered or launched, or None. `mma` (the consumer's
    instruction family) defaults to the target's (`mma_kind`)."""
    if mma is None and target is not None:
        mma = mma_kind(spec, target)
    why = spec_problem(spec)
    if why:
        return why
    head_dim = spec.head_dim
    if mma == "tcgen05":
        on = [k for k in WGMMA_ONLY if cfg[k]]
        if on:
            return (f"{', '.join(on)}: wgmma consumer knobs; the tcgen05 consumer reads Q from "
                    "shared memory, waits on each MMA's mbarrier and has no pair mode: turn "
                    "them off on this target")
        if cfg["debug"]:
            return "the timing experiments (debug) are written for the wgmma consumer only"
    if not spec.encoding_info.has_lut_rows and cfg["share_kv"]:
        return "share_kv merges two LUT rows; sliding_tile has none (its windows overlap anyway)"
    if cfg["num_consumers"] not in (1, 2, 3):
        return "num_consumers must be 1, 2 or 3"
    if cfg["share_kv"] and cfg["num_consumers"] != 2:
        return "share_kv pairs two query cubes: it needs num_consumers 2"
    if cfg["share_kv"] and not (cfg["q_in_regs"] and cfg["qk_ahead"] and not cfg["debug"]):
        return ("share_kv's consumers hold Q in registers and issue Q.K ahead, with no timing "
                "experiments: it needs q_in_regs, qk_ahead and no debug")
    if target is not None:
        smem = smem_bytes(cfg, 64, head_dim, mma or "wgmma")
        if smem > target.max_shared_bytes:
            return f"shared memory {smem} B over {target.max_shared_bytes}"
        if mma == "tcgen05" and tmem_columns(cfg, 64, head_dim) > target.fact(
                "tensor_memory_columns"):
            return (f"tensor memory: {tmem_columns(cfg, 64, head_dim)} columns over the "
                    f"{target.fact('tensor_memory_columns')} of an SM")
        threads = launch_warps(cfg, target) * target.warp_size
        if (maxnreg_for(cfg, target) * threads > target.registers_per_sm
                or maxnreg_for(cfg, target) > target.max_registers_per_thread):
            return "consumer_regs do not fit the register file"
    return None


def mma_kind(spec: Spec, target: Target) -> str | None:
    """The tensor-core instruction family the kernel is written for on `target`: "wgmma"
    (Hopper) or "tcgen05" (Blackwell), from target.toml's [[mma]] entries; None for neither."""
    for kind in MMA_KINDS:
        if target.mma_for(kind, spec.dtype):
            return kind
    return None


def render_gluon(spec: Spec, cfg: KernelConfig, target: Target) -> Source:
    """The Gluon kernel source for `spec` and the config's Gluon options (`options_of`) on a
    target with wgmma or tcgen05 (target.toml [[mma]] kind)."""
    mma = mma_kind(spec, target)
    if mma is None:
        raise ValueError(f"the Gluon warp-specialized kernel needs wgmma or tcgen05; target "
                         f"{target.name} lists neither (targets/<t>/target.toml [[mma]])")
    opts = options_of(cfg)
    why = check(spec, opts, mma=mma)
    if why:
        raise ValueError(why)
    # the text depends on the spec, the target and num_consumers alone (the other knobs are
    # constexpr parameters); the file name spells the whole variant it is built for, so the
    # artifacts of two configs never share a name
    name = f"{spec_basename(spec)}_{cfg.render_name}.py"
    return render(TEMPLATE, "triton", spec, cfg.render_options(), name, KERNEL_NAME, target,
                  block=spec.block_kv, head_dim=spec.head_dim, dtype=spec.dtype,
                  gl_dtype=GL_DTYPES[spec.dtype], arch=target.arch, mma=mma,
                  num_consumers=opts["num_consumers"])


#: the kernel's constexpr parameter of each knob (`constexprs`)
CONSTEXPR_NAMES: dict[str, str] = {
    "k_stages": "K_STAGES",
    "v_stages": "V_STAGES",
    "pack_partials": "PACK_PARTIALS",
    "q_in_regs": "Q_IN_REGS",
    "qk_ahead": "QK_AHEAD",
    "fence_wait": "FENCE_WAIT",
    "store_lse": "STORE_LSE",
    "store_max_prob": "STORE_MAX_PROB",
    "share_kv": "SHARE_KV",
    "consumer_regs": "CONSUMER_REGS",
    "producer_regs": "PRODUCER_REGS",
    "debug": "DEBUG",
}


def o32_store_kind(opts: Mapping[str, Any], residual: bool = False) -> int:
    """How a forward for gradients writes O for the backward's delta (STORE_O32): 2, the fp32
    O by a TMA store staged in the consumer's own K ring, where the consumer has one of 2+
    slots (3 with ``residual``: O's rounding residual in the input dtype instead, half the
    bytes); else 1, the fp32 O by `gl.store` from the MMA layout (SHARE_KV: the ring is shared
    with the other consumer), with or without ``residual``."""
    if opts["share_kv"] or opts["k_stages"] < 2:
        return 1
    return 3 if residual else 2


def constexprs(opts: Mapping[str, Any], zero_pad_rows: bool = False,
               store_o32: bool = False, residual: bool = False) -> dict[str, Any]:
    """The kernel's constexpr parameters for the resolved options `opts` (`options_of`), in the
    kernel's order; ``zero_pad_rows`` writes zeros into padded query rows (ZERO_PAD_ROWS),
    ``store_o32`` O for delta as well (STORE_O32 as `o32_store_kind`, 0 without: the forward of
    a call that needs gradients)."""
    return {**{name: opts[knob] for knob, name in CONSTEXPR_NAMES.items()},
            "ZERO_PAD_ROWS": bool(zero_pad_rows),
            "STORE_O32": o32_store_kind(opts, residual) if store_o32 else 0}


def options_of(cfg: KernelConfig) -> dict[str, Any]:
    """The Gluon knobs of a KernelConfig: its `options` over `DEFAULTS`, plus the outputs it
    stores (store_lse, store_max_prob)."""
    return resolve({**dict(cfg.options), "store_lse": cfg.store_lse,
                    "store_max_prob": cfg.store_max_prob})
