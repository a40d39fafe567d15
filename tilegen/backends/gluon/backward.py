"""The warp-specialized Gluon backward kernels (templates/gluon/lut_ws_backward.py.j2): render,
the dQ pass's plan, the launches and the offline compile.

The backward runs, after the Triton family's delta preprocess:

1. dK/dV (`KERNELS["dkdv"]`), one CTA per (KV cube, b*h) over the inverse map, K and V
   resident, Q and dO streamed by a TMA producer warp; with ``ds_store`` it also writes each
   pair's dS^T (bf16; the dQ kernel takes rowsum(dS) from it by a matmul with ones);
2. dQ: with ``ds_store``, the Gluon dQ kernel (`KERNELS["dq"]`): one matmul per pair, dS K,
   from the stored dS^T; without it the Triton family's dQ kernel (S and dP recomputed).

``ds_store`` trades memory for two of the seven matmuls per pair: the dS^T scratch holds
B*H*NQ*TOPK tiles of 64x64 bf16 (8 KiB each: 16 GB at the default Wan2.2 workload), so
`GluonBackward` runs the heads in groups whose scratch fits ``scratch_bytes``.

Knobs (`DEFAULTS`): ``dkdv_stages`` / ``dq_stages`` (ring depths), ``ds_store``,
``dkdv_pack`` (the dK/dV kernel streams packed query tiles: partial cubes of one size class
side by side, `packed_inverse_map` with 8-row classes), ``ds_slots`` (dS^T staging tiles),
``dq_k_boxes`` (the dQ kernel loads only the K rows of a KV cube of exactly 32, 16 or 8 keys),
``stats_paired`` (the dK/dV kernel reads each row's lse and delta as one 8-byte pair, built
per call), ``stats_smem`` (with it, the producer warp stages each tile's pairs in shared
memory, so the consumer decodes no column offsets), ``acc_zero`` (with ``stats_smem``: S^T
and dP^T from zero, in flight together, the staged statistics applied after each wait),
``dp_early`` (0, 1 or 2: the dK/dV consumer issues dP^T = V dO^T before making P^T, onto
-delta (1) or from zero beside S^T (2); the template says how they differ),
``consumer_regs`` / ``producer_regs`` (setmaxnreg of the consumer warpgroup and the producer),
``scratch_bytes`` (the dS^T scratch budget of one launch group; shared by the lanes),
``group_streams`` (lanes: head groups on that many streams, each with its share of the
scratch), ``centre`` (the dQ kernel's
centring; off only to measure it), ``debug`` (timing experiments that leave out a step of the
dS^T store: garbage results; `templates/gluon/lut_ws_backward.py.j2`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tilegen.backends.gluon import render as _render
from tilegen.backends.triton.maps import (
    POS_COLUMN_STEP,
    PackedTiles,
    lut_bad_rows,
    lut_entries,
)
from tilegen.config import KernelConfig
from tilegen.render import Source, render, spec_basename
from tilegen.spec import Spec
from tilegen.streams import side_stream
from tilegen.targets import Target

#: the smallest query tile class of dkdv_pack: the kernel's TMA boxes land at 8-row granules
#: of the 128-byte swizzle
GLUON_PACK_MIN_ROWS = 8
TEMPLATE = "gluon/lut_ws_backward.py.j2"
KERNELS = {"dkdv": "tilegen_gluon_bwd_dkdv", "dq": "tilegen_gluon_bwd_dq"}
DEFAULTS: dict[str, Any] = {
    "dkdv_stages": 2,
    "dq_stages": 3,
    "ds_store": True,
    "dkdv_pack": False,
    "ds_slots": 1,
    "dq_k_boxes": True,
    "consumer_regs": 232,
    "producer_regs": 24,
    "scratch_bytes": 4 << 30,
    "group_streams": 2,
    "centre": True,
    "debug": "",
    "dp_early": 1,
    "stats_paired": True,
    "stats_smem": True,
    "acc_zero": False,
}


def resolve(opts: Mapping[str, Any] | None) -> dict[str, Any]:
    """`opts` over `DEFAULTS`; an unknown key is an error."""
    opts = dict(opts or {})
    unknown = sorted(set(opts) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown Gluon backward option(s) {unknown}; known: {sorted(DEFAULTS)}")
    out = {**DEFAULTS, **opts}
    if out["dp_early"] not in (0, 1, 2) or isinstance(out["dp_early"], bool):
        raise ValueError(f"dp_early must be 0, 1 or 2, got {out['dp_early']!r}")
    if out["acc_zero"] and not out["stats_smem"]:
        raise ValueError("acc_zero reads the statistics staged by stats_smem: it needs it")
    if out["stats_smem"] and not out["stats_paired"]:
        raise ValueError("stats_smem stages the (lse, delta) pairs: it needs stats_paired")
    lanes = out["group_streams"]
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
        raise ValueError(f"group_streams must be an int >= 1, got {lanes!r}")
    return out


def spec_problem(spec: Spec, target: Target) -> str | None:
    """Why the Gluon backward cannot compute `spec` on `target`, or None."""
    why = _render.spec_problem(spec)
    if why:
        return why
    if not spec.encoding_info.takes_lut:
        return "the Gluon backward walks LUT rows and their inverse map (encoding 'lut')"
    if _render.mma_kind(spec, target) != "wgmma":
        return (f"the Gluon backward is written for Hopper's wgmma; target {target.name} has "
                "none (the Triton backward serves it)")
    return None


def render_backward(spec: Spec, target: Target, separate_kv: bool = False) -> Source:
    """The source of both kernels; ``separate_kv`` (GQA: K and V of fewer heads, read at each
    query head's KV head; q's length and vbs) adds their num_kv_heads argument."""
    why = spec_problem(spec, target)
    if why:
        raise ValueError(why)
    name = f"{spec_basename(spec)}_gluon_bwd{'_sepkv' if separate_kv else ''}.py"
    return render(TEMPLATE, "triton", spec, KernelConfig(), name, KERNELS["dkdv"], target,
                  names=KERNELS, block=spec.block_kv, head_dim=spec.head_dim, dtype=spec.dtype,
                  gl_dtype=_render.GL_DTYPES[spec.dtype], arch=target.arch,
                  separate_kv=separate_kv)


def maxnreg_for(opts: Mapping[str, Any], target: Target) -> int:
    """The kernel-wide register cap of one consumer warpgroup and one producer warp."""
    return _render.maxnreg_for({"num_consumers": 1, "consumer_regs": opts["consumer_regs"],
                                "producer_regs": opts["producer_regs"]}, target)




def options_for(bwd, spec: Spec) -> dict[str, Any]:
    """The kernels' options (`DEFAULTS` keys) for the BackwardConfig `bwd` of `spec`: its
    fields, and the dQ kernel's short K boxes where the spec has partial cubes."""
    return {"ds_store": bwd.ds_store, "dkdv_pack": bwd.dkdv_pack,
            "dkdv_stages": bwd.gluon_dkdv_stages, "dq_stages": bwd.gluon_dq_stages,
            "scratch_bytes": bwd.ds_scratch_mib << 20,
            "dq_k_boxes": bool(spec.variable_block_sizes)}


