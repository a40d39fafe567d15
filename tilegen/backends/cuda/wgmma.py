"""The CUDA family's Hopper mainloop: decisions for the wgmma kernel
(templates/cuda/lut_wgmma_kernel.cu.j2 over templates/cuda/include/tilegen/cuda/sm90/).

A CUDA config picks its mainloop with the option ``mainloop``: absent or ``"mma_sync"`` is the
Ampere-style kernel every NVIDIA target builds (`tilegen.backends.cuda.nvcc`), ``"wgmma"`` this
one, on targets whose target.toml lists a wgmma instruction (sm_90). Its knobs, as
`KernelConfig.options`:

    consumers       consumer warpgroups per CTA, each on its own query cube (1 to 3); with 1,
                    two CTAs share an SM (the Gluon kernel's shape), with 2 or 3 one CTA holds
                    them all (3: 160 registers a consumer, so more warps a scheduler for a
                    latency-bound loop)
    k_stages        K ring depth per consumer
    v_stages        V ring depth per consumer
    pingpong        two consumers take turns issuing their MMAs (named barriers), so one's
                    softmax runs under the other's MMAs (FA3); needs consumers 2
    pack_partials   the pre-pass packs partial KV cubes (vbs 32/16/8) into dense 64-key tiles
    persistent      a grid of one wave: each CTA takes query cubes one after another, its rings
                    running on and a second Q buffer per consumer loaded during the previous
                    cube (the next cube's loads overlap this one's epilogue); off, one CTA per
                    group of `consumers` cubes
    schedule        how a persistent grid hands out its cubes: "static" (CTA i takes groups i,
                    i + grid, ...) or "dynamic" (each consumer claims its cubes from a global
                    counter, a cube ahead, and passes each to its producer lane through a
                    shared-memory queue, so CTAs with cheap cubes take more; the 8-bit
                    kernel's). Named only when not "static"
    kv_tile         keys a tile of the 8-bit kernel: 64 (one cube, or two packed partial ones)
                    or 128 (two of the plan's 64-key tiles: half the per-tile work of the
                    loop, the softmax's shuffles and O's rescale, for every key); the 16-bit
                    kernel takes 64
    kv_copies       how the 8-bit kernel's producer copies a 32-key half of K8 and of V^T:
                    "tma" (a TMA box: 32 rows of 128 bytes, 128 rows of 32 bytes) or "bulk"
                    (one 4 KB cp.async.bulk, from tiles the pre-pass writes in the shared
                    tile's byte order: `tilegen.quant` k_tiles, vt_tiles). Named in a config
                    only when not "tma" (`OPTIONAL`), so the configs of before keep their names
    q_in_kernel     the 8-bit op's call passes q in its 16-bit dtype and each consumer quantizes
                    its query cube in shared memory with the pre-pass's arithmetic (bit for bit),
                    so the pre-pass reads and writes K and V only; the kernel is the same (a
                    runtime argument: `from_quantized` passes Q8). Named only when true
    row_sum         the 8-bit softmax's row sum l: "fadd" (each thread adds its scores, a quad
                    sum at the end) or "mma" (an m64n8 MMA of P against e4m3 ones beside P V:
                    the sum of the very e4m3 values P V multiplies, no FADD a score). Named only
                    when not "fadd"
    p_exp           how the 8-bit softmax forms P's e4m3 code: "ex2" (ex2.approx, then rounded
                    to e4m3) or "linear" (the code straight from the exponent in eighths of a
                    power of two, rounded by its f16 conversion at 1024 + code, its mantissa
                    linear in the exponent's fraction; the row max on S's int32 by DPX: no MUFU
                    a score; `tilegen.quant` p_exp). Takes row_sum "mma". Named only when not
                    "ex2"

With ``Spec(quant="int8_fp8")`` the same knobs build the 8-bit kernel
(templates/cuda/lut_wgmma_quant_kernel.cu.j2 over sm90/lut_attention_8bit.cuh): the recipe of
`tilegen.quant` on IGMMA and QGMMA, fed by the Gluon family's 8-bit pre-pass and plan (tiles in
32-key halves; ``pack_partials`` packs cubes of at most 32 tokens two a tile). Its tiles are
half the bytes of the 16-bit kernel's, but its Q buffer keeps the 16-bit size to stage O.
Its two-level accumulator (P V of each tile in fp32, added into O) is a whole O fragment where a
consumer has `QUANT_FULL_ACC_REGS` registers, else a part of one: P V then runs in column
parts (``pv_parts`` in the traits), which three consumers a CTA need.

The register split (setmaxnreg) follows from the shape and the target's register file: 24 for
the producer warpgroup, the rest to the consumers (on sm_90: 232 each with one consumer and two
CTAs an SM, 240 with two consumers, 160 with three). Nothing here needs torch, nvcc or a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tilegen.config import KernelConfig
from tilegen.render import Source, render, spec_basename
from tilegen.spec import Spec
from tilegen.targets import Target

TEMPLATE = "cuda/lut_wgmma_kernel.cu.j2"
QUANT_TEMPLATE = "cuda/lut_wgmma_quant_kernel.cu.j2"
#: the 8-bit recipe this kernel computes (tilegen.quant)
QUANT_MODE = "int8_fp8"
MAINLOOPS = ("mma_sync", "wgmma")
#: the knobs and their defaults: the fastest measured (bench/NOTES.md, session 20 on an H100:
#: three consumers a CTA with a K ring of 2 and a V ring of 1, 6.92 ms at TOPK 78 against 7.17
#: for session 18's one consumer a CTA with K ring 3, 2.4-4.9% ahead at TOPK 31, 78 and 187);
#: [tunable.cuda] searches the rest
DEFAULTS: dict[str, Any] = {
    "mainloop": "wgmma",
    "consumers": 3,
    "k_stages": 2,
    "v_stages": 1,
    "pingpong": False,
    "pack_partials": True,
    "persistent": False,
    "kv_tile": 64,
}
#: knobs a config names only when set to another value than this (`config`), so that adding
#: one renamed no config (or winner) of before
OPTIONAL: dict[str, Any] = {"kv_copies": "tma", "q_in_kernel": False, "row_sum": "fadd",
                            "p_exp": "ex2", "schedule": "static"}
KV_COPIES = ("tma", "bulk")
ROW_SUMS = ("fadd", "mma")
P_EXPS = ("ex2", "linear")
SCHEDULES = ("static", "dynamic")
#: the 8-bit kernel's knobs over `DEFAULTS`: one consumer a CTA (two CTAs an SM), K ring 3,
#: 128-key tiles (session 20 on an H100: kernel and plan 5.30 ms at TOPK 78 against 5.52 with
#: 64-key tiles and 5.64 with three consumers a CTA)
QUANT_DEFAULTS: dict[str, Any] = {"consumers": 1, "k_stages": 3, "v_stages": 2, "kv_tile": 128}
#: the producer warpgroup's registers after setmaxnreg.dec (the smallest count PTX allows)
PRODUCER_REGS = 24
#: setmaxnreg counts and the launch-bounds cap move in steps of this many registers (PTX)
REGISTER_STEP = 8
#: CTAs an SM by consumer count: the register split is computed for this many (two CTAs of
#: one consumer each is the Gluon kernel's shape; one CTA holds two consumers)
CTAS_PER_SM = {1: 2, 2: 1, 3: 1}
#: the 8-bit consumer's registers with a whole-fragment P V accumulator beside O (session 18's
#: build: 232 with 72-112 bytes of spills outside the loop); fewer, and P V runs in halves
QUANT_FULL_ACC_REGS = 232
#: the parts of P V with fewer registers (4: a 16-register accumulator)
QUANT_PV_PARTS = 4


def defaults_for(spec: Spec) -> dict[str, Any]:
    """The knobs of `spec`'s default wgmma config: `DEFAULTS`, with `QUANT_DEFAULTS` over them
    for an 8-bit spec."""
    return {**DEFAULTS, **(QUANT_DEFAULTS if spec.quant != "none" else {})}


def mainloop_of(cfg: KernelConfig) -> str:
    """The config's mainloop: its ``mainloop`` option, "mma_sync" without one."""
    value = dict(cfg.options).get("mainloop", "mma_sync")
    if value not in MAINLOOPS:
        raise ValueError(f"mainloop={value!r}: the CUDA family has {list(MAINLOOPS)}")
    return str(value)


