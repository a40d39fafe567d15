"""The Triton backward pass of the LUT kernel: render, the inverse map, and the launches.

`templates/triton/lut_backward.py.j2` renders one module with three kernels (FlashAttention-2's
split, no atomics):

1. preprocess: ``delta = rowsum(dO * O)`` (fp32, (B, H, S)); padded query rows give 0;
2. dQ: one program per BLOCK_M rows of a query cube, walking the cube's LUT row like the
   forward (counts, guarded indices, vbs masking), P recomputed from the saved base-2 lse;
3. dK/dV: one program per BLOCK_N keys of a KV cube, the key tile resident, walking the query
   cubes that chose the cube (`inverse_map`, CSR built on the device: by the Triton kernels of
   `tilegen.backends.triton.maps` on a GPU, by a vectorized torch routine elsewhere). Every
   dK/dV row is written by exactly one program: no atomics.

Launch parameters and template options (`BackwardConfig`) are constexprs and launch arguments,
as in the forward (the packed tiles' pointers are None without DQ_PACK / DKDV_PACK), and so is
the forward `KernelConfig`'s ``interp_bf16`` (INTERP_BF16): one source serves every config of a
spec. Its file name still spells the template options (`backward_render_name`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tilegen.backends.triton.maps import PackedTiles, check_classes, lut_bad_rows, lut_entries
from tilegen.config import KernelConfig
from tilegen.render import Source, render, spec_basename
from tilegen.spec import Spec
from tilegen.targets import Target

TRITON_BACKWARD_TEMPLATE = "triton/lut_backward.py.j2"
#: the kernels of the backward module, in launch order
BACKWARD_KERNELS = {
    "preprocess": "tilegen_bsa_bwd_preprocess",
    "dq": "tilegen_bsa_bwd_dq",
    "dkdv": "tilegen_bsa_bwd_dkdv",
}
#: the packed tiles' pointer parameters of the dQ (dq_pack) and dK/dV (dkdv_pack) kernels, after
#: ERR; None when the config does not pack
BACKWARD_PACKED = {
    "dq": ("DQ_OFFSETS", "DQ_ITEMS", "DQ_TSTART", "DQ_TMETA", "DQ_TCOUNT"),
    "dkdv": ("KV_TSTART", "KV_TMETA", "KV_TCOUNT"),
}


#: the largest cube the packed tiles take: a packed tile is one power-of-two cube wide
PACK_MAX_CUBE = 128


@dataclass(frozen=True)
class BackwardConfig:
    """Launch parameters and render-time options of the three backward kernels.

    - ``dq_block_m`` / ``dq_block_n``: query rows per dQ program / keys per inner step (divide
      block_q / block_kv), ``dq_warps`` / ``dq_stages`` its launch options;
    - ``dkdv_block_n`` / ``dkdv_block_m``: resident keys per dK/dV program / query rows per inner
      step (divide block_kv / block_q), ``dkdv_warps`` / ``dkdv_stages``;
    - ``pre_block_m``: rows per preprocess program (divides block_q);
    - ``dq_atomic``: the dK/dV kernel also computes dQ (fp32 atomic adds; 5 matmuls per block
      pair instead of 7) and the dQ kernel is skipped: the variant that trades the S and dP
      recomputation for atomics (`finish_atomic_dq` does the epilogue);
    - ``dq_pack`` (the dQ kernel's constexpr DQ_PACK): the dQ kernel walks its LUT row in
      *packed* key tiles built on the device (`pack_tiles`): a full KV cube is a tile of its
      own, partial cubes of one size class (vbs rounded up to a power of two) share a tile (two
      of 32, four of 16, ...), so no MMA work goes to key padding; needs
      ``dq_block_n == block_kv``;
    - ``dkdv_pack`` (the dK/dV kernel's DKDV_PACK): the same for the query cubes of the dK/dV
      kernel's inverse map (query padding); needs ``dkdv_block_m == block_q``.
    - ``gluon``: dK/dV from the warp-specialized Gluon kernel instead
      (`tilegen.backends.gluon.backward`: a TMA producer warp, wgmma; Hopper, BSHD, LUT, 64-token
      cubes) with ``gluon_dkdv_stages`` Q/dO stages; with ``ds_store`` it also stores each
      query tile's dS^T and dQ is one matmul per pair in the Gluon dQ kernel
      (``gluon_dq_stages``), else the Triton dQ kernel runs. ``dkdv_pack`` packs its query
      tiles too, but only cubes of exactly 8, 16 or 32 rows share a tile (every other cube gets
      one of its own: `pack_tiles` with ``exact``). The dK/dV launch fields above are then
      unused.
      ``ds_scratch_mib`` bounds the dS^T scratch of one launch group (the heads run in groups
      that fit it: `tilegen.backends.gluon.backward.GluonBackward.heads_per_group`).
    """

    dq_block_m: int = 64
    dq_block_n: int = 64
    dq_warps: int = 4
    dq_stages: int = 3  # the H200 sweep's best with dK/dV at 4 warps: 28.5 ms against 29.0 at 2
    dkdv_block_n: int = 64
    dkdv_block_m: int = 64
    dkdv_warps: int = 4  # the H200 sweep's best (bench/RESULTS.md): 29.0 ms against 48.1 at 8
    dkdv_stages: int = 2
    pre_block_m: int = 64
    dq_atomic: bool = False
    dq_pack: bool = False
    dkdv_pack: bool = False
    gluon: bool = False
    ds_store: bool = False
    gluon_dkdv_stages: int = 2
    gluon_dq_stages: int = 3
    ds_scratch_mib: int = 4096

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            want = bool if f.type in ("bool", bool) else int
            if type(value) is not want or (want is int and value < 1):
                raise ValueError(f"BackwardConfig.{f.name} must be a "
                                 f"{'bool' if want is bool else 'positive int'}, got {value!r}")

    @classmethod
    def default_for(cls, target: Target | None, spec: Spec | None = None) -> BackwardConfig:
        """The default launch of `target`: on AMD (wave64, 512 VGPRs + AGPRs) the dK/dV kernel
        takes 32-row query steps at 4 warps (64 x 64 at 8 warps spills ~1.4 KB on gfx942); on
        a wgmma GPU, for a spec the Gluon backward computes, the Gluon dK/dV kernel with the
        stored dS^T and, for a spec with partial cubes, packed query tiles (the H200's
        fastest, bench/RESULTS.md); elsewhere (and for the interpreter) the class defaults."""
        if target is not None and target.vendor == "amd":
            return cls(dkdv_block_m=32, dkdv_warps=4)
        if target is not None and spec is not None and "gluon" in target.backends:
            from tilegen.backends.gluon.backward import spec_problem

            if spec_problem(spec, target) is None:
                return cls(gluon=True, ds_store=True, dkdv_pack=spec.variable_block_sizes)
        return cls()

    def fit(self, spec: Spec) -> BackwardConfig:
        """Tiles shrunk to the spec's cube sizes where larger; for cubes past
        `PACK_MAX_CUBE` tokens, the unpacked Triton kernels."""
        fitted = self
        if max(spec.block_q, spec.block_kv) > PACK_MAX_CUBE:
            fitted = dataclasses.replace(self, dq_pack=False, dkdv_pack=False, gluon=False,
                                         ds_store=False)
        return dataclasses.replace(
            fitted, dq_block_m=min(self.dq_block_m, spec.block_q),
            dq_block_n=min(self.dq_block_n, spec.block_kv),
            dkdv_block_n=min(self.dkdv_block_n, spec.block_kv),
            dkdv_block_m=min(self.dkdv_block_m, spec.block_q),
            pre_block_m=min(self.pre_block_m, spec.block_q))

    def for_separate_kv(self) -> BackwardConfig:
        """This config for K/V of their own length or heads (`KernelConfig.separate_kv`): the
        kernels walk unpacked cubes (the packed tiles pack one side's cubes by one vbs), compute
        dQ in the dQ kernel (the atomic variant's host epilogue reads K per query head) and are
        Triton's (the Gluon backward addresses K/V by q's heads); launch fields are kept."""
        return dataclasses.replace(self, dq_pack=False, dkdv_pack=False, dq_atomic=False,
                                   gluon=False, ds_store=False,
                                   gluon_dkdv_stages=BackwardConfig.gluon_dkdv_stages,
                                   gluon_dq_stages=BackwardConfig.gluon_dq_stages,
                                   ds_scratch_mib=BackwardConfig.ds_scratch_mib)

    def violations(self, spec: Spec) -> list[str]:
        """Why this config cannot run `spec` (empty when it can)."""
        out = []
        for name, cube in (("dq_block_m", spec.block_q), ("dq_block_n", spec.block_kv),
                           ("dkdv_block_n", spec.block_kv), ("dkdv_block_m", spec.block_q),
                           ("pre_block_m", spec.block_q)):
            value = getattr(self, name)
            if value & (value - 1) or cube % value:
                out.append(f"{name}={value} must be a power of two dividing the cube ({cube}): "
                           "tiles index a cube's slots")
        if (self.dq_pack or self.dkdv_pack) and not spec.variable_block_sizes:
            out.append("dq_pack/dkdv_pack pack partial cubes: the spec has no vbs (every cube "
                       "is full)")
        if (self.dq_pack or self.dkdv_pack) and max(spec.block_q, spec.block_kv) > PACK_MAX_CUBE:
            out.append(f"dq_pack/dkdv_pack pack cubes of up to {PACK_MAX_CUBE} tokens into one "
                       f"tile; the spec's cubes have {max(spec.block_q, spec.block_kv)}")
        if self.dq_pack and self.dq_block_n != spec.block_kv:
            out.append(f"dq_pack packs whole {spec.block_kv}-key tiles: needs dq_block_n="
                       f"{spec.block_kv}, got {self.dq_block_n}")
        if self.dq_pack and spec.encoding != "lut":
            out.append(f"dq_pack packs the LUT rows' tiles; encoding {spec.encoding!r} walks its "
                       "cubes through its own cursor")
        if self.dq_pack and self.dq_atomic:
            out.append("dq_pack packs the dQ kernel's tiles, which dq_atomic does not launch")
        if self.gluon:
            from tilegen.backends.gluon.render import spec_problem

            why = spec_problem(spec)
            if why is None and not spec.encoding_info.takes_lut:
                why = "it walks LUT rows and their inverse map (encoding 'lut')"
            if why:
                out.append(f"gluon: the Gluon backward cannot run this spec: {why}")
            if self.ds_store and (self.dq_pack or self.dq_atomic):
                out.append("ds_store computes dQ in the Gluon dQ kernel: no dq_pack or "
                           "dq_atomic")
            if self.dq_atomic:
                out.append("gluon's dK/dV kernel adds no dQ terms: no dq_atomic")
            # fields the chosen kernels do not read stay at their defaults (so the tuner never
            # times one kernel under several names)
            unused = ["dkdv_block_n", "dkdv_block_m", "dkdv_warps", "dkdv_stages"]
            unused += (["dq_block_m", "dq_block_n", "dq_warps", "dq_stages"] if self.ds_store
                       else ["gluon_dq_stages", "ds_scratch_mib"])
            runs = "the Gluon backward" + (" with ds_store" if self.ds_store else "")
        else:
            if self.ds_store:
                out.append("ds_store is an option of the Gluon backward: it needs gluon")
            unused = ["gluon_dkdv_stages", "gluon_dq_stages", "ds_scratch_mib"]
            runs = "the Triton backward"
        default = BackwardConfig()
        changed = [n for n in unused if getattr(self, n) != getattr(default, n)]
        if changed:
            out.append(f"{', '.join(changed)}: not read by the kernels this config runs "
                       f"({runs}); leave them at their defaults")
        if self.dkdv_pack and self.dkdv_block_m != spec.block_q:
            out.append(f"dkdv_pack packs whole {spec.block_q}-row query tiles: needs "
                       f"dkdv_block_m={spec.block_q}, got {self.dkdv_block_m}")
        return out

    @property
    def name(self) -> str:
        return (f"dq{self.dq_block_m}x{self.dq_block_n}w{self.dq_warps}s{self.dq_stages}_"
                f"dkdv{self.dkdv_block_n}x{self.dkdv_block_m}w{self.dkdv_warps}"
                f"s{self.dkdv_stages}_pre{self.pre_block_m}"
                + ("_atomicdq" if self.dq_atomic else "")
                + ("_dqpack" if self.dq_pack else "") + ("_dkdvpack" if self.dkdv_pack else "")
                + (f"_gluon{self.gluon_dkdv_stages}" if self.gluon else "")
                + (f"_ds{self.gluon_dq_stages}" if self.gluon and self.ds_store else "")
                + (f"m{self.ds_scratch_mib}" if self.gluon and self.ds_store
                   and self.ds_scratch_mib != 4096 else ""))

    @property
    def render_name(self) -> str:
        """The template options alone (part of the backward module's file name)."""
        return "".join(f"_{n.replace('_', '')}" for n in RENDER_FIELDS if getattr(self, n))

    def render_options(self) -> BackwardConfig:
        """The template options alone, every launch parameter at its class default."""
        return BackwardConfig(**{n: getattr(self, n) for n in RENDER_FIELDS})

    # -- as a KernelConfig (the tuner's and the tuning DB's currency) -----------------------
    def to_kernel_config(self, interp_bf16: bool = False) -> KernelConfig:
        """This config as the `KernelConfig` of the ``triton_bwd`` tuning family: every field
        an option (launch fields of the KernelConfig itself stay at their defaults)."""
        return KernelConfig(interp_bf16=interp_bf16, options=dataclasses.asdict(self))

    @classmethod
    def from_kernel_config(cls, cfg: KernelConfig) -> BackwardConfig:
        """Inverse of `to_kernel_config`; unknown option names raise ValueError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        opts = dict(cfg.options)
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ValueError(f"options {unknown} are not BackwardConfig fields; known: "
                             f"{sorted(known)}")
        return cls(**opts)

    def kernel_launch(self, kernel: str) -> tuple[dict[str, int], dict[str, int]]:
        """(constexprs, launch options) of one kernel of the module (`BACKWARD_KERNELS` key)."""
        if kernel == "preprocess":
            return {"BLOCK_M": self.pre_block_m}, {"num_warps": 4, "num_stages": 1}
        if kernel == "dq":
            return ({"BLOCK_M": self.dq_block_m, "BLOCK_N": self.dq_block_n,
                     "DQ_PACK": self.dq_pack},
                    {"num_warps": self.dq_warps, "num_stages": self.dq_stages})
        if kernel == "dkdv":
            return ({"BLOCK_M": self.dkdv_block_m, "BLOCK_N": self.dkdv_block_n,
                     "DKDV_PACK": self.dkdv_pack},
                    {"num_warps": self.dkdv_warps, "num_stages": self.dkdv_stages})
        raise ValueError(f"kernel={kernel!r} is not allowed; allowed values: "
                         f"{list(BACKWARD_KERNELS)}")


#: BackwardConfig fields that change the kernels' code (template options: constexprs that add
#: the packed tiles' arguments, DQ_PACK and DKDV_PACK), named in the backward module's file name
RENDER_FIELDS: tuple[str, ...] = ("dq_pack", "dkdv_pack")


def backward_render_name(cfg: KernelConfig, bwd: BackwardConfig | None = None) -> str:
    """The options the backward's kernels are compiled for (the forward config's separate_kv
    and interp_bf16, and the backward config's template options), as the module's file name
    spells them."""
    return ("bwd" + (bwd.render_name if bwd is not None else "")
            + ("_sepkv" if cfg.separate_kv else "")
            + ("_interpbf16" if cfg.interp_bf16 else ""))


def render_triton_backward(spec: Spec, cfg: KernelConfig, target: Target | None,
                           bwd: BackwardConfig | None = None) -> Source:
    """The backward module's source for a spec. The text is the spec's alone; its file name
    spells the forward config's interp_bf16 and the backward config's template options
    (default: none), which are the kernels' constexprs."""
    bwd = (bwd or BackwardConfig()).render_options()
    name = f"{spec_basename(spec)}_{backward_render_name(cfg, bwd)}.py"
    opts = KernelConfig(interp_bf16=cfg.interp_bf16, separate_kv=cfg.separate_kv)
    return render(TRITON_BACKWARD_TEMPLATE, "triton", spec, opts, name,
                  BACKWARD_KERNELS["dq"], target, names=BACKWARD_KERNELS)


def is_backward(source: Source) -> bool:
    return source.template == TRITON_BACKWARD_TEMPLATE


# -- the inverse map ------------------------------------------------------------------------------
def grouped_lut(topk_idx: torch.Tensor, counts: torch.Tensor | None, kv_heads: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LUT (B, H, NQ, TOPK) of GQA query heads as (B, H_kv, G * NQ, TOPK), G = H // H_kv:
    row i * NQ + c of KV head j is query cube c of query head j * G + i (a view, no copy). Its
    inverse map lists, per (b, KV head, KV cube), items i * NQ + c over the whole group, which
    the dK/dV kernel of separate K/V decodes (lut_backward.py.j2)."""
    B, H, NQ, TOPK = topk_idx.shape
    g = H // kv_heads
    lut = topk_idx.view(B, kv_heads, g * NQ, TOPK)
    return lut, (counts.view(B, kv_heads, g * NQ) if counts is not None else None)


def inverse_map(topk_idx: torch.Tensor, counts: torch.Tensor | None, num_kv_blocks: int,
                return_order: bool = False):
    """For each (batch*head, KV cube), the query cubes whose LUT row chose it, as CSR.

    Returns ``offsets`` (int32, ``B*H*NKV + 1``) and ``qcubes`` (int32): the query cubes of
    (bh, c) are ``qcubes[offsets[bh*NKV + c]:offsets[bh*NKV + c + 1]]``, ascending. Only the first
    ``counts[b, h, q]`` entries of a row are real; entries outside [0, NKV) are left out (the dQ
    kernel flags them). Vectorized torch on the LUT's device, no host sync: one stable sort of
    ``B*H*NQ*TOPK`` int64 keys and one bincount. With ``return_order`` also the sort's
    permutation (int64, B*H*NQ*TOPK): slot p of the map is flat LUT entry ``order[p]``.
    """
    B, H, NQ, TOPK = topk_idx.shape
    BH = B * H
    dev = topk_idx.device
    idx, ok, real = lut_entries(topk_idx, counts, num_kv_blocks)
    valid = ok & real
    bh = torch.arange(BH, device=dev).view(BH, 1, 1)
    sentinel = BH * num_kv_blocks
    key = torch.where(valid, bh * num_kv_blocks + idx, sentinel).reshape(-1)
    # (key, query cube) order: keys sorted stably keep each key's query cubes ascending
    order = torch.sort(key, stable=True).indices
    qcubes = ((order // TOPK) % NQ).to(torch.int32)
    per_key = torch.bincount(key, minlength=sentinel + 1)[:sentinel]
    offsets = torch.zeros(sentinel + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.cumsum(per_key, 0).to(torch.int32)
    if return_order:
        return offsets, qcubes, order
    return offsets, qcubes


def pack_tiles(owner: torch.Tensor, item: torch.Tensor, rows: torch.Tensor, n_owners: int,
               block: int, bad: torch.Tensor | None = None, entry_tiles: bool = False,
               min_rows: int = 1, exact: bool = False
               ) -> PackedTiles | tuple[PackedTiles, torch.Tensor, torch.Tensor]:
    """Pack each owner's cubes into dense ``block``-row tiles, vectorized torch, no host sync.

    ``owner`` (int64, N; ``n_owners`` for an entry to leave out), ``item`` (the cube id) and
    ``rows`` (its real rows, clamped to 1..block) per entry; ``bad`` (bool, n_owners) marks
    owners to poison. One stable sort on (owner, size class), three searchsorted and a cumsum:
    cubes of one class are taken ``block >> lg`` to a tile in list order; the last tile of a
    class may be partly filled (its missing items are masked). ``min_rows`` (a power of two)
    is the smallest class (the Gluon kernel's TMA boxes start at 8-row granules); with ``exact``
    only cubes of exactly a class's rows share tiles, every other cube gets a tile of its own
    (the Gluon kernel's rule: a packed tile's real rows are then a prefix). With
    ``entry_tiles`` also,
    per entry, its tile's slot and its first row in the tile (int64, N; 0 for an entry left
    out): ``(PackedTiles, slot, row)``."""
    check_classes(min_rows, block)
    dev = owner.device
    n = owner.numel()
    log_block = block.bit_length() - 1
    lg = torch.ceil(torch.log2(rows.clamp(min_rows, block).float())).long()  # rows <= 2**lg
    if exact:
        r = rows.clamp(1, block)
        lg = torch.where(((r & (r - 1)) == 0) & (r >= min_rows), lg, log_block)
    rank = log_block - lg  # 0 for full cubes: they come first
    key = owner * (log_block + 1) + rank
    skey, order = torch.sort(key, stable=True)
    s_owner = skey // (log_block + 1)
    s_rank = skey % (log_block + 1)
    kept = s_owner < n_owners
    idx = torch.arange(n, device=dev)
    group_first = torch.searchsorted(skey, skey)
    group_end = torch.searchsorted(skey, skey, right=True)
    per_tile = torch.bitwise_left_shift(torch.ones_like(s_rank), s_rank)
    pos = idx - group_first
    starts = kept & (pos % per_tile == 0)
    n_items = torch.minimum(per_tile, group_end - idx)
    cs = torch.cumsum(starts.long(), 0)  # inclusive
    owner_first = torch.searchsorted(skey, s_owner * (log_block + 1))
    before = cs[owner_first] - starts[owner_first].long()  # tiles of earlier owners
    slot = owner_first + (cs - 1 - before)
    # one scatter per array; entries that start no tile write a spare slot n, cut off after
    dest = torch.where(starts, slot, n)
    tile_start = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    tile_start.scatter_(0, dest, idx.to(torch.int32))
    meta = ((log_block - s_rank) | (n_items << 8)).to(torch.int32)
    tile_meta = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    tile_meta.scatter_(0, dest, meta)
    tile_start, tile_meta = tile_start[:n], tile_meta[:n]
    counts = torch.bincount(torch.where(starts, s_owner, n_owners), minlength=n_owners + 1)
    count = counts[:n_owners].to(torch.int32)
    if bad is not None:
        count = torch.where(bad, -1, count)
    per_owner = torch.bincount(torch.where(kept, s_owner, n_owners), minlength=n_owners + 1)
    offsets = torch.zeros(n_owners + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.cumsum(per_owner[:n_owners], 0).to(torch.int32)
    packed = PackedTiles(offsets, item[order].to(torch.int32), tile_start, tile_meta, count,
                         min_rows, exact)
    if not entry_tiles:
        return packed
    first_row = torch.bitwise_left_shift(pos % per_tile, log_block - s_rank)
    entry_slot = torch.zeros(n, dtype=torch.long, device=dev)
    entry_row = torch.zeros(n, dtype=torch.long, device=dev)
    entry_slot[order] = torch.where(kept, slot, 0)
    entry_row[order] = torch.where(kept, first_row, 0)
    return packed, entry_slot, entry_row


def packed_inverse_map(topk_idx: torch.Tensor, counts: torch.Tensor | None, vbs: torch.Tensor,
                       num_kv_blocks: int, block: int, entry_tiles: bool = False,
                       min_rows: int = 1, exact: bool = False
                       ) -> PackedTiles | tuple[PackedTiles, torch.Tensor, torch.Tensor]:
    """The inverse map (`inverse_map`'s lists: for each (batch*head, KV cube) the query cubes
    that chose it) packed into dense query tiles by the query cubes' vbs (`pack_tiles`), for
    the dK/dV kernel with ``dkdv_pack``. Bad entries are left out (the dQ kernel flags them).
    ``entry_tiles``: `pack_tiles`'s per-entry tile slot and first row as well, in the LUT's
    flat entry order; ``min_rows``, ``exact``: its classes (`pack_tiles`)."""
    idx, ok, real = lut_entries(topk_idx, counts, num_kv_blocks)
    BH, NQ, TOPK = idx.shape
    bh = torch.arange(BH, device=idx.device).view(BH, 1, 1)
    qc = torch.arange(NQ, device=idx.device).view(1, NQ, 1).expand(BH, NQ, TOPK)
    owner = torch.where(ok & real, bh * num_kv_blocks + idx, BH * num_kv_blocks).reshape(-1)
    rows = vbs.long()[:NQ].clamp(1, block)[qc].reshape(-1)
    return pack_tiles(owner, qc.reshape(-1), rows, BH * num_kv_blocks, block,
                      entry_tiles=entry_tiles, min_rows=min_rows, exact=exact)


def packed_lut(topk_idx: torch.Tensor, counts: torch.Tensor | None, vbs: torch.Tensor,
               num_kv_blocks: int, block: int) -> PackedTiles:
    """Each LUT row's KV cubes packed into dense key tiles by vbs (`pack_tiles`), for the dQ
    kernel with ``dq_pack``. A row with an index outside [0, NKV), a vbs outside 1..block or a
    count outside 0..TOPK gets count -1 (NaN gradients and the error word, as unpacked)."""
    idx, ok, real = lut_entries(topk_idx, counts, num_kv_blocks)
    BH, NQ, TOPK = idx.shape
    safe = torch.where(ok, idx, 0)
    n_valid = vbs.long()[safe]
    bad = lut_bad_rows(ok, real, n_valid, counts, block)
    owner = torch.arange(BH * NQ, device=idx.device).view(BH, NQ, 1).expand(BH, NQ, TOPK)
    owner = torch.where(ok & real, owner, BH * NQ).reshape(-1)
    return pack_tiles(owner, safe.reshape(-1), n_valid.reshape(-1).clamp(1, block), BH * NQ,
                      block, bad)


@dataclass(frozen=True)
class BackwardMaps:
    """What the backward kernels walk besides the LUT, built on the device from it:
    ``inverse`` (`inverse_map`'s (offsets, qcubes), or its `PackedTiles` with ``dkdv_pack``),
    ``lut`` (`packed_lut`, with ``dq_pack``; else None) and, with ``ds_store``, ``dq_plan``
    (`tilegen.backends.gluon.backward.dq_plan`: each LUT entry's code ``tile * 8 + first
    column / 8``, its pair's dS^T tile in the inverse map, and the rows' entry counts, -1 for a
    bad row)."""

    inverse: tuple[torch.Tensor, torch.Tensor] | PackedTiles
    lut: PackedTiles | None = None
    dq_plan: tuple[torch.Tensor, torch.Tensor] | None = None


def backward_maps(topk_idx: torch.Tensor, counts: torch.Tensor | None, vbs: torch.Tensor,
                  num_kv_blocks: int, block: int, bwd: BackwardConfig) -> BackwardMaps:
    """The maps `bwd` needs (prebuild them once to share them between calls)."""
    plan = None
    with_plan = bwd.gluon and bwd.ds_store
    # the Gluon dK/dV kernel's TMA boxes start at 8-row granules: its smallest class is 8 rows,
    # and it packs only cubes of exactly a class's rows
    min_rows, exact = 1, bwd.gluon
    if bwd.gluon:
        from tilegen.backends.gluon.backward import GLUON_PACK_MIN_ROWS

        min_rows = GLUON_PACK_MIN_ROWS
    inverse: tuple[torch.Tensor, torch.Tensor] | PackedTiles
    if topk_idx.is_cuda:
        # the same tensors as the torch models below, in fewer launches (maps.py)
        from tilegen.backends.triton.maps import device_maps

        inverse, plan = device_maps(topk_idx, counts, vbs, num_kv_blocks, block,
                                    with_plan=with_plan, pack=bwd.dkdv_pack, min_rows=min_rows,
                                    exact=exact)
    elif bwd.dkdv_pack and with_plan:
        from tilegen.backends.gluon.backward import dq_plan

        inverse, slot, row = packed_inverse_map(topk_idx, counts, vbs, num_kv_blocks, block,
                                                entry_tiles=True, min_rows=min_rows,
                                                exact=exact)
        plan = dq_plan(topk_idx, counts, vbs, num_kv_blocks, slot, block, row)
    elif bwd.dkdv_pack:
        inverse = packed_inverse_map(topk_idx, counts, vbs, num_kv_blocks, block,
                                     min_rows=min_rows, exact=exact)
    elif with_plan:
        from tilegen.backends.gluon.backward import dq_plan, slots_of_order

        offsets, qcubes, order = inverse_map(topk_idx, counts, num_kv_blocks, return_order=True)
        inverse = (offsets, qcubes)
        plan = dq_plan(topk_idx, counts, vbs, num_kv_blocks, slots_of_order(order), block)
    else:
        inverse = inverse_map(topk_idx, counts, num_kv_blocks)
    lut = packed_lut(topk_idx, counts, vbs, num_kv_blocks, block) if bwd.dq_pack else None
    return BackwardMaps(inverse, lut, plan)


def finish_atomic_dq(dq_acc: torch.Tensor, ds_sum: torch.Tensor, dsum: torch.Tensor | None,
                     k: torch.Tensor, topk_idx: torch.Tensor, vbs: torch.Tensor | None,
                     q_dtype: torch.dtype, layout: str, block: int, sm_scale: float
                     ) -> torch.Tensor:
    """dQ of the ATOMIC_DQ variant from its fp32 sums: the dQ kernel's centring
    (dq = (dS K - (rowsum dS - log2(e) dlse) c) * sm_scale, c the mean of the real keys of the
    row's first LUT cube; see lut_backward.py.j2), padded query rows zeroed, in the layout of q.
    Vectorized torch, no host sync."""
    def bhsd(x):
        return x.permute(0, 2, 1, 3) if layout == "bshd" else x

    kh = bhsd(k)
    B, H, S, D = kh.shape
    nkv = S // block
    nq = topk_idx.shape[2]
    first = topk_idx[..., 0].long().clamp(0, nkv - 1)  # (B, H, NQ)
    cubes = kh.reshape(B, H, nkv, block, D)
    sel = torch.gather(cubes, 2, first[..., None, None].expand(B, H, nq, block, D)).float()
    if vbs is not None:
        n = vbs.long()[first].clamp(1, block)  # (B, H, NQ)
        real = torch.arange(block, device=k.device)[None, None, None, :] < n[..., None]
        centre = (sel * real[..., None]).sum(3) / n[..., None]
    else:
        centre = sel.mean(3)
    excess = ds_sum if dsum is None else ds_sum - dsum  # (B, H, S)
    corr = excess.view(B, H, nq, block, 1) * centre[:, :, :, None, :]
    dq32 = (bhsd(dq_acc).reshape(B, H, nq, block, D) - corr) * sm_scale
    if vbs is not None:
        qv = (torch.arange(block, device=k.device)[None, :] < vbs.long()[:, None])[:nq]
        dq32 = dq32 * qv[None, None, :, :, None]
    dq = torch.empty(dq_acc.shape, dtype=q_dtype, device=k.device)
    bhsd(dq).copy_(dq32.reshape(B, H, S, D))
    return dq