def slots_of_order(order):
    """Each LUT entry's slot in the unpacked inverse map from its sort ``order``
    (`inverse_map(..., return_order=True)`): slot p holds entry ``order[p]``."""
    import torch

    slot = torch.empty_like(order)
    slot[order] = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
    return slot


def dq_plan(topk_idx, counts, vbs, num_kv_blocks: int, slot, block: int = 64, row=None):
    """What the Gluon dQ kernel walks besides the LUT: ``pos`` (int32, the LUT's shape: for
    each entry ``slot * 8 + row // 8``, its pair's dS^T tile, i.e. its slot in the inverse map
    (`slots_of_order`), or with ``dkdv_pack`` its packed tile's slot (`packed_inverse_map`'s
    entry tiles), and the query cube's first column in that tile, ``row``: 0 unpacked), and
    ``meta`` (int32, B*H*NQ: the row's entry count, or -1 for a row with an index outside
    [0, NKV), a chosen cube's vbs outside 1..block or a count outside 0..TOPK). Vectorized
    torch on the device, no host sync."""
    import torch

    B, H, NQ, TOPK = topk_idx.shape
    n = B * H * NQ * TOPK
    if n * POS_COLUMN_STEP > 2**31 - 1:
        raise ValueError(f"the dQ plan numbers B*H*NQ*TOPK = {n} LUT entries, {POS_COLUMN_STEP} "
                         "codes each, in int32: use a backward config without ds_store")
    pos = slot.reshape(-1) * POS_COLUMN_STEP
    if row is not None:
        # no host sync to check it: packed classes of at least 8 rows give multiples of 8
        # (`backward_maps` packs the Gluon kernel's classes; device_maps refuses smaller ones)
        pos = pos + row.reshape(-1) // POS_COLUMN_STEP
    pos = pos.to(torch.int32)
    idx, ok, real = lut_entries(topk_idx, counts, num_kv_blocks)
    bad = lut_bad_rows(ok, real, vbs.long()[torch.where(ok, idx, 0)], counts, block)
    count = (counts.reshape(-1).long() if counts is not None
             else torch.full_like(bad, TOPK, dtype=torch.long))
    meta = torch.where(bad, -1, count).to(torch.int32)
    return pos.view(topk_idx.shape), meta