def resolve(options: Mapping[str, Any]) -> dict[str, Any]:
    """The wgmma knobs: `options` over `DEFAULTS` and `OPTIONAL`; an unknown key is an
    error."""
    known = {**DEFAULTS, **OPTIONAL}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} of the CUDA family's wgmma mainloop; "
                         f"known: {sorted(known)}")
    return {**known, **options}


def options_of(cfg: KernelConfig) -> dict[str, Any]:
    return resolve(dict(cfg.options))


def config(**options: Any) -> KernelConfig:
    """A wgmma config: the fixed launch shape and `options` over `DEFAULTS` (an `OPTIONAL`
    knob only where it is not its default)."""
    named = {k: v for k, v in resolve(options).items()
             if k not in OPTIONAL or v != OPTIONAL[k]}
    return KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=1,
                        options=tuple(sorted(named.items())))


def q_buffers(opts: Mapping[str, Any]) -> int:
    return 2 if opts["persistent"] else 1


def smem_bytes(opts: Mapping[str, Any], head_dim: int, quant: bool = False) -> int:
    """Dynamic shared memory of one CTA: per consumer its Q buffers and K and V rings, plus the
    1024 bytes the kernel may skip to align its tiles to the swizzle atom. 8-bit: K and V tiles
    of one byte an element, and a K stage's scale slot: 16 bytes of key scales a 32-key half
    (one scale a half, quant.K_SCALE_GROUP) and 16 of the halves' fills; Q buffers 16-bit (O
    staging)."""
    tile = 64 * head_dim * 2
    if quant:  # each consumer's slice rounded up to the 1024-byte swizzle atom
        kv = opts["kv_tile"] * head_dim
        per = (q_buffers(opts) * tile + (opts["k_stages"] + opts["v_stages"]) * kv
               + opts["k_stages"] * (16 * (opts["kv_tile"] // 32) + 16))
        per = -(-per // 1024) * 1024
    else:
        per = (q_buffers(opts) + opts["k_stages"] + opts["v_stages"]) * tile
    return opts["consumers"] * per + 1024


def static_smem_bytes(opts: Mapping[str, Any]) -> int:
    """The kernel's static shared memory: each consumer's mbarriers (Q, K and V full and empty)
    and its warps' max_prob partial sums, with room for alignment; with the dynamic schedule
    each consumer's work queue too (four mbarriers and two slots)."""
    barriers = 2 * (q_buffers(opts) + opts["k_stages"] + opts["v_stages"])
    queue = 4 * 8 + 2 * 4 if opts.get("schedule") == "dynamic" else 0
    return opts["consumers"] * (8 * barriers + 16 + queue) + 16


def violations(spec: Spec, cfg: KernelConfig, target: Target) -> list[str]:
    """Why the wgmma kernel cannot run (spec, cfg) on `target`; empty when it can."""
    if not target.mma_for("wgmma", spec.dtype):
        has = [kind for kind in ("tcgen05", "mfma") if target.mma_for(kind, spec.dtype)]
        return [f"mainloop wgmma is Hopper's (sm_90a); target {target.name} lists no wgmma "
                f"instruction for {spec.dtype}" + (f" (it has {has[0]}, which the CUDA family "
                                                    "does not implement: use mainloop "
                                                    "mma_sync, or the gluon family)"
                                                    if has else "")]
    try:
        opts = options_of(cfg)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    if spec.block_q != 64 or spec.block_kv != 64:
        problems.append("the wgmma kernel takes 64-token query and KV cubes (one m64 tile a "
                        "cube)")
    quant = spec.quant != "none"
    if spec.head_dim not in (64, 128):
        problems.append(f"head_dim {spec.head_dim}: the wgmma kernel's O is one m64n64 or "
                        "m64n128 fragment (64 or 128)")
    if quant and spec.quant != QUANT_MODE:
        problems.append(f"quant={spec.quant!r}: the CUDA wgmma kernel's 8-bit path computes "
                        f"{QUANT_MODE!r} (e4m3 P.V); {spec.quant!r} is the gluon family's")
    if quant and spec.head_dim != 128:
        problems.append(f"head_dim {spec.head_dim}: the 8-bit wgmma kernel reads Q8 and K8 rows "
                        "as one 128-byte swizzle line (head_dim 128); the gluon family has 64")
    if quant and spec.layout != "bshd":
        problems.append("layout bhsd: the 8-bit pre-pass writes BSHD, so the 8-bit wgmma "
                        "kernel takes BSHD (the gluon family converts)")
    if opts["kv_tile"] not in (64, 128):
        problems.append(f"kv_tile={opts['kv_tile']!r}: 64 or 128")
    elif opts["kv_tile"] == 128 and not quant:
        problems.append("kv_tile 128 is the 8-bit kernel's; the 16-bit kernel's tiles are one "
                        "64-key cube")
    elif opts["kv_tile"] == 128 and consumer_registers(opts, target) < QUANT_FULL_ACC_REGS:
        problems.append(f"kv_tile 128 holds S in 64 registers: it needs "
                        f"{QUANT_FULL_ACC_REGS} a consumer (one or two consumers), not "
                        f"{consumer_registers(opts, target)}")
    elif opts["kv_tile"] == 128 and opts["pingpong"]:
        problems.append("kv_tile 128 runs P V in parts, which ping-pong does not take turns "
                        "over")
    if opts["kv_copies"] not in KV_COPIES:
        problems.append(f"kv_copies={opts['kv_copies']!r}: one of {list(KV_COPIES)}")
    elif opts["kv_copies"] == "bulk" and not quant:
        problems.append("kv_copies 'bulk' copies the 8-bit pre-pass's K8 and V^T tiles; the "
                        "16-bit kernel's K and V come by TMA boxes")
    if type(opts["q_in_kernel"]) is not bool:
        problems.append(f"q_in_kernel={opts['q_in_kernel']!r}: true or false")
    elif opts["q_in_kernel"] and not quant:
        problems.append("q_in_kernel quantizes Q in the 8-bit kernel; the 16-bit kernel reads q "
                        "as it is")
    if opts["row_sum"] not in ROW_SUMS:
        problems.append(f"row_sum={opts['row_sum']!r}: one of {list(ROW_SUMS)}")
    elif opts["row_sum"] != "fadd" and not quant:
        problems.append("row_sum 'mma' sums the 8-bit kernel's e4m3 P; the 16-bit kernel adds "
                        "its scores")
    if opts["p_exp"] not in P_EXPS:
        problems.append(f"p_exp={opts['p_exp']!r}: one of {list(P_EXPS)}")
    elif opts["p_exp"] != "ex2" and not quant:
        problems.append("p_exp 'linear' forms the 8-bit kernel's e4m3 P codes; the 16-bit "
                        "kernel's P is bf16/fp16")
    elif opts["p_exp"] == "linear" and opts["row_sum"] != "mma":
        problems.append("p_exp 'linear' leaves no fp32 P to add: it takes row_sum 'mma'")
    if opts["schedule"] not in SCHEDULES:
        problems.append(f"schedule={opts['schedule']!r}: one of {list(SCHEDULES)}")
    elif opts["schedule"] == "dynamic" and not quant:
        problems.append("schedule 'dynamic' is written for the 8-bit kernel; the 16-bit kernel's "
                        "persistent grid is static")
    elif opts["schedule"] == "dynamic" and not opts["persistent"]:
        problems.append("schedule 'dynamic' hands out a persistent grid's cubes: it needs "
                        "persistent true")
    elif opts["schedule"] == "dynamic" and opts["pingpong"]:
        problems.append("schedule 'dynamic' pairs no cubes across consumers, which ping-pong's "
                        "turns need")
    if quant and cfg.store_max_prob:
        problems.append("max_prob: the 8-bit kernel does not write the softmax signal")
    if (cfg.block_m, cfg.block_n, cfg.num_warps) != (64, 64, 4):
        problems.append("the wgmma kernel runs 64x64 tiles with one 4-warp consumer "
                        "warpgroup per query cube (block_m=64, block_n=64, num_warps=4)")
    if cfg.separate_kv:
        problems.append("separate K/V (cross-attention, GQA, varlen) is not written for the "
                        "wgmma kernel: use the gluon or triton family")
    if cfg.interp_bf16:
        problems.append("interp_bf16 is a Triton-interpreter option; the CUDA kernel has none")
    if opts["mainloop"] != "wgmma":
        problems.append("these knobs belong to mainloop wgmma")
    if opts["consumers"] not in CTAS_PER_SM:
        problems.append(f"consumers={opts['consumers']}: 1, 2 or 3")
    elif opts["pingpong"] and opts["consumers"] != 2:
        problems.append("pingpong alternates two consumers: it needs consumers 2")
    for ring in ("k_stages", "v_stages"):
        if type(opts[ring]) is not int or not 1 <= opts[ring] <= 8:
            problems.append(f"{ring}={opts[ring]!r}: 1..8")
    for flag in ("pingpong", "pack_partials", "persistent"):
        if type(opts[flag]) is not bool:
            problems.append(f"{flag}={opts[flag]!r}: true or false")
    if problems:
        return problems
    smem = smem_bytes(opts, spec.head_dim, quant) + static_smem_bytes(opts)
    ctas = CTAS_PER_SM[opts["consumers"]]
    if smem > target.max_shared_bytes:
        problems.append(f"needs {smem} B of shared memory, more than the "
                        f"{target.max_shared_bytes} B a block may opt into on {target.name}")
    elif ctas * (smem + target.reserved_shared_per_block) > target.shared_per_sm:
        problems.append(f"{ctas} CTAs an SM (the register split of {opts['consumers']} "
                        f"consumer(s)) need {ctas} x {smem} B of shared memory, more than the "
                        f"{target.shared_per_sm} B of an SM: use fewer stages")
    if consumer_registers(opts, target) < registers_at_entry(opts, target):
        problems.append(f"{ctas} CTA(s) of {threads_of(opts, target)} threads leave the "
                        f"consumers no more registers than the producer on {target.name}")
    return problems


def warpgroup_threads(target: Target) -> int:
    return target.fact("warps_per_warpgroup") * target.warp_size


def threads_of(opts: Mapping[str, Any], target: Target) -> int:
    return warpgroup_threads(target) * (1 + opts["consumers"])


def registers_at_entry(opts: Mapping[str, Any], target: Target) -> int:
    """The per-thread cap __launch_bounds__ gives: the register file over the threads of
    `CTAS_PER_SM` CTAs, down to a `REGISTER_STEP`, and no more than a thread may hold."""
    per_thread = target.registers_per_sm // (threads_of(opts, target)
                                             * CTAS_PER_SM[opts["consumers"]])
    return min(per_thread // REGISTER_STEP * REGISTER_STEP, target.max_registers_per_thread)


def consumer_registers(opts: Mapping[str, Any], target: Target) -> int:
    """Each consumer warpgroup's registers after setmaxnreg.inc: the cap at entry of every
    warpgroup, less what the producer gives up, shared among the consumers (setmaxnreg moves
    registers within the CTA, never adds)."""
    n = opts["consumers"]
    pool = registers_at_entry(opts, target) * (n + 1) - PRODUCER_REGS
    return min(pool // n // REGISTER_STEP * REGISTER_STEP, target.max_registers_per_thread)


def pv_parts(quant: bool, consumer_regs: int, kv_tile: int = 64) -> int:
    """The column parts the 8-bit kernel's P V runs in: 1 (a whole O fragment accumulator)
    where the consumer has `QUANT_FULL_ACC_REGS` registers and 64-key tiles, 2 for 128-key
    tiles (S takes 64 registers), `QUANT_PV_PARTS` with fewer registers; the 16-bit kernel
    accumulates into O itself (1)."""
    if not quant:
        return 1
    if consumer_regs < QUANT_FULL_ACC_REGS:
        return QUANT_PV_PARTS
    return 1 if kv_tile == 64 else 2


def traits(spec: Spec, cfg: KernelConfig, target: Target) -> dict[str, Any]:
    """Every number and choice the template instantiates (raises ValueError for a config the
    wgmma kernel cannot run)."""
    problems = violations(spec, cfg, target)
    if problems:
        raise ValueError(f"config {cfg.name} cannot be built as the CUDA wgmma kernel: "
                         + "; ".join(problems))
    opts = options_of(cfg)
    quant = spec.quant != "none"
    consumer_regs = consumer_registers(opts, target)
    return {
        "mainloop": "wgmma",
        "quant": quant,
        "dtype": spec.dtype,
        "elem": {"bf16": "Bf16", "fp16": "Fp16"}[spec.dtype],
        "layout": spec.layout,
        "head_dim": spec.head_dim,
        "block_q": spec.block_q,
        "consumers": opts["consumers"],
        "k_stages": opts["k_stages"],
        "v_stages": opts["v_stages"],
        "pingpong": opts["pingpong"],
        "pack_partials": opts["pack_partials"],
        "persistent": opts["persistent"],
        "q_buffers": q_buffers(opts),
        "store_lse": cfg.store_lse,
        "store_max_prob": cfg.store_max_prob,
        "threads": threads_of(opts, target),
        "smem_bytes": smem_bytes(opts, spec.head_dim, quant),
        "min_blocks": CTAS_PER_SM[opts["consumers"]],
        "consumer_regs": consumer_regs,
        "pv_parts": pv_parts(quant, consumer_regs, opts["kv_tile"]),
        "kv_tile": opts["kv_tile"],
        "bulk_kv": opts["kv_copies"] == "bulk",
        "linear_p": opts["p_exp"] == "linear",
        "mma_row_sum": opts["row_sum"] == "mma",
        "schedule": opts["schedule"],
        "producer_regs": PRODUCER_REGS,
    }


def kernel_name(spec: Spec, cfg: KernelConfig) -> str:
    quant = f"_{spec.quant}" if spec.quant != "none" else ""
    return f"tilegen_cuda_{spec_basename(spec)}{quant}_{cfg.name}"


def render_wgmma(spec: Spec, cfg: KernelConfig, target: Target) -> Source:
    """The wgmma kernel's text: its traits and entry point (`tilegen.backends.cuda.nvcc.
    render_cuda` adds the headers it includes)."""
    t = traits(spec, cfg, target)
    name = kernel_name(spec, cfg)
    return render(QUANT_TEMPLATE if t["quant"] else TEMPLATE, "cuda", spec, cfg,
                  f"{name[len('tilegen_cuda_'):]}.cu", name, target=target, t=t)


#: The kernel's parameters in order: (name, kind), kind "map" (a 128-byte tensor map by
#: value), "ptr", "i32" or "f32".
KERNEL_SIGNATURE: tuple[tuple[str, str], ...] = (
    ("q_map", "map"), ("k_map", "map"), ("k8_map", "map"), ("v_map", "map"), ("v8_map", "map"),
    ("o_map", "map"), ("sidx", "ptr"), ("tinfo", "ptr"), ("meta", "ptr"), ("vbs", "ptr"),
    ("lse", "ptr"), ("max_prob", "ptr"), ("max_prob_cube", "ptr"), ("seq_len", "i32"),
    ("num_heads", "i32"), ("batch_heads", "i32"), ("num_q_blocks", "i32"), ("topk", "i32"),
    ("qk_scale", "f32"), ("zero_pad_rows", "i32"),
)
#: the box height of each map (rows; 64 columns wide)
MAP_ROWS = {"q_map": 64, "k_map": 64, "k8_map": 8, "v_map": 64, "v8_map": 8, "o_map": 64}
#: The 8-bit kernel's parameters (lut_wgmma_quant_kernel.cu.j2).
QUANT_KERNEL_SIGNATURE: tuple[tuple[str, str], ...] = (
    ("q8_map", "map"), ("k8_map", "map"), ("vt_map", "map"), ("o_map", "map"),
    ("plan", "ptr"), ("meta", "ptr"), ("vbs", "ptr"), ("lse", "ptr"), ("q_scale", "ptr"),
    ("k_scale", "ptr"), ("v_scale", "ptr"), ("v_mean", "ptr"), ("seq_len", "i32"),
    ("num_heads", "i32"), ("batch_heads", "i32"), ("num_q_blocks", "i32"), ("topk", "i32"),
    ("qk_scale", "f32"), ("zero_pad_rows", "i32"), ("o_tokens", "ptr"), ("out_rows", "ptr"),
    ("out_seq_len", "i32"), ("k8_tiles", "ptr"), ("vt_tiles", "ptr"), ("k_mean", "ptr"),
    ("q_in_kernel", "i32"),
)
#: the parameter a dynamic schedule's kernel takes after those: an int32 the op zeroes before
#: each launch
WORK_COUNTER = ("work_counter", "ptr")


def groups(num_q_blocks: int, batch: int, heads: int, opts: Mapping[str, Any]) -> int:
    """Units of work: `consumers` neighbouring query cubes of one (b, h)."""
    return batch * heads * -(-num_q_blocks // opts["consumers"])


def grid(num_q_blocks: int, batch: int, heads: int, opts: Mapping[str, Any], target: Target,
         sm_count: int | None = None) -> tuple[int, int, int]:
    """(CTAs, 1, 1): one per group, or with `persistent` one wave (`CTAS_PER_SM` CTAs on each
    of the device's `sm_count` SMs, the target's num_sms without one), at most one per group."""
    n = groups(num_q_blocks, batch, heads, opts)
    if opts["persistent"]:
        n = min(n, (sm_count or target.num_sms) * CTAS_PER_SM[opts["consumers"]])
    if not 0 < n <= target.max_grid[0]:
        raise ValueError(f"grid of {n} CTAs is outside {target.name}'s limits "
                         f"(1..{target.max_grid[0]})")
    return n, 1, 1


def kernel_args(values: Mapping[str, Any], quant: bool = False,
                dynamic: bool = False) -> list[tuple[str, str, Any]]:
    """The arguments in `KERNEL_SIGNATURE` (`QUANT_KERNEL_SIGNATURE`, and `WORK_COUNTER` for a
    dynamic schedule) order as (name, kind, value); a missing pointer is 0 (nullptr: lse or
    max_prob not stored), every other value must be there, the work counter included."""
    signature = QUANT_KERNEL_SIGNATURE if quant else KERNEL_SIGNATURE
    if dynamic:
        if not values.get(WORK_COUNTER[0]):
            raise ValueError("a dynamic schedule's kernel needs its work counter (a zeroed "
                             "int32 on the device)")
        signature = signature + (WORK_COUNTER,)
    out: list[tuple[str, str, Any]] = []
    for name, kind in signature:
        if name not in values and kind != "ptr":
            raise ValueError(f"the wgmma kernel's argument {name} is missing")
        value = values.get(name, 0)
        if kind == "i32" and not 0 <= int(value) < 2**31:
            raise ValueError(f"{name}={value} does not fit the kernel's int32 argument")
        out.append((name, kind, value))
    return out
