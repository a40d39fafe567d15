"""Question (issue #22, item 5): how much faster is one denoising step (one transformer forward)
of a Wan2.2-A14B-shaped diffusers transformer at 832x480x81 (32,760 tokens) with tilegen's
block-sparse self-attention (87.5% on every layer but the first and the last) than with SDPA
(cuDNN)? Random bf16 weights: timings only, no quality figure means anything here.

    PYTHONPATH=$PWD python3 bench/experiments/h200_wan_step.py --out $OUT/wan_step.json

Every variant in one process, the dense reference first and last (drift check): eager, then
regional torch.compile (`compile_repeated_blocks`, fullgraph) for both, a CUDA-graph capture and
replay of the sparse step, attention alone per layer (dense SDPA against tilegen's processor
path: reorder, selection, kernel, reorder back), and a correctness check (sparsity 0 against
dense on a 2-block model at the full grid). The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

CUDA = torch.cuda.is_available()
#: the dense reference: SDPA's cuDNN kernel (the math kernel for --tiny on a CPU)
DENSE = [SDPBackend.CUDNN_ATTENTION] if CUDA else [SDPBackend.MATH]


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _sync_time(fn, reps: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _bench_ms(fn) -> float:
    if not CUDA:  # --tiny on a CPU: the script's logic, not a figure
        return min(_sync_time(fn, 2))
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200))


def _profile_step(step, say, label: str, top: int = 25) -> dict:
    """One step under torch.profiler: device microseconds and launches by kernel name (the top
    `top` by total), and the q/k/v strides the 8-bit pre-pass received (a copy in front of the
    op would show as contiguous=False here and as copy kernels above)."""
    from torch.profiler import ProfilerActivity, profile

    from tilegen import quant

    seen: list = []
    inner = quant.quantize_triton

    def recording(q, k, v, *a, **kw):
        if len(seen) < 3:
            seen.append([(tuple(t.shape), tuple(t.stride()), t.is_contiguous())
                         for t in (q, k, v)])
        return inner(q, k, v, *a, **kw)

    quant.quantize_triton = recording
    try:
        step()
        _sync()
        # on a CPU (--tiny) the ops' CPU time stands in: the script's logic, not a figure
        with profile(activities=[ProfilerActivity.CUDA if CUDA else ProfilerActivity.CPU]) \
                as prof:
            step()
            _sync()
    finally:
        quant.quantize_triton = inner
    own = (lambda e: e.self_device_time_total) if CUDA else (lambda e: e.self_cpu_time_total)
    kernels = sorted(((e.key, own(e), e.count) for e in prof.key_averages() if own(e) > 0),
                     key=lambda r: -r[1])
    total = sum(r[1] for r in kernels)
    say(f"profile {label}: {total / 1e3:.1f} ms of device time in {len(kernels)} kernels; "
        f"pre-pass inputs {seen[:1]}")
    for name, us, n in kernels[:top]:
        say(f"   {us / 1e3:9.2f} ms  x{n:<4d} {us / max(n, 1):9.1f} us each  {name[:110]}")
    return {"total_ms": total / 1e3, "prepass_inputs": seen,
            "kernels": [{"name": k, "ms": us / 1e3, "count": n} for k, us, n in kernels[:top]]}


def prebuild() -> None:
    """The CUDA wgmma cubins the step loads on a Hopper GPU (the bf16 and 8-bit defaults, which
    are the shipped H100 winners; with and without lse), compiled here for sm_90a with no GPU
    into $TILEGEN_CACHE_DIR, so the GPU's minutes go to timing."""
    from tilegen.backends.cuda import wgmma
    from tilegen.backends.cuda.nvcc import compile_cuda
    from tilegen.backends.cuda.wgmma_op import WgmmaLaunch, WgmmaQuantLaunch
    from tilegen.spec import Spec
    from tilegen.targets import get_target

    target = get_target("sm_90")
    for spec, launch in ((Spec(), WgmmaLaunch), (Spec(quant="int8_fp8"), WgmmaQuantLaunch)):
        cfg = wgmma.config(**wgmma.defaults_for(spec))
        for lse in (True, False):
            run = launch(spec.kernel_spec, cfg.replace(store_lse=lse), target)
            compile_cuda(run.source, target, None, run.digest)
        print(f"prebuilt {spec.quant}: {cfg.name}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prebuild", action="store_true",
                    help="compile the CUDA cubins for sm_90a here (no GPU), then stop")
    ap.add_argument("--out", default="wan_step.json")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--no-eager", action="store_true",
                    help="skip the eager step rows (the compiled ones are the comparison)")
    ap.add_argument("--prepass-prologue", action="store_true",
                    help="also time the compiled 8-bit step with the q/k prologue applied by "
                         "the pre-pass (tilegen.integrations.diffusers._PROLOGUE_IN_PREPASS)")
    ap.add_argument("--quant", default="int8_fp8",
                    help="the 8-bit recipe timed beside bf16 ('none': bf16 rows only)")
    ap.add_argument("--profile", action="store_true",
                    help="one compiled step of dense and of the 8-bit layer under "
                         "torch.profiler: device time by kernel (where a sparse layer's "
                         "time goes inside the model), and the strides the 8-bit pre-pass "
                         "receives")
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-head model at a small grid: checks this script on a CPU")
    args = ap.parse_args()
    if args.prebuild:
        prebuild()
        return 0
    if args.tiny:
        cfg = dict(num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
                   text_dim=32, freq_dim=32, ffn_dim=256, rope_max_seq_len=64)
        frames, height, width, text_len = 8, 16, 16, 8
    else:  # Wan2.2-A14B's config is the class default; the latent of 832x480x81
        cfg = {}
        frames, height, width, text_len = 21, 60, 104, 512
    grid = (frames, height // 2, width // 2)

    from diffusers import WanTransformer3DModel

    from tilegen.integrations import diffusers as tgd
    from tilegen.integrations.attention import sparse_attention

    dev = torch.device("cuda" if CUDA else "cpu")
    result: dict = {"device": torch.cuda.get_device_name() if CUDA else "cpu",
                    "torch": torch.__version__, "layers": args.layers, "rows": {}}
    import diffusers
    import triton

    result["diffusers"], result["triton"] = diffusers.__version__, triton.__version__
    rows = result["rows"]
    log = []

    def say(msg):  # the JSON so far is written at every line: a run cut short keeps it
        print(msg, flush=True)
        log.append(msg)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**result, "log": log}, indent=2))

    # -- correctness: sparsity 0 on a 2-block model at the full grid, and 87.5% finite ------
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, cfg.get("in_channels", 16), frames, height, width, generator=g,
                    device=dev).bfloat16()
    t = torch.tensor([999.0], device=dev)
    ctx = torch.randn(1, text_len, cfg.get("text_dim", 4096), generator=g, device=dev).bfloat16()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        small = WanTransformer3DModel(num_layers=2, **cfg).eval()
    torch.set_default_dtype(torch.float32)
    with torch.no_grad(), sdpa_kernel(DENSE):
        ref = small(x, t, ctx).sample.float()
        tgd.enable_block_sparse(small, sparsity=0.0)
        o0 = small(x, t, ctx).sample.float()
        tgd.enable_block_sparse(small, sparsity=0.875)
        o1 = small(x, t, ctx).sample.float()
        tgd.disable_block_sparse(small)
        again = small(x, t, ctx).sample.float()
    rel = lambda a, b: float((a - b).abs().sum() / b.abs().sum())  # noqa: E731
    result["check"] = {"all_cubes_rel_l1": rel(o0, ref), "sparse_rel_l1": rel(o1, ref),
                       "sparse_finite": bool(torch.isfinite(o1).all()),
                       "disable_restores": bool(torch.equal(again, ref))}
    say(f"check: {result['check']}")
    del small, ref, o0, o1, again
    torch.cuda.empty_cache()

    # -- the A14B-shaped transformer ---------------------------------------------------------
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = WanTransformer3DModel(num_layers=args.layers, **cfg).eval()
    torch.set_default_dtype(torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    result["params"] = n_params
    say(f"built {n_params / 1e9:.2f} B params in {time.perf_counter() - t0:.1f}s, "
        f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    dense_layers = (0, args.layers - 1)

    def step():
        with torch.no_grad(), sdpa_kernel(DENSE):
            return model(x, t, ctx, return_dict=False)[0]

    def timed(name, reps=args.reps):
        ms = _sync_time(step, reps)
        rows[name] = {"ms": min(ms), "all_ms": ms}
        say(f"{name}: {min(ms):.1f} ms (all {[round(m, 1) for m in ms]})")

    eager = not args.no_eager
    if eager:
        timed("dense_eager")
    tgd.enable_block_sparse(model, sparsity=0.875, dense_layers=dense_layers)
    if eager:
        timed("tilegen_eager")
    out_sparse = step().float()
    tgd.disable_block_sparse(model)
    quant = None if args.quant == "none" else args.quant
    if quant:
        tgd.enable_block_sparse(model, sparsity=0.875, dense_layers=dense_layers, quant=quant)
        if eager:
            timed(f"tilegen_{quant}_eager")
        out_8bit = step().float()
        tgd.disable_block_sparse(model)
    if eager:
        timed("dense_eager_again")
    out_dense = step().float()
    result["step_rel_l1_sparse_vs_dense"] = rel(out_sparse, out_dense)
    if quant:  # random weights: a sanity figure only, not a quality one
        result[f"step_rel_l1_{quant}_vs_dense"] = rel(out_8bit, out_dense)
        result[f"step_rel_l1_{quant}_vs_sparse_bf16"] = rel(out_8bit, out_sparse)
        del out_8bit
    del out_sparse, out_dense

    # -- attention alone, per layer, same tensors --------------------------------------------
    S, H = grid[0] * grid[1] * grid[2], cfg.get("num_attention_heads", 40)
    D = cfg.get("attention_head_dim", 128)
    q, k, v = (torch.randn(1, S, H, D, generator=g, device=dev).bfloat16() for _ in range(3))
    from tilegen import layout

    n_cubes = math.prod(layout.cube_grid(grid))
    with torch.no_grad():
        with sdpa_kernel(DENSE):
            rows["attn_dense_cudnn"] = {"ms": _bench_ms(lambda: tgd._dense_attention(q, k, v))}
        kept = tgd.topk_for(0.875, n_cubes)
        rows["attn_tilegen_processor"] = {"ms": _bench_ms(
            lambda: sparse_attention(q, k, v, grid, (4, 4, 4), kept)), "topk": kept}
        from tilegen import sparsity
        from tilegen.ops import block_sparse_attention

        qc, vbs = layout.to_cubes(q, grid)
        kc, _ = layout.to_cubes(k, grid)
        vc, _ = layout.to_cubes(v, grid)
        idx = sparsity.mean_pool_topk(qc, kc, vbs, kept)
        rows["attn_tilegen_kernel_op"] = {"ms": _bench_ms(
            lambda: block_sparse_attention(qc, kc, vc, idx, vbs))}
        rows["attn_reorder_x3"] = {"ms": _bench_ms(
            lambda: [layout.to_cubes(z, grid) for z in (q, k, v)])}
        rows["attn_select"] = {"ms": _bench_ms(
            lambda: sparsity.mean_pool_topk(qc, kc, vbs, kept))}
        names = ["attn_dense_cudnn", "attn_tilegen_processor", "attn_tilegen_kernel_op",
                 "attn_reorder_x3", "attn_select"]
        if quant:
            from tilegen.ops import (
                _quant_op_for,
                block_sparse_attention_8bit,
                block_sparse_attention_8bit_thw,
            )

            # the processor's 8-bit layer (THW tokens: no reorder) against the cube-major
            # path it replaces (reorder x3, selection, the 8-bit op, reorder back): equal
            thw = block_sparse_attention_8bit_thw(q, k, v, grid, kept, quant=quant)
            cube_major = layout.from_cubes(
                block_sparse_attention_8bit(qc, kc, vc, idx, vbs, quant=quant), grid)
            idx_thw = sparsity.mean_pool_topk_thw(q, k, grid, kept)
            # the THW op's own selection: from the cube means its pre-pass pools
            op8 = _quant_op_for(q, quant)
            src = layout.cube_sources(grid, device=dev)
            pooled = op8.quantize(q, k, v, vbs, sources=src, pool=True)
            idx_prepass = sparsity.topk_of_means(pooled.q_pool, pooled.k_pool, kept)
            o_bf16 = layout.from_cubes(block_sparse_attention(qc, kc, vc, idx, vbs), grid)
            result["thw_8bit_check"] = {
                "selection_equal": bool(torch.equal(idx_thw, idx)),
                "prepass_selection_equal": bool(torch.equal(idx_prepass, idx)),
                "prepass_pool_max_abs_diff": max(
                    (pooled.q_pool - sparsity.pool_cubes(qc, vbs)).abs().max().item(),
                    (pooled.k_pool - sparsity.pool_cubes(kc, vbs)).abs().max().item()),
                "o_equal_cube_major_path": bool(torch.equal(thw, cube_major)),
                "rel_l1_vs_bf16_layer": rel(thw.float(), o_bf16.float()),
                "finite": bool(torch.isfinite(thw).all())}
            say(f"thw_8bit_check: {result['thw_8bit_check']}")
            del thw, cube_major, o_bf16, pooled
            qi = op8.quantize(q, k, v, vbs, sources=src)
            rows[f"attn_tilegen_processor_{quant}"] = {"ms": _bench_ms(
                lambda: sparse_attention(q, k, v, grid, (4, 4, 4), kept, quant))}
            rows[f"attn_tilegen_kernel_op_{quant}"] = {"ms": _bench_ms(
                lambda: block_sparse_attention_8bit(qc, kc, vc, idx, vbs, quant=quant))}
            rows["attn_select_thw"] = {"ms": _bench_ms(
                lambda: sparsity.mean_pool_topk_thw(q, k, grid, kept))}
            rows[f"attn_prepass_thw_{quant}"] = {"ms": _bench_ms(
                lambda: op8.quantize(q, k, v, vbs, sources=src))}
            rows[f"attn_prepass_thw_pool_{quant}"] = {"ms": _bench_ms(
                lambda: op8.quantize(q, k, v, vbs, sources=src, pool=True))}
            means = op8.quantize(q, k, v, vbs, sources=src, pool=True)
            rows["attn_select_from_means"] = {"ms": _bench_ms(
                lambda: sparsity.topk_of_means(means.q_pool, means.k_pool, kept))}
            del means
            rows[f"attn_kernel_from_quantized_{quant}"] = {"ms": _bench_ms(
                lambda: op8.from_quantized(qi, idx, vbs, return_lse=False))}
            rows["attn_from_cubes"] = {"ms": _bench_ms(
                lambda: layout.from_cubes(qc, grid))}
            names_token = []
            if getattr(op8, "writes_token_order", False):  # the kernel's epilogue reorders
                slot_rows = layout.slot_tokens(grid, device=dev)
                rows[f"attn_kernel_from_quantized_token_order_{quant}"] = {"ms": _bench_ms(
                    lambda: op8.from_quantized(qi, idx, vbs, return_lse=False,
                                               out_rows=slot_rows, out_len=S))}
                names_token = [f"attn_kernel_from_quantized_token_order_{quant}"]
            names += [f"attn_tilegen_processor_{quant}", f"attn_tilegen_kernel_op_{quant}",
                      "attn_select_thw", f"attn_prepass_thw_{quant}",
                      f"attn_prepass_thw_pool_{quant}", "attn_select_from_means",
                      f"attn_kernel_from_quantized_{quant}", "attn_from_cubes", *names_token]
            del qi
    for name in names:
        say(f"{name}: {rows[name]['ms']:.2f} ms")
    from tilegen import ops as tg_ops

    result["ops"] = {repr(key): repr(op) for key, op in tg_ops._ops.items()}
    say(f"ops: {result['ops']}")
    q = k = v = qc = kc = vc = None  # noqa: F841 - freed before the graph and compile rows
    torch.cuda.empty_cache()

    # -- CUDA graph of the sparse step -------------------------------------------------------
    if not args.no_graph and CUDA:
        tgd.enable_block_sparse(model, sparsity=0.875, dense_layers=dense_layers)
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    eager = step()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = step()
            graph.replay()
            torch.cuda.synchronize()
            result["graph_matches_eager"] = bool(torch.equal(captured, eager))
            ms = _sync_time(graph.replay, args.reps)
            rows["tilegen_cuda_graph"] = {"ms": min(ms), "all_ms": ms}
            say(f"tilegen_cuda_graph: {min(ms):.1f} ms, matches eager: "
                f"{result['graph_matches_eager']}")
            del graph, captured, eager
        except Exception as exc:  # recorded, not hidden: the table shows the failure
            result["graph_error"] = f"{type(exc).__name__}: {exc}"
            say(f"CUDA graph failed: {result['graph_error']}")
        tgd.disable_block_sparse(model)
        torch.cuda.empty_cache()

    # -- regional compile --------------------------------------------------------------------
    if not args.no_compile:
        from torch._dynamo.utils import counters

        try:
            counters.clear()
            t0 = time.perf_counter()
            model.compile_repeated_blocks(fullgraph=True)
            step()
            result["compile_dense_s"] = time.perf_counter() - t0
            timed("dense_compiled")
            tgd.enable_block_sparse(model, sparsity=0.875, dense_layers=dense_layers)
            t0 = time.perf_counter()
            step()
            result["compile_tilegen_s"] = time.perf_counter() - t0
            timed("tilegen_compiled")
            result["graph_breaks"] = dict(counters["graph_break"])
            tgd.disable_block_sparse(model)
            if quant:
                tgd.enable_block_sparse(model, sparsity=0.875, dense_layers=dense_layers,
                                        quant=quant)
                t0 = time.perf_counter()
                step()
                result[f"compile_tilegen_{quant}_s"] = time.perf_counter() - t0
                timed(f"tilegen_{quant}_compiled")
                result["graph_breaks_8bit"] = dict(counters["graph_break"])
                if args.prepass_prologue:  # the q/k prologue applied by the 8-bit pre-pass
                    tgd._PROLOGUE_IN_PREPASS = True
                    step()
                    timed(f"tilegen_{quant}_prepass_prologue_compiled")
                    tgd._PROLOGUE_IN_PREPASS = False
                if args.profile:
                    result["profile_8bit"] = _profile_step(step, say, f"compiled {quant}")
                tgd.disable_block_sparse(model)
            timed("dense_compiled_again")
            if args.profile:
                result["profile_dense"] = _profile_step(step, say, "compiled dense")
        except Exception as exc:
            result["compile_error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
            say(f"compile failed: {result['compile_error']}")

    # -- the table ---------------------------------------------------------------------------
    if eager:
        dense = min(rows["dense_eager"]["ms"], rows["dense_eager_again"]["ms"])
        result["speedup_eager"] = dense / rows["tilegen_eager"]["ms"]
        result["attention_share_dense"] = (args.layers * rows["attn_dense_cudnn"]["ms"]) / dense
    if "tilegen_compiled" in rows:
        dc = min(rows["dense_compiled"]["ms"], rows["dense_compiled_again"]["ms"])
        result["speedup_compiled"] = dc / rows["tilegen_compiled"]["ms"]
        if quant and f"tilegen_{quant}_compiled" in rows:
            result[f"speedup_compiled_{quant}"] = dc / rows[f"tilegen_{quant}_compiled"]["ms"]
            fused = rows.get(f"tilegen_{quant}_prepass_prologue_compiled")
            if fused:
                result[f"speedup_compiled_{quant}_prepass_prologue"] = dc / fused["ms"]
    if quant and eager:
        result[f"speedup_eager_{quant}"] = dense / rows[f"tilegen_{quant}_eager"]["ms"]
    if "tilegen_cuda_graph" in rows and eager:
        result["speedup_graph_vs_dense_eager"] = dense / rows["tilegen_cuda_graph"]["ms"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result["log"] = log
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("\n| row | ms |\n|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['ms']:.2f} |")
    for key in ("speedup_eager", "speedup_compiled", f"speedup_eager_{quant}",
                f"speedup_compiled_{quant}", f"step_rel_l1_{quant}_vs_dense",
                f"step_rel_l1_{quant}_vs_sparse_bf16", "speedup_graph_vs_dense_eager",
                "attention_share_dense", "step_rel_l1_sparse_vs_dense", "graph_matches_eager",
                "graph_breaks", "compile_dense_s", "compile_tilegen_s"):
        if key in result:
            print(f"{key}: {result[key]}")
    print(f"check: {result['check']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CUDNN_SDPA_ENABLED", "1")
    sys.exit(main())
