"""Question: How fast are the selectors and the full VSA forward, and how well do they recall dense
attention? (issue #9)

H200 check and timing of the selectors and the full VSA forward (issue #9, items 3-5).

One process, the default workload (Wan2.2 T2V-A14B: grid 21x30x52, 40 heads, D=128, bf16,
624 cubes, topk 78), `captures.synthesize(seed=0, device="cuda")` with its outlier head; q, k, v
are taken back to THW token order (`layout.from_cubes`) for `video_sparse_attention`.

Sections (each fail-soft: an error is recorded as text and the rest still runs):

1. ``pool``: `sparsity.mean_pool_topk` at full size (q, k (1, 39936, 40, 128) bf16, topk 78)
   beside, in the same run: the bandwidth floor (`x.view(...).sum(2, dtype=fp32)` of q and k,
   no masking, no scores), the previous implementation (chunked fp32 upcast + einsum) and a
   bmm with ``out_dtype=float32``; GB/s = the 818 MB of q and k over the time. The goal is
   <= 0.5 ms.
2. ``selectors``: `jenga_mask` / `jenga_lut` (box adjacency, topk' 51 so rows hold <= 78 cubes)
   and `cdf_mask`; each also run under ``torch.cuda.set_sync_debug_mode("error")`` (a host
   sync raises) to show it has none.
3. ``vsa``: `tilegen.ops.video_sparse_attention` end to end (gate None and a (B, S, H, D) gate),
   the split (reorder = 3x to_cubes, coarse, fine = the tuned op, combine incl. the reorder
   back, and the reorder back alone), beside dense SDPA on the same tokens with the cuDNN and
   the flash backends (`sdpa_kernel`), and the no-sync check of the whole op.
4. ``correctness``: the op (gate tensor) with the contract's scoring rule against
   `vsa.reference_fp32` on the op's selection, and against the same pipeline with the
   contract's reference Triton kernel in the fine stage (the contract compares kernels with the
   reference kernel's bf16 output: bf16 kernels round P to bf16 before P.V, which the fp32
   oracle does not); and the agreement of the op's selection with the reference's own (fp64
   pooled scores).
5. ``recall``: `bench/experiments/recall_study.py` at grid 21x30x52 (624 cubes), 2 heads (outlier
   incl.), D=128, budget 78 cubes/row.

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=/tmp/tgc python3 bench/experiments/h200_vsa.py  # ~3 min, H200
    PYTHONPATH=$PWD python3 bench/experiments/h200_vsa.py --dry-run  # CPU, tiny, every section

JSON to $OUT/h200_vsa.json (default ./out); the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS: dict = {"sections": {}, "errors": {}}
JSON_PATH: list[Path] = []
GOAL_POOL_MS = 0.5  # issue #9: mean_pool_topk at full size


def _dump() -> None:
    if JSON_PATH:
        JSON_PATH[0].parent.mkdir(parents=True, exist_ok=True)
        JSON_PATH[0].write_text(json.dumps(RESULTS, indent=2, default=str) + "\n")


def section(name):
    def wrap(fn):
        def run(*a, **kw):
            t0 = time.time()
            try:
                RESULTS["sections"][name] = fn(*a, **kw)
            except Exception as exc:  # fail soft: record, go on
                RESULTS["errors"][name] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            RESULTS.setdefault("wall_s", {})[name] = round(time.time() - t0, 1)
            print(f"[{name}] {time.time() - t0:.1f} s", flush=True)
            _dump()
        return run
    return wrap


def timer(dry: bool):
    """Median ms: triton's do_bench on the GPU, a few perf_counter runs in --dry-run."""
    if not dry:
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=25, rep=100))

    def cpu(fn):
        fn()
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return sorted(ts)[1]
    return cpu


