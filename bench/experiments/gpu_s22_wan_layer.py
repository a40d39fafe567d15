"""Question (issue #22, session 22): in the compiled Wan2.2-A14B-shaped step (run 4, H100) the
8-bit kernel took 5.72 ms a layer and the pre-pass 0.94, against 4.77 and 0.78 alone on random
q, k, v. Is it the data (the selection the model's own q and k make) or the machine (clocks
under the step's sustained GEMMs)? And does the order a row walks its KV cubes matter (every
row walks them in ascending cube id, so rows that share cubes load the same lines at once)?

    PYTHONPATH=$PWD python3 bench/experiments/gpu_s22_wan_layer.py --out $OUT/wan_layer.json

Builds the 40-layer model (random bf16 weights), runs one eager step with the 8-bit layer and
keeps the q, k, v that layers 1, 20 and 38 received, then for each (and for random q, k, v of
the same shape): the selection's statistics (partial cubes among the selected, distinct cubes a
head, how many rows share the most popular cube), the THW op, the pre-pass and the kernel
alone, and the kernel with each row's cubes rotated (row r starting at its (37 r mod topk)-th
cube: the same set, another order). Last, the default workload's synthesized capture, bf16 op
and 8-bit op, ascending against rotated. SM clocks are sampled by the shell script beside it.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

LAYERS = (1, 20, 38)


def _ms(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=200))


def rotated(idx: torch.Tensor, stride: int = 37) -> torch.Tensor:
    """Each row's entries rotated by (stride * row) mod topk: the same cubes, another order."""
    *lead, topk = idx.shape
    flat = idx.reshape(-1, topk)
    rows = torch.arange(flat.shape[0], device=idx.device)
    cols = (torch.arange(topk, device=idx.device)[None, :] + (rows[:, None] * stride)) % topk
    return flat.gather(1, cols).reshape(idx.shape).contiguous()


def selection_stats(idx: torch.Tensor, vbs: torch.Tensor) -> dict:
    b, h, nq, topk = idx.shape
    nkv = vbs.numel()
    per_head = torch.zeros((b * h, nkv), device=idx.device)
    per_head.scatter_add_(1, idx.reshape(b * h, -1).long(),
                          torch.ones(idx.reshape(b * h, -1).shape, device=idx.device))
    partial = (vbs.to(idx.device)[idx.long()] < 64).float().mean().item()
    return {"partial_selected": partial,
            "partial_cubes": (vbs < 64).float().mean().item(),
            "distinct_per_head": (per_head > 0).sum(1).float().mean().item(),
            "max_rows_per_cube": per_head.max(1).values.float().mean().item() / nq,
            "top10_cube_share": (per_head.topk(10, dim=1).values.sum(1) / (nq * topk))
            .mean().item()}


