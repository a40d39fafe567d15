"""The Triton backward pass of the LUT kernel: render, the inverse map, and the launches.

`templates/triton/lut_backward.py.j2` renders one module with three kernels (FlashAttention-2's
split, no atomics):

1. preprocess: ``delta = rowsum(dO * O)`` (fp32, (B, H, S)); padded query rows give 0;
2. dQ: one program per BLOCK_M rows of a query cube, walking the cube's LUT row like the
   forward (counts, guarded indices, vbs masking), P recomputed from the saved base-2 lse;
3. dK/dV: one program per BLOCK_N keys of a KV cube, the key tile resident, walking the query
   cubes that chose the cube (`inverse_map`, CSR built on the device by a vectorized torch
   routine). Every dK/dV row is written by exactly one program: no atomics.

Launch parameters (`BackwardConfig`) are constexprs and launch arguments, as in the forward;
the render-time options come from the forward's `KernelConfig` (``interp_bf16`` only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass(frozen=True)
class BackwardConfig:
    """Launch parameters of the three backward kernels.

    - ``dq_block_m`` / ``dq_block_n``: query rows per dQ program / keys per inner step (divide
      block_q / block_kv), ``dq_warps`` / ``dq_stages`` its launch options;
    - ``dkdv_block_n`` / ``dkdv_block_m``: resident keys per dK/dV program / query rows per inner
      step (divide block_kv / block_q), ``dkdv_warps`` / ``dkdv_stages``;
    - ``pre_block_m``: rows per preprocess program (divides block_q);
    - ``dq_atomic``: the dK/dV kernel also computes dQ (fp32 atomic adds; 5 matmuls per block
      pair instead of 7) and the dQ kernel is skipped: the variant that trades the S and dP
      recomputation for atomics (`finish_atomic_dq` does the epilogue).
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

    @classmethod
    def default_for(cls, target: Target | None) -> BackwardConfig:
        """The default launch of `target`: on AMD (wave64, 512 VGPRs + AGPRs) the dK/dV kernel
        takes 32-row query steps at 4 warps (64 x 64 at 8 warps spills ~1.4 KB on gfx942);
        elsewhere (and for the interpreter) the class defaults."""
        if target is not None and target.vendor == "amd":
            return cls(dkdv_block_m=32, dkdv_warps=4)
        return cls()

    def fit(self, spec: Spec) -> BackwardConfig:
        """Tiles shrunk to the spec's cube sizes where larger."""
        return BackwardConfig(
            dq_block_m=min(self.dq_block_m, spec.block_q),
            dq_block_n=min(self.dq_block_n, spec.block_kv),
            dq_warps=self.dq_warps, dq_stages=self.dq_stages,
            dkdv_block_n=min(self.dkdv_block_n, spec.block_kv),
            dkdv_block_m=min(self.dkdv_block_m, spec.block_q),
            dkdv_warps=self.dkdv_warps, dkdv_stages=self.dkdv_stages,
            pre_block_m=min(self.pre_block_m, spec.block_q), dq_atomic=self.dq_atomic)

    @property
    def name(self) -> str:
        return (f"dq{self.dq_block_m}x{self.dq_block_n}w{self.dq_warps}s{self.dq_stages}_"
                f"dkdv{self.dkdv_block_n}x{self.dkdv_block_m}w{self.dkdv_warps}"
                f"s{self.dkdv_stages}_pre{self.pre_block_m}"
                + ("_atomicdq" if self.dq_atomic else ""))

    def kernel_launch(self, kernel: str) -> tuple[dict[str, int], dict[str, int]]:
        """(constexprs, launch options) of one kernel of the module (`BACKWARD_KERNELS` key)."""
        if kernel == "preprocess":
            return {"BLOCK_M": self.pre_block_m}, {"num_warps": 4, "num_stages": 1}
        if kernel == "dq":
            return ({"BLOCK_M": self.dq_block_m, "BLOCK_N": self.dq_block_n},
                    {"num_warps": self.dq_warps, "num_stages": self.dq_stages})
        if kernel == "dkdv":
            return ({"BLOCK_M": self.dkdv_block_m, "BLOCK_N": self.dkdv_block_n},
                    {"num_warps": self.dkdv_warps, "num_stages": self.dkdv_stages})
        raise ValueError(f"kernel={kernel!r} is not allowed; allowed values: "
                         f"{list(BACKWARD_KERNELS)}")


def backward_render_name(cfg: KernelConfig) -> str:
    """The render-time options the backward depends on (interp_bf16 only)."""
    return "bwd_interpbf16" if cfg.interp_bf16 else "bwd"


def render_triton_backward(spec: Spec, cfg: KernelConfig, target: Target | None) -> Source:
    """The backward module's source for a spec and the config's render-time options."""
    name = f"{spec_basename(spec)}_{backward_render_name(cfg)}.py"
    opts = KernelConfig(interp_bf16=cfg.interp_bf16)
    return render(TRITON_BACKWARD_TEMPLATE, "triton", spec, opts, name,
                  BACKWARD_KERNELS["dq"], target, names=BACKWARD_KERNELS)


def is_backward(source: Source) -> bool:
    return source.template == TRITON_BACKWARD_TEMPLATE


# -- the inverse map ------------------------------------------------------------------------------
def inverse_map(topk_idx: torch.Tensor, counts: torch.Tensor | None, num_kv_blocks: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (batch*head, KV cube), the query cubes whose LUT row chose it, as CSR.

    Returns ``offsets`` (int32, ``B*H*NKV + 1``) and ``qcubes`` (int32): the query cubes of
    (bh, c) are ``qcubes[offsets[bh*NKV + c]:offsets[bh*NKV + c + 1]]``, ascending. Only the first
    ``counts[b, h, q]`` entries of a row are real; entries outside [0, NKV) are left out (the dQ
    kernel flags them). Vectorized torch on the LUT's device, no host sync: one stable sort of
    ``B*H*NQ*TOPK`` int64 keys and one bincount.
    """
    B, H, NQ, TOPK = topk_idx.shape
    BH = B * H
    dev = topk_idx.device
    idx = topk_idx.reshape(BH, NQ, TOPK).long()
    valid = (idx >= 0) & (idx < num_kv_blocks)
    if counts is not None:
        slot = torch.arange(TOPK, device=dev)
        valid &= slot[None, None, :] < counts.reshape(BH, NQ, 1).long()
    bh = torch.arange(BH, device=dev).view(BH, 1, 1)
    sentinel = BH * num_kv_blocks
    key = torch.where(valid, bh * num_kv_blocks + idx, sentinel).reshape(-1)
    # (key, query cube) order: keys sorted stably keep each key's query cubes ascending
    order = torch.sort(key, stable=True).indices
    qcubes = ((order // TOPK) % NQ).to(torch.int32)
    per_key = torch.bincount(key, minlength=sentinel + 1)[:sentinel]
    offsets = torch.zeros(sentinel + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.cumsum(per_key, 0).to(torch.int32)
    return offsets, qcubes


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