def no_sync(fn, dev) -> str:
    """'none' when fn runs under sync-debug mode "error" without raising (CUDA only)."""
    if dev.type != "cuda":
        return "n/a (CPU)"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "none"
    except RuntimeError as exc:
        return f"SYNC: {str(exc).splitlines()[0][:120]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def old_pool(x, vbs, block=64, chunk=64):
    """The previous `pool_cubes` (chunked fp32 upcast + einsum), timed as a reference."""
    b, s, h, d = x.shape
    nc = s // block
    xv = x.view(b, nc, block, h, d)
    vbs_d = vbs.long()
    out = torch.empty((b, nc, h, d), dtype=torch.float32, device=x.device)
    slot = torch.arange(block, device=x.device)
    for c0 in range(0, nc, chunk):
        c1 = min(nc, c0 + chunk)
        w = (slot[None, :] < vbs_d[c0:c1, None]).to(torch.float32)
        out[:, c0:c1] = torch.einsum("bcshd,cs->bchd", xv[:, c0:c1].to(torch.float32), w)
    out /= vbs_d.to(torch.float32).view(1, nc, 1, 1)
    return out.permute(0, 2, 1, 3).contiguous()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, every section")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", nargs="*", default=[], help="sections to skip")
    a = ap.parse_args(argv)
    dry = a.dry_run
    JSON_PATH.append(Path(a.json) if a.json else Path(os.environ.get("OUT", "out")) /
                     ("h200_vsa_dry.json" if dry else "h200_vsa.json"))
    import recall_study

    from tilegen import captures, layout, sparsity, vsa
    from tilegen.ops import video_sparse_attention, vsa_fine, vsa_fine_op

    dev = torch.device("cpu" if dry else "cuda")
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on a CPU")
    RESULTS["device"] = torch.cuda.get_device_name() if not dry else "cpu (dry run)"
    RESULTS["torch"] = torch.__version__
    bench = timer(dry)
    if dry:
        grid, heads, D, topk, jk = (8, 12, 16), 2, 64, 6, 2
    else:
        grid, heads, D, topk, jk = (21, 30, 52), 40, 128, 78, 51
    cube = (4, 4, 4)
    t0 = time.time()
    cap = captures.synthesize(seed=0, grid=grid, heads=heads, head_dim=D, topk=topk,
                              device=dev)
    qc, kc, vc, vbs = cap["q"], cap["k"], cap["v"], cap["vbs"]
    q, k, v = (layout.from_cubes(t, grid, cube) for t in (qc, kc, vc))
    gen = torch.Generator(device=dev).manual_seed(1)
    gate = torch.sigmoid(torch.randn(q.shape, generator=gen, device=dev)).to(q.dtype)
    RESULTS["workload"] = {"grid": grid, "heads": heads, "head_dim": D, "topk": topk,
                           "tokens": q.shape[1], "cubes": qc.shape[1] // 64,
                           "outlier_heads": cap["outlier_heads"],
                           "synth_s": round(time.time() - t0, 1)}
    qk_bytes = 2 * qc.numel() * qc.element_size()

    @section("pool")
    def pool():
        out = {"bytes_qk": qk_bytes}
        out["mean_pool_topk_ms"] = bench(lambda: sparsity.mean_pool_topk(qc, kc, vbs, topk))
        out["floor_view_sum_ms"] = bench(lambda: (
            qc.view(1, -1, 64, heads * D).sum(2, dtype=torch.float32),
            kc.view(1, -1, 64, heads * D).sum(2, dtype=torch.float32)))
        out["pool_q_and_k_ms"] = bench(lambda: (sparsity.pool_cubes(qc, vbs),
                                                sparsity.pool_cubes(kc, vbs)))
        out["previous_impl_ms"] = bench(lambda: (old_pool(qc, vbs) @ old_pool(kc, vbs)
                                                 .transpose(-1, -2)).topk(topk, dim=-1))
        if dev.type == "cuda":
            nc = qc.shape[1] // 64
            w = (torch.arange(64, device=dev)[None] < vbs[:, None].long()).to(qc.dtype)
            w = w.view(nc, 1, 64)
            try:
                out["bmm_out_fp32_q_and_k_ms"] = bench(lambda: [
                    torch.bmm(w, x.view(nc, 64, heads * D), out_dtype=torch.float32)
                    for x in (qc, kc)])
            except Exception as exc:  # an older torch: no out_dtype
                out["bmm_out_fp32_q_and_k_ms"] = f"{type(exc).__name__}: {exc}"[:200]
        for key in ("mean_pool_topk_ms", "floor_view_sum_ms", "pool_q_and_k_ms"):
            out[key.replace("_ms", "_TBps")] = qk_bytes / (out[key] * 1e-3) / 1e12
        out["goal_ms"] = GOAL_POOL_MS
        out["meets_goal"] = out["mean_pool_topk_ms"] <= GOAL_POOL_MS
        out["host_sync"] = no_sync(lambda: sparsity.mean_pool_topk(qc, kc, vbs, topk), dev)
        return out

    @section("selectors")
    def selectors():
        out = {}
        out["jenga_mask_ms"] = bench(lambda: sparsity.jenga_mask(qc, kc, jk, grid, cube))
        out["jenga_lut_ms"] = bench(lambda: sparsity.jenga_lut(qc, kc, jk, grid, cube))
        out["cdf_mask_ms"] = bench(lambda: sparsity.cdf_mask(qc, kc, vbs, 0.9))
        m = sparsity.jenga_mask(qc, kc, jk, grid, cube)
        out["jenga_cubes_per_row_mean"] = float(m.sum(-1).float().mean())
        out["jenga_cubes_per_row_max"] = int(m.sum(-1).max())
        out["jenga_topk_prime"] = jk
        for name, fn in (("jenga_mask", lambda: sparsity.jenga_mask(qc, kc, jk, grid, cube)),
                         ("jenga_lut", lambda: sparsity.jenga_lut(qc, kc, jk, grid, cube)),
                         ("cdf_mask", lambda: sparsity.cdf_mask(qc, kc, vbs, 0.9))):
            out[f"{name}_host_sync"] = no_sync(fn, dev)
        return out

    @section("vsa")
    def vsa_timing():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        out = {}
        def run(g=None):
            return video_sparse_attention(q, k, v, grid, topk, cube, g)

        run()  # compile / load the fine kernel first
        out["total_gate_none_ms"] = bench(lambda: run(None))
        out["total_gate_ms"] = bench(lambda: run(gate))
        scale = 1.0 / math.sqrt(D)
        vol = 64
        cqc, ckc, cvc = (vsa.reorder(t, grid, cube) for t in (q, k, v))
        co, idx = vsa.coarse(cqc, ckc, cvc, vbs, topk, vol, scale)
        fine_c = vsa_fine(cqc, ckc, cvc, idx, vbs, grid, cube, None)
        out["reorder_ms"] = bench(lambda: [vsa.reorder(t, grid, cube) for t in (q, k, v)])
        if q.is_cuda:  # a Triton launch (the CPU dry run has no interpreter)
            from tilegen.reorder_gpu import to_cubes3

            out["reorder_fused_ms"] = bench(lambda: to_cubes3(q, k, v, grid, cube))
        out["coarse_ms"] = bench(lambda: vsa.coarse(cqc, ckc, cvc, vbs, topk, vol, scale))
        out["fine_ms"] = bench(lambda: vsa_fine(cqc, ckc, cvc, idx, vbs, grid, cube, None))
        out["combine_gate_none_ms"] = bench(lambda: vsa.combine(fine_c, co, None, grid, cube))
        out["combine_gate_ms"] = bench(lambda: vsa.combine(fine_c, co, gate, grid, cube))
        out["reorder_back_ms"] = bench(lambda: layout.from_cubes(fine_c, grid, cube))
        out["fine_op"] = repr(vsa_fine_op(vsa.fine_spec(cqc, grid, cube, topk)))
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, N, D) views
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                def fn(backend=backend):
                    with sdpa_kernel([backend]):
                        return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)

                fn()
                out[f"sdpa_{name}_ms"] = bench(fn)
            except Exception as exc:
                out[f"sdpa_{name}_ms"] = f"{type(exc).__name__}: {exc}"[:200]
        dense = [x for x in (out.get("sdpa_cudnn_ms"), out.get("sdpa_flash_ms"))
                 if isinstance(x, float)]
        if dense:
            out["speedup_vs_best_dense"] = min(dense) / out["total_gate_ms"]
        out["host_sync"] = no_sync(lambda: run(gate), dev)
        return out

    @section("correctness")
    def correctness():
        o, idx = vsa.forward(q, k, v, grid, topk, cube, gate, fine=vsa_fine, return_selection=True)
        o_op = video_sparse_attention(q, k, v, grid, topk, cube, gate)
        ref, _ = vsa.reference_fp32(q, k, v, grid, topk, cube, gate, topk_idx=idx)
        res = captures.score(o_op, ref.to(o_op.dtype))
        del ref
        out = {"score": str(res), "passed": res.passed, "forward_equals_op": torch.equal(o, o_op)}
        # the contract's style of check: the same pipeline with the contract's reference
        # kernel (64x64 tiles, P rounded to bf16 like every bf16 kernel) in the fine stage
        import tilegen

        cqc, ckc, cvc = (vsa.reorder(t, grid, cube) for t in (q, k, v))
        co, _ = vsa.coarse(cqc, ckc, cvc, vbs, topk, 64, 1.0 / math.sqrt(D))
        spec = vsa.fine_spec(cqc, grid, cube, topk)
        ref_op = tilegen.load(spec, tilegen.config.reference_config(spec))
        fine_ref = ref_op(cqc, ckc, cvc, idx, vbs, return_lse=False)
        res_k = captures.score(o_op, vsa.combine(fine_ref, co, gate, grid, cube))
        out["score_vs_reference_kernel_pipeline"] = str(res_k)
        out["passed_vs_reference_kernel_pipeline"] = res_k.passed
        # the op's selection against the reference's own (fp64 pooled scores): set agreement
        own = _own_selection(q, k, grid, cube, topk)
        nc = qc.shape[1] // 64
        both = sparsity.lut_to_mask(idx, nc) & sparsity.lut_to_mask(own, nc)
        out["selection_agreement"] = float(both.sum() / own.numel())
        return out

    def _own_selection(q, k, grid, cube, topk):
        qc_, _ = layout.to_cubes(q, grid, cube)
        kc_, _ = layout.to_cubes(k, grid, cube)
        vol = 64
        nc = qc_.shape[1] // vol
        real = torch.arange(vol, device=dev)[None] < vbs.long()[:, None]

        def pooled(x):
            s = torch.zeros(1, nc, heads, D, dtype=torch.float64, device=dev)
            for c0 in range(0, nc, 64):  # fp64 in chunks of cubes
                xs = x.view(1, nc, vol, heads, D)[:, c0:c0 + 64].double()
                s[:, c0:c0 + 64] = (xs * real[c0:c0 + 64].view(1, -1, vol, 1, 1)).sum(2)
            return (s.to(x.dtype).double() / vbs.double().view(1, nc, 1, 1)).permute(0, 2, 1, 3)

        raw = pooled(qc_) @ pooled(kc_).transpose(-1, -2)
        return raw.topk(topk, dim=-1).indices.sort(dim=-1).values.to(torch.int32)

    @section("recall")
    def recall():
        if dry:
            rows = recall_study.study(grid=(8, 12, 16), heads=2, head_dim=64, density=0.25,
                                      seeds=(0,), device=dev)
        else:
            rows = recall_study.study(grid=(21, 30, 52), heads=2, head_dim=128,
                                      density=0.125, seeds=(0,), device=dev)
        return {"rows": rows, "table": recall_study.table(rows)}

    for name, fn in (("pool", pool), ("selectors", selectors), ("vsa", vsa_timing),
                     ("correctness", correctness), ("recall", recall)):
        if name not in a.skip:
            fn()

    # ---- the table, last ----
    S = RESULTS["sections"]
    lines = [f"h200_vsa on {RESULTS['device']}, torch {RESULTS['torch']}, workload "
             f"{RESULTS['workload']}", ""]

    def row(label, sec, key, unit="ms"):
        val = S.get(sec, {}).get(key, RESULTS["errors"].get(sec, "—"))
        if isinstance(val, float):
            val = f"{val:.3f} {unit}" if unit else f"{val:.3f}"
        lines.append(f"| {label} | {val} |")

    lines += ["| measure | value |", "|---|---|"]
    row("mean_pool_topk full size (goal <= 0.5 ms)", "pool", "mean_pool_topk_ms")
    row("  its bandwidth on q+k", "pool", "mean_pool_topk_TBps", "TB/s")
    row("  floor: view/sum fp32 of q and k", "pool", "floor_view_sum_ms")
    row("  pool_cubes q and k (bmm)", "pool", "pool_q_and_k_ms")
    row("  bmm out_dtype=fp32 q and k", "pool", "bmm_out_fp32_q_and_k_ms")
    row("  previous implementation", "pool", "previous_impl_ms")
    row("  host sync", "pool", "host_sync", "")
    row("jenga_mask (box, topk' 51)", "selectors", "jenga_mask_ms")
    row("jenga_lut", "selectors", "jenga_lut_ms")
    row("cdf_mask p=0.9", "selectors", "cdf_mask_ms")
    row("VSA total, gate None", "vsa", "total_gate_none_ms")
    row("VSA total, (B,S,H,D) gate", "vsa", "total_gate_ms")
    row("  reorder (3x to_cubes)", "vsa", "reorder_ms")
    row("  reorder (one launch: the forward's path)", "vsa", "reorder_fused_ms")
    row("  coarse (pool x3, scores, softmax, P v, top-k)", "vsa", "coarse_ms")
    row("  fine (tuned op)", "vsa", "fine_ms")
    row("  combine + reorder back, gate", "vsa", "combine_gate_ms")
    row("  reorder back alone", "vsa", "reorder_back_ms")
    row("dense SDPA cuDNN", "vsa", "sdpa_cudnn_ms")
    row("dense SDPA flash", "vsa", "sdpa_flash_ms")
    row("VSA speedup vs best dense", "vsa", "speedup_vs_best_dense", "x")
    row("VSA host sync", "vsa", "host_sync", "")
    row("VSA vs fp32 reference", "correctness", "score", "")
    row("VSA vs pipeline with the reference kernel", "correctness",
        "score_vs_reference_kernel_pipeline", "")
    row("selection agreement with fp64 reference", "correctness", "selection_agreement", "")
    text = "\n".join(lines)
    if "recall" in S:
        text += "\n\n" + S["recall"]["table"]
    if RESULTS["errors"]:
        text += "\n\nerrors: " + json.dumps(RESULTS["errors"], indent=1)
    RESULTS["table"] = text
    _dump()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