def head_scratch_bytes(nq: int, topk: int) -> int:
    """One b*h's dS^T scratch at most: NQ * TOPK tiles of 64 x 64 16-bit values."""
    return nq * topk * 64 * 64 * 2


class GluonBackward:
    """The Gluon dK/dV kernel (and, with ``ds_store``, the dQ kernel) of one spec, launchable on
    CUDA tensors of a wgmma target. `dkdv` and `dq` launch one kernel each on validated,
    contiguous BSHD tensors."""

    def __init__(self, spec: Spec, target: Target, opts: Mapping[str, Any] | None = None,
                 separate_kv: bool = False) -> None:
        from tilegen.backends.gluon.launch import load_kernel

        self.spec = spec
        self.target = target
        self.opts = resolve(opts)
        #: GQA: k and v of fewer heads than q (`render_backward`); dk, dv stay q's shape
        self.separate_kv = separate_kv
        self.source = render_backward(spec, target, separate_kv)
        self.kernels = {k: load_kernel(self.source, name) for k, name in KERNELS.items()}
        self.maxnreg = maxnreg_for(self.opts, target)
        self.num_warps = target.fact("warps_per_warpgroup")

    def _desc(self, t, rows: int = 64):
        from tilegen.backends.gluon.launch import bshd_descriptor

        return bshd_descriptor(t, rows)

    def _row_descs(self, t, opt: str = "dkdv_pack") -> list:
        """Q or dO (K with ``opt`` "dq_k_boxes") in boxes of a whole cube and, with ``opt``, of
        32, 16 and 8 rows (the partial cubes; None without)."""
        from tilegen.backends.gluon.launch import DESCRIPTOR_ROWS

        return [self._desc(t, r) if r == 64 or self.opts[opt] else None
                for r in DESCRIPTOR_ROWS]

    def _ds_desc(self, ds):
        """The dS^T scratch, (pairs * 64, 64), in (64, 64) boxes."""
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        from tilegen.backends.gluon.launch import shared_layout

        return TensorDescriptor(ds, [ds.shape[0], 64], [64, 1], [64, 64],
                                shared_layout(64, 64, ds.dtype))

    def heads_per_group(self, heads_total: int, nq: int, topk: int, lanes: int = 1) -> int:
        """b*h per launch group: as many as the dS^T scratch budget holds (at most NQ * TOPK
        pairs of 8 KiB each per b*h; with several lanes each lane's scratch is its share of the
        budget), no more than int32 row indices reach, and at least one (a single b*h larger
        than the budget still runs, alone)."""
        if not self.opts["ds_store"]:
            return heads_total
        per = head_scratch_bytes(nq, topk) * lanes
        # the kernels address scratch rows (and TMA coordinates) in int32
        rows_cap = (2**31 - 1) // (nq * topk * 64)
        return max(1, min(heads_total, self.opts["scratch_bytes"] // per, rows_cap))

    def dkdv(self, q, k, v, do, lse, delta, inverse, vbs, dk, dv, ds, err,
             sm_scale: float, bh_base: int = 0, bh_count: int | None = None) -> None:
        """dK, dV of b*h ``bh_base .. + bh_count`` (default: all), and with ``ds`` their query
        tiles' dS^T (slot p of the inverse map at rows (p - p0) * 64, p0 the group's first).
        ``inverse``: `inverse_map`'s (offsets, qcubes), or with ``dkdv_pack`` its packed
        tiles (`PackedTiles`, smallest class 8 rows)."""
        from tilegen.reference import LOG2E

        B, S, H, D = q.shape
        nkv = S // 64
        store = ds is not None
        packed = self.opts["dkdv_pack"]
        if packed != isinstance(inverse, PackedTiles) or (packed and (
                inverse.min_rows < GLUON_PACK_MIN_ROWS or not inverse.exact)):
            raise ValueError("the Gluon dK/dV kernel's inverse map: with dkdv_pack packed tiles "
                             f"of exact classes of at least {GLUON_PACK_MIN_ROWS} rows "
                             "(backward_maps of a Gluon config), without it (offsets, qcubes)")
        if packed:
            offsets, items = inverse.offsets, inverse.items
            tiles = (inverse.tile_start, inverse.tile_meta, inverse.count)
        else:
            (offsets, items), tiles = inverse, (None, None, None)
        if self.opts["stats_paired"]:  # (lse, delta) of a row in one int64
            lse, delta = self.paired_stats(lse, delta), None
        self.kernels["dkdv"][(nkv, bh_count if bh_count is not None else B * H)](
            *self._row_descs(q), self._desc(k), self._desc(v), *self._row_descs(do),
            self._desc(dk), self._desc(dv), self._ds_desc(ds) if store else None, offsets,
            items, *tiles, vbs, lse, delta, err, S, H, *self._kv_heads(k), nkv, bh_base,
            float(sm_scale) * LOG2E,
            float(sm_scale), STAGES=self.opts["dkdv_stages"], DS_STORE=store, PACKED=packed,
            DS_SLOTS=self.opts["ds_slots"],
            PRODUCER_REGS=self.opts["producer_regs"], DEBUG=self.opts["debug"],
            DP_EARLY=self.opts["dp_early"], STATS_PAIRED=self.opts["stats_paired"],
            STATS_SMEM=self.opts["stats_smem"], ACC_ZERO=self.opts["acc_zero"],
            num_warps=self.num_warps, maxnreg=self.maxnreg)

    @staticmethod
    def paired_stats(lse, delta):
        """``(lse, delta)`` fp32 of one shape -> one int64 per row holding both (lse in the low
        word), for STATS_PAIRED; an int64 tensor is passed through (already paired)."""
        import torch

        if lse.dtype == torch.int64:
            return lse
        return torch.stack((lse, delta), -1).contiguous().view(torch.int64).squeeze(-1)

    def _kv_heads(self, k) -> tuple[int, ...]:
        """The num_kv_heads argument of a GQA source, or none."""
        return (k.shape[2],) if self.separate_kv else ()

    def dq(self, k, ds, dq, topk_idx, pos, meta, vbs, dsum, offsets, err, sm_scale: float,
           bh_base: int = 0, bh_count: int | None = None) -> None:
        """dQ of b*h ``bh_base .. + bh_count`` from the dS^T `dkdv` stored for the same group,
        with the centring (``dsum``: log2(e) dlse, or None)."""
        B, S, H, D = dq.shape
        nq, nkv = S // 64, S // 64
        self.kernels["dq"][(nq, bh_count if bh_count is not None else B * H)](
            self._ds_desc(ds), *self._row_descs(k, "dq_k_boxes"), self._desc(dq), topk_idx,
            pos, meta, vbs, dsum, offsets, err, S, H, *self._kv_heads(k), nq, nkv,
            topk_idx.shape[3], bh_base,
            float(sm_scale), STAGES=self.opts["dq_stages"], HAS_DSUM=dsum is not None,
            CENTRE=self.opts["centre"], K_BOXES=self.opts["dq_k_boxes"],
            PRODUCER_REGS=self.opts["producer_regs"],
            num_warps=self.num_warps, maxnreg=self.maxnreg)

    def run(self, q, k, v, do, lse, delta, dsum, topk_idx, vbs, inverse, plan, dk, dv,
            err, sm_scale: float, dq=None, triton_dq=None) -> None:
        """The whole backward after delta: dK/dV over ``inverse`` (see `dkdv`), and dQ into
        ``dq`` (with ``ds_store``, from ``plan`` = `dq_plan`'s (pos, meta) for that map; else
        ``triton_dq()`` launches the Triton dQ kernel). Groups of b*h as the scratch allows,
        group i on lane i % lanes (the caller's stream, then side streams that wait for it
        first and that it waits for before this returns): ``group_streams`` lanes, fewer when
        the budget does not hold a head per lane, so the lanes' scratch together stays within
        ``scratch_bytes`` (or one head's, when even one does not fit); each lane's scratch is
        allocated once per call and reused by its groups."""
        import torch

        B, S, H, D = q.shape
        nq = S // 64
        topk = topk_idx.shape[3]
        if not self.opts["ds_store"]:
            self.dkdv(q, k, v, do, lse, delta, inverse, vbs, dk, dv, None, err, sm_scale)
            triton_dq()
            return
        if nq * topk * 64 > 2**31 - 1:
            raise ValueError(f"ds_store: one head's dS^T scratch ({nq} query cubes x TOPK {topk} "
                             "tiles of 64 rows) passes int32 row indices; use a backward "
                             "config without ds_store")
        pos, meta = plan
        # as many lanes as hold one head each within the budget (at least one)
        lanes = max(1, min(self.opts["group_streams"],
                           self.opts["scratch_bytes"] // head_scratch_bytes(nq, topk)))
        group = self.heads_per_group(B * H, nq, topk, lanes)
        bases = list(range(0, B * H, group))
        lanes = min(lanes, len(bases))
        offsets = inverse.offsets if self.opts["dkdv_pack"] else inverse[0]
        # with several lanes, group i runs on lane i % lanes (the launch stream, then side
        # streams), each lane with its own scratch: one group's dQ and the next group's dK/dV
        # fill each other's launch tails
        if self.opts["stats_paired"]:  # once for every group, before the lanes fork
            lse = self.paired_stats(lse, delta)
        cur = torch.cuda.current_stream(q.device)
        streams = [cur] + [side_stream(q.device, i) for i in range(lanes - 1)]
        for s in streams[1:]:
            s.wait_stream(cur)
        # every lane's scratch from the caller's stream's pool (reusable by it after the call;
        # the joins below order that reuse after the side streams' work)
        scratch = [torch.empty((group * nq * topk * 64, 64), dtype=q.dtype, device=q.device)
                   for _ in streams]
        for i, base in enumerate(bases):
            n = min(group, B * H - base)
            lane = i % lanes
            with torch.cuda.stream(streams[lane]):
                self.dkdv(q, k, v, do, lse, delta, inverse, vbs, dk, dv, scratch[lane], err,
                          sm_scale, base, n)
                self.dq(k, scratch[lane], dq, topk_idx, pos, meta, vbs, dsum, offsets, err,
                        sm_scale, base, n)
        for s in streams[1:]:
            cur.wait_stream(s)


# ----------------------------------------------------------------------------- offline compile


def signatures(spec: Spec, opts: Mapping[str, Any], has_dsum: bool = False,
               separate_kv: bool = False) -> dict[str, tuple[dict, dict]]:
    """(signature, constexprs) of each kernel for triton.compile, with no tensors; ``has_dsum``
    builds the dQ kernel of a call with a gradient of lse (HAS_DSUM), ``separate_kv`` the GQA
    source's (its num_kv_heads)."""
    from triton.experimental.gluon import language as gl

    opts = resolve(opts)
    gdt = gl.bfloat16 if spec.dtype == "bf16" else gl.float16
    D = spec.head_dim

    def td(rows, cols):
        layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gdt)
        return f"tensordesc<{spec.dtype}[{rows}, {cols}],{layout!r}>"

    store = opts["ds_store"]
    packed = opts["dkdv_pack"]
    dkdv: dict[str, str | None] = {}
    for t in ("q", "k", "v", "do"):
        dkdv[f"{t}_desc"] = td(64, D)
        if t in ("q", "do"):  # the packed tiles' cube boxes
            for part, rows in (("half", 32), ("quarter", 16), ("eighth", 8)):
                dkdv[f"{t}_{part}"] = td(rows, D) if packed else None
    dkdv.update({
        "dk_desc": td(64, D), "dv_desc": td(64, D), "ds_desc": td(64, 64) if store else None,
        "kv_offsets_ptr": "*i32", "items_ptr": "*i32",
        "tile_start_ptr": "*i32" if packed else None,
        "tile_meta_ptr": "*i32" if packed else None,
        "tile_count_ptr": "*i32" if packed else None,
        "vbs_ptr": "*i32",
        "lse_ptr": "*i64" if opts["stats_paired"] else "*fp32",
        "delta_ptr": None if opts["stats_paired"] else "*fp32", "err_ptr": "*i32",
        "seq_len": "i32",
        "num_heads": "i32", **({"num_kv_heads": "i32"} if separate_kv else {}),
        "num_kv_blocks": "i32", "bh_base": "i32", "qk_scale": "fp32", "sm_scale": "fp32"})
    dkdv_c = {"STAGES": opts["dkdv_stages"], "DS_STORE": store, "PACKED": packed,
              "DS_SLOTS": opts["ds_slots"],
              "PRODUCER_REGS": opts["producer_regs"], "DEBUG": opts["debug"],
              "DP_EARLY": opts["dp_early"], "STATS_PAIRED": opts["stats_paired"],
              "STATS_SMEM": opts["stats_smem"], "ACC_ZERO": opts["acc_zero"]}
    boxes = opts["dq_k_boxes"]
    dq = {"ds_desc": td(64, 64), "k_desc": td(64, D), "k_half": td(32, D) if boxes else None,
          "k_quarter": td(16, D) if boxes else None, "k_eighth": td(8, D) if boxes else None,
          "dq_desc": td(64, D), "idx_ptr": "*i32",
          "pos_ptr": "*i32", "meta_ptr": "*i32", "vbs_ptr": "*i32",
          "dsum_ptr": "*fp32" if has_dsum else None,
          "kv_offsets_ptr": "*i32", "err_ptr": "*i32", "seq_len": "i32", "num_heads": "i32",
          **({"num_kv_heads": "i32"} if separate_kv else {}), "num_q_blocks": "i32",
          "num_kv_blocks": "i32", "topk": "i32", "bh_base": "i32", "sm_scale": "fp32"}
    dq_c = {"STAGES": opts["dq_stages"], "HAS_DSUM": has_dsum, "CENTRE": opts["centre"],
            "K_BOXES": boxes, "PRODUCER_REGS": opts["producer_regs"]}

    def pack(args, consts):
        c = {name: None for name, kind in args.items() if kind is None}
        c.update(consts)
        sig = {name: kind or "constexpr" for name, kind in args.items()}
        sig.update({name: "constexpr" for name in consts})
        return sig, c

    out = {"dkdv": pack(dkdv, dkdv_c)}
    if store:
        out["dq"] = pack(dq, dq_c)
    return out


def compile_offline(spec: Spec, target: Target, opts: Mapping[str, Any] | None = None,
                    has_dsum: bool = False, separate_kv: bool = False) -> dict[str, Any]:
    """Compile the kernels for `target` here (no GPU): {kernel: CompiledKernel}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from tilegen.backends.gluon.launch import load_kernel

    opts = resolve(opts)
    source = render_backward(spec, target, separate_kv)
    out = {}
    for kernel, (sig, consts) in signatures(spec, opts, has_dsum, separate_kv).items():
        fn = load_kernel(source, KERNELS[kernel])
        out[kernel] = triton.compile(
            GluonASTSource(fn, sig, consts),
            target=GPUTarget(target.triton_backend, target.triton_arch, target.warp_size),
            options={"num_warps": target.fact("warps_per_warpgroup"),
                     "maxnreg": maxnreg_for(opts, target)})
    return out