def _layer_case(op, q, k, v, grid, topk, vbs, src) -> dict:
    """One layer's q, k, v: its selection's statistics and the 8-bit layer's parts, timed."""
    from tilegen import sparsity
    from tilegen.ops import block_sparse_attention_8bit_thw

    r: dict = {}
    idx = sparsity.mean_pool_topk_thw(q, k, grid, topk)
    r["stats"] = selection_stats(idx, vbs)
    qi = op.quantize(q, k, v, vbs, sources=src)
    idx_rot = rotated(idx)
    r["thw_op_ms"] = _ms(lambda: block_sparse_attention_8bit_thw(q, k, v, grid, topk))
    r["prepass_ms"] = _ms(lambda: op.quantize(q, k, v, vbs, sources=src))
    r["kernel_ms"] = _ms(lambda: op.from_quantized(qi, idx, vbs, return_lse=False))
    r["kernel_rotated_ms"] = _ms(lambda: op.from_quantized(qi, idx_rot, vbs, return_lse=False))
    a = op.from_quantized(qi, idx, vbs, return_lse=False).float()
    b = op.from_quantized(qi, idx_rot, vbs, return_lse=False).float()
    r["rotated_rel_l1"] = ((a - b).abs().sum() / a.abs().sum()).item()
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=40)
    args = ap.parse_args()
    from diffusers import WanTransformer3DModel

    from tilegen import layout
    from tilegen.integrations import diffusers as tgd
    from tilegen.ops import _quant_op_for

    dev = torch.device("cuda")
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": {}}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    frames, height, width = 21, 60, 104
    grid = (frames, height // 2, width // 2)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, 16, frames, height, width, generator=g, device=dev).bfloat16()
    t = torch.tensor([999.0], device=dev)
    ctx = torch.randn(1, 512, 4096, generator=g, device=dev).bfloat16()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = WanTransformer3DModel(num_layers=args.layers).eval()
    torch.set_default_dtype(torch.float32)
    tgd.enable_block_sparse(model, sparsity=0.875, dense_layers=(0, args.layers - 1),
                            quant="int8_fp8")
    kept: dict[int, tuple] = {}
    calls = [0]
    inner = tgd.sparse_attention

    def capturing(q, k, v, grid_, cube, cubes_kept, quant="none"):
        calls[0] += 1  # the first sparse layer is layer 1
        if calls[0] in LAYERS:
            kept[calls[0]] = (q.detach().clone(), k.detach().clone(), v.detach().clone(),
                              cubes_kept)
        return inner(q, k, v, grid_, cube, cubes_kept, quant)

    tgd.sparse_attention = capturing
    try:
        with torch.no_grad():
            model(x, t, ctx, return_dict=False)
        torch.cuda.synchronize()
    finally:
        tgd.sparse_attention = inner
    del model
    torch.cuda.empty_cache()
    print(f"captured layers {sorted(kept)} of {calls[0]} sparse calls", flush=True)

    vbs = layout.vbs_for_grid(grid, device=dev)
    src = layout.cube_sources(grid, device=dev)
    n_cubes = vbs.numel()
    topk = tgd.topk_for(0.875, n_cubes)
    gen = torch.Generator(device=dev).manual_seed(1)
    shape = next(iter(kept.values()))[0].shape
    cases = {f"layer{n}": kept[n][:3] for n in sorted(kept)}
    cases["random"] = tuple(torch.randn(shape, generator=gen, device=dev).bfloat16()
                            for _ in range(3))
    op = _quant_op_for(cases["random"][0], "int8_fp8")
    for name, (q, k, v) in cases.items():
        res["layers"][name] = r = _layer_case(op, q, k, v, grid, topk, vbs, src)
        print(f"{name}: {r}", flush=True)
        save()

    # the default workload: bf16 op and 8-bit op, ascending against rotated rows
    from tilegen import captures
    from tilegen.ops import block_sparse_attention, block_sparse_attention_8bit

    cap = captures.synthesize(seed=0, device="cuda")
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    idx_rot = rotated(idx)
    d: dict = {"stats": selection_stats(idx, vbs)}
    d["bf16_ms"] = _ms(lambda: block_sparse_attention(q, k, v, idx, vbs))
    d["bf16_rotated_ms"] = _ms(lambda: block_sparse_attention(q, k, v, idx_rot, vbs))
    d["int8_fp8_ms"] = _ms(lambda: block_sparse_attention_8bit(q, k, v, idx, vbs))
    d["int8_fp8_rotated_ms"] = _ms(lambda: block_sparse_attention_8bit(q, k, v, idx_rot, vbs))
    a = block_sparse_attention(q, k, v, idx, vbs).float()
    b = block_sparse_attention(q, k, v, idx_rot, vbs).float()
    d["bf16_rotated_rel_l1"] = ((a - b).abs().sum() / a.abs().sum()).item()
    res["default_workload"] = d
    print(f"default workload: {d}", flush=True)
    save()
    print("\n| case | partial selected | distinct a head | THW op | pre-pass | kernel | "
          "kernel rotated |\n|---|---|---|---|---|---|---|")
    for name, r in res["layers"].items():
        s = r["stats"]
        print(f"| {name} | {s['partial_selected']:.3f} | {s['distinct_per_head']:.0f} | "
              f"{r['thw_op_ms']:.3f} | {r['prepass_ms']:.3f} | {r['kernel_ms']:.3f} | "
              f"{r['kernel_rotated_ms']:.3f} |")
    print(f"| default bf16 | | | {d['bf16_ms']:.3f} | | | {d['bf16_rotated_ms']:.3f} |")
    print(f"| default int8_fp8 | | | {d['int8_fp8_ms']:.3f} | | | "
          f"{d['int8_fp8_rotated_ms']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
