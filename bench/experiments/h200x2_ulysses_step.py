"""Question (issue #25, part 4): on two NVIDIA H200s, how fast is one denoising step (one
transformer forward) of a Wan2.2-A14B-shaped diffusers transformer at 1280x720x81 with tilegen's
block-sparse self-attention under diffusers' Ulysses context parallelism, against one GPU and
against SDPA on two GPUs? Random bf16 weights: timings only, no quality figure means anything.

    PYTHONPATH=$PWD python3 bench/experiments/h200x2_ulysses_step.py            # 2 H200s, NCCL
    python3 bench/experiments/h200x2_ulysses_step.py --small --backend gloo --device cpu  # smoke

The shape: Wan2.2-A14B's transformer is ``WanTransformer3DModel``'s class default (dim 5120, 40
heads of 128, FFN 13824, 40 layers, 16 latent channels). Its VAE (AutoencoderKLWan, the Wan2.1
VAE) compresses time by 4 and space by 8, and ``WanPipeline.prepare_latents`` makes
``(frames - 1) // 4 + 1`` latent frames: 1280x720x81 is a latent of 16 x 21 x 90 x 160, which
the (1, 2, 2) patch turns into a 21 x 45 x 80 grid of **75,600 tokens**. tilegen's 4x4x4 cubes
cover it with 6 x 12 x 20 = 1,440 cubes, padded to 24 x 48 x 80 = 92,160 slots (the figure
issue #25 quotes); at 87.5% each query cube keeps 180 KV cubes.

Four configurations, each one timed transformer forward (batch 1, no CFG, a 512-token text
context) under ``sdpa_kernel([cuDNN])``: ``--warmup`` forwards, then ``--repeats`` forwards
bracketed by CUDA events, the median reported:

- (a) SDPA, 1 GPU: diffusers' processors;
- (b) tilegen, 1 GPU: ``enable_block_sparse(model, sparsity=0.875, dense_layers=(0, L-1))``
  (seed 003's deployment: the first and the last layer keep SDPA);
- (c) SDPA, 2 GPUs: ``transformer.enable_parallelism(config=ContextParallelConfig(
  ulysses_degree=2))`` (diffusers' split/gather hooks and its Ulysses all-to-alls);
- (d) tilegen, 2 GPUs: (c) with `enable_block_sparse` after it: the sparse layers run
  `tilegen.integrations.parallel.ulysses_attention` on diffusers' Ulysses group.

The script spawns its own two ranks (``torch.multiprocessing.spawn``, a free loopback port,
``NCCL_NVLS_ENABLE=0``: NVLink multicast stays off). Both ranks build the same model: on the
meta device, ``to_empty`` on their device, then filled there from one seeded generator with
the distributions of diffusers' own init (so both ranks hold the same weights; a checksum
compares them). (a) and (b) run on rank 0 while rank 1 waits (the other GPU idle, so the
one-GPU figures are not those of a busy host); (c) and (d) on both, a repeat's time being the
slower rank's. Checks: (d)'s output against (b)'s (relative L1 and cosine, bf16 tolerance:
``--max-rel-l1``, ``--min-cos``), with (c) against (a) and (b) against (a) for scale. Gates:
(b)/(d) >= 1.7x and (c)/(d) >= 1.8x. The time estimate (from session 9's one-H200 figures at
832x480, scaled) is printed before the ranks start; the run stops itself at ``--deadline-s``.

Rank 0 writes ``$OUT/h200x2_ulysses_step.json`` (rewritten at every log line: a run cut short
keeps what it measured) and ``$OUT/h200x2_ulysses_step.log`` ($OUT defaults to ./out), and prints
the table last. Exit status 0 when the run completes and the output check passes, 1 otherwise
(the speedup gates are the measured answer, recorded, not an exit status).

On a CPU (``--device cpu --backend gloo --small``): a 4-layer, 4-head model at an 8x8x16 grid,
tilegen's op on its PyTorch path, SDPA's math kernel, and diffusers' context parallelism set up
by hand (diffusers 0.42's ``enable_parallelism`` builds its device mesh on the accelerator and
divides by zero without one; the same mesh, config and hooks are built as
``tests/_parallel_workers.py`` does). It checks the script, not a figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the spawned ranks import tilegen from this checkout too
    sys.path.insert(0, str(REPO))

WORLD = 2
NAME = "h200x2_ulysses_step"
VAE_TEMPORAL, VAE_SPATIAL = 4, 8  # AutoencoderKLWan (Wan2.1 VAE, Wan2.2-A14B's)
CUBE = (4, 4, 4)
GATES = {"b_over_d": 1.7, "c_over_d": 1.8}
#: --small: a model with the A14B's structure at a size a CPU runs in seconds
SMALL = dict(num_attention_heads=4, attention_head_dim=64, in_channels=4, out_channels=4,
             text_dim=32, freq_dim=32, ffn_dim=256, rope_max_seq_len=64)
SMALL_LATENT, SMALL_TEXT = (8, 16, 32), 8
CONFIGS = {
    "a": "SDPA, 1 GPU",
    "b": "tilegen, 1 GPU",
    "c": "SDPA, 2 GPUs, Ulysses 2",
    "d": "tilegen, 2 GPUs, Ulysses 2",
}

# -- the workload -------------------------------------------------------------------------------


def workload(args: argparse.Namespace) -> dict:
    """Shapes: the model config (A14B's class defaults, or --small's), the latent, the grid the
    transformer sees, the cubes."""
    from tilegen import layout
    from tilegen.integrations.attention import topk_for

    if args.small:
        cfg, latent, text_len, video = dict(SMALL), SMALL_LATENT, SMALL_TEXT, None
        channels = SMALL["in_channels"]
    else:
        cfg, text_len, channels = {}, 512, 16
        if (args.frames - 1) % VAE_TEMPORAL or args.height % VAE_SPATIAL or \
                args.width % VAE_SPATIAL:
            raise SystemExit(f"--frames must be 4k+1 and --height/--width multiples of "
                             f"{VAE_SPATIAL} (the Wan VAE), got {args.width}x{args.height}x"
                             f"{args.frames}")
        latent = ((args.frames - 1) // VAE_TEMPORAL + 1, args.height // VAE_SPATIAL,
                  args.width // VAE_SPATIAL)
        video = (args.width, args.height, args.frames)
    cfg["num_layers"] = args.layers
    patch = (1, 2, 2)
    if any(n % p for n, p in zip(latent, patch, strict=True)):
        raise SystemExit(f"the latent {latent} does not divide by the patch {patch}")
    grid = tuple(n // p for n, p in zip(latent, patch, strict=True))
    tokens = math.prod(grid)
    heads = cfg.get("num_attention_heads", 40)
    head_dim = cfg.get("attention_head_dim", 128)
    if heads % WORLD or tokens % WORLD:
        raise SystemExit(f"Ulysses over {WORLD} ranks needs heads ({heads}) and tokens "
                         f"({tokens}) divisible by {WORLD}")
    cubes = layout.cube_grid(grid, CUBE)
    n_cubes = math.prod(cubes)
    if any(not -args.layers <= i < args.layers for i in args.dense_layers):
        raise SystemExit(f"--dense-layers {args.dense_layers}: not block indices of a "
                         f"{args.layers}-layer transformer")
    dense = sorted({i % args.layers for i in args.dense_layers})
    return dict(cfg=cfg, video=video, latent=(channels, *latent), grid=grid, tokens=tokens,
                text_len=text_len, heads=heads, head_dim=head_dim, dim=heads * head_dim,
                ffn_dim=cfg.get("ffn_dim", 13824), layers=args.layers, dense_layers=dense,
                cube_grid=cubes, n_cubes=n_cubes, cube_slots=n_cubes * math.prod(CUBE),
                topk=topk_for(args.sparsity, n_cubes), sparsity=args.sparsity)


# -- the estimate (2 H200s), from session 9's one-H200 step (bench/RESULTS.md, 2026-12-02) -------
S9 = dict(tokens=32760, n_cubes=624, topk=78, heads=40, head_dim=128,
          dense_ms=3363.2,         # the 40-layer A14B step, SDPA cuDNN, eager
          attn_ms=39.59,           # one layer's SDPA cuDNN (1, 32760, 40, 128)
          kernel_select_ms=7.49 + 0.45,  # tilegen's kernel + the mean-pool selection, a layer
          reorder_ms=1.85)         # q, k, v to cubes and back, a layer
NVLINK_GBS = 300.0  # an all-to-all's effective rate per GPU over NVLink (conservative)
HBM_GBS = 2500.0    # effective rate of the permute copies around an all-to-all


def estimate(w: dict, args: argparse.Namespace) -> dict:
    """Per-config milliseconds of one forward and the run's seconds, scaled from session 9:
    attention by tokens^2, the rest by tokens, tilegen's kernel and selection by cubes x kept,
    its reorder by cube slots; two GPUs halve each and add six all-to-alls a layer (q, k, v,
    out of self-attention; q, out of cross-attention) at NVLINK_GBS."""
    if args.small:
        return {}
    s = w["tokens"] / S9["tokens"]
    width = w["heads"] * w["head_dim"] / (S9["heads"] * S9["head_dim"])
    rest = (S9["dense_ms"] - 40 * S9["attn_ms"]) / 40 * s  # GEMMs, norms, RoPE, cross-attn
    attn = S9["attn_ms"] * s * s * width
    sparse = width * (S9["kernel_select_ms"] * (w["n_cubes"] * w["topk"])
                      / (S9["n_cubes"] * S9["topk"])
                      + S9["reorder_ms"] * w["cube_slots"] / (S9["n_cubes"] * 64))
    shard_bytes = w["tokens"] / WORLD * w["dim"] * 2  # one rank's (S/P, H*D) bf16
    a2a = 6 * (shard_bytes * (WORLD - 1) / WORLD / (NVLINK_GBS * 1e9)
               + 3 * shard_bytes / (HBM_GBS * 1e9)) * 1e3
    n_dense = len(w["dense_layers"])
    n_sparse = w["layers"] - n_dense
    ms = {"a": w["layers"] * (rest + attn),
          "b": n_dense * (rest + attn) + n_sparse * (rest + sparse),
          "c": w["layers"] * ((rest + attn) / WORLD + a2a),
          "d": n_dense * ((rest + attn) / WORLD + a2a)
          + n_sparse * ((rest + sparse) / WORLD + a2a)}
    forwards = args.warmup + args.repeats
    startup_s = 60.0 + 0.4 * w["layers"]  # imports, CUDA/NCCL init, the model built and filled
    compile_s = 60.0  # tilegen's kernel compiled on its first calls (40 and 20 heads)
    run_s = {k: forwards * v / 1e3 for k, v in ms.items()}
    total = startup_s + compile_s + sum(run_s.values())
    per_layer_s = sum(run_s.values()) / w["layers"]
    fits = int((args.deadline_s - startup_s - compile_s) // per_layer_s)
    return dict(ms=ms, per_layer_ms=dict(rest=rest, attn=attn, sparse=sparse, a2a=a2a),
                run_s=run_s, startup_s=startup_s, compile_s=compile_s, total_s=total,
                layers_that_fit=min(40, fits))


def print_estimate(w: dict, est: dict, args: argparse.Namespace) -> list[str]:
    lines = [f"workload: {describe(w)}",
             f"cubes {CUBE}: {'x'.join(map(str, w['cube_grid']))} = {w['n_cubes']:,} "
             f"({w['cube_slots']:,} slots), {w['topk']} kept per query cube at sparsity "
             f"{w['sparsity']}; SDPA on layers {w['dense_layers']}"]
    if est:
        p = est["per_layer_ms"]
        lines.append(f"estimate per layer: rest {p['rest']:.0f} ms, SDPA {p['attn']:.0f} ms, "
                     f"tilegen attention {p['sparse']:.1f} ms, 2-GPU all-to-alls "
                     f"{p['a2a']:.1f} ms")
        lines.append("estimate per forward: " + ", ".join(
            f"({k}) {v / 1e3:.2f} s" for k, v in est["ms"].items())
            + f"; speedups (b)/(d) {est['ms']['b'] / est['ms']['d']:.2f}x, (c)/(d) "
            f"{est['ms']['c'] / est['ms']['d']:.2f}x")
        lines.append(f"estimated run: {est['total_s']:.0f} s = startup {est['startup_s']:.0f} "
                     f"+ first-call compile {est['compile_s']:.0f} + "
                     f"{args.warmup + args.repeats} forwards x 4 configs "
                     f"{sum(est['run_s'].values()):.0f} s "
                     f"({', '.join(f'{k} {v:.0f}' for k, v in est['run_s'].items())}); "
                     f"deadline {args.deadline_s:.0f} s, about {est['layers_that_fit']} layers "
                     "fit")
        if est["total_s"] > args.deadline_s:
            lines.append(f"WARNING: the estimate exceeds the deadline: try --layers "
                         f"{est['layers_that_fit']} or fewer --repeats")
    for line in lines:
        print(line, flush=True)
    return lines


def describe(w: dict) -> str:
    shape = (f"{w['video'][0]}x{w['video'][1]}x{w['video'][2]} video -> " if w["video"] else
             "small smoke config: ")
    return (f"{shape}latent {'x'.join(map(str, w['latent']))} -> grid "
            f"{'x'.join(map(str, w['grid']))} = {w['tokens']:,} tokens, {w['heads']} heads of "
            f"{w['head_dim']}, {w['layers']} layers")


# -- the model ------------------------------------------------------------------------------------


@torch.no_grad()
def build_model(w: dict, dev: torch.device, seed: int):
    """The transformer on the meta device, ``to_empty`` on ``dev``, every parameter filled on
    ``dev`` from one generator with diffusers' init distributions (Linear/Conv3d: U(+-1/sqrt(
    fan_in)) for weight and bias; norms: weight 1, bias 0; the scale-shift tables: N(0, 1) /
    sqrt(dim)), and the rotary tables (the only buffers) recomputed."""
    from diffusers import WanTransformer3DModel

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = WanTransformer3DModel(**w["cfg"]).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    model.to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    filled = set()
    for mod in model.modules():
        own = dict(mod.named_parameters(recurse=False))
        if not own:
            continue
        if isinstance(mod, (torch.nn.Linear, torch.nn.Conv3d)):
            bound = mod.weight[0].numel() ** -0.5
            for p in own.values():
                p.uniform_(-bound, bound, generator=g)
        elif "Norm" in type(mod).__name__:
            for name, p in own.items():
                p.fill_(1.0 if name == "weight" else 0.0)
        else:  # scale_shift_table of the model and of each block
            for p in own.values():
                p.normal_(generator=g).div_(p.shape[-1] ** 0.5)
        filled.update(id(p) for p in own.values())
    missed = [n for n, p in model.named_parameters() if id(p) not in filled]
    assert not missed, f"parameters left unfilled: {missed[:5]}"
    rope = model.rope
    with torch.device(dev):
        fresh = type(rope)(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
    names = [n for n, _ in model.named_buffers()]
    assert all(n.startswith("rope.") for n in names), f"buffers beyond the rotary's: {names}"
    for name, buf in fresh.named_buffers():
        rope.get_buffer(name).copy_(buf)
    return model


def inputs(w: dict, dev: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    x = torch.randn(1, *w["latent"], generator=g, device=dev).bfloat16()
    ctx = torch.randn(1, w["text_len"], w["cfg"].get("text_dim", 4096), generator=g,
                      device=dev).bfloat16()
    return x, torch.tensor([999.0], device=dev), ctx


def enable_context_parallel(model, dev: torch.device, log) -> str:
    """diffusers' ``enable_parallelism`` with ``ContextParallelConfig(ulysses_degree=2)`` on a
    GPU; on a CPU (or where it fails) the same by hand, as tests/_parallel_workers.py does."""
    import functools
    import logging

    from diffusers import ContextParallelConfig

    if not hasattr(logging.Logger, "warning_once"):
        # diffusers 0.42.1's split hook warns through Logger.warning_once, which transformers
        # installs; without transformers, Wan's 1-D timestep (its plan expects 2-D, so it is
        # not split) raises AttributeError there
        logging.Logger.warning_once = functools.lru_cache(None)(logging.Logger.warning)
    cp = ContextParallelConfig(ulysses_degree=WORLD)
    if dev.type == "cuda":
        try:
            model.enable_parallelism(config=cp)
            return "enable_parallelism"
        except Exception as exc:  # recorded; the manual set-up below is the same mesh and hooks
            log(f"enable_parallelism failed ({type(exc).__name__}: {exc}); setting it up by "
                "hand")
            model._parallel_config = None
            cp = ContextParallelConfig(ulysses_degree=WORLD)
    import torch.distributed as dist
    from diffusers import ParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models.attention import AttentionModuleMixin
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(dist.get_rank(), dist.get_world_size(), dev, mesh=mesh)
    model._parallel_config = config
    for module in model.modules():
        if isinstance(module, AttentionModuleMixin) and hasattr(module.processor,
                                                                "_parallel_config"):
            module.processor._parallel_config = config
    apply_context_parallel(model, cp, model._cp_plan)
    return "by hand (mesh, ParallelConfig.setup, apply_context_parallel)"


# -- one rank -------------------------------------------------------------------------------------


def rel_l1(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().sum() / ref.abs().sum().clamp_min(1e-30))


def cosine(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), ref.flatten(), dim=0))


class Rank:
    def __init__(self, rank: int, args: argparse.Namespace, w: dict, est: dict,
                 pre: list[str], t_launch: float) -> None:
        import torch.distributed as dist

        self.dist, self.rank, self.args, self.w = dist, rank, args, w
        self.cuda = args.device == "cuda"
        self.dev = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self.t_launch = t_launch
        self.out_dir = Path(args.out)
        self.result: dict = {"question": "issue #25 part 4: Wan2.2-A14B-shaped step, Ulysses 2",
                             "args": vars(args), "workload": w, "estimate": est, "rows": {},
                             "checks": {}, "speedups": {}}
        self.log_lines = list(pre)

    # -- bookkeeping ------------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        if self.rank != 0:
            return
        msg = f"[{time.time() - self.t_launch:6.1f}s] {msg}"
        print(msg, flush=True)
        self.log_lines.append(msg)
        self.save()

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"{NAME}.json").write_text(
            json.dumps({**self.result, "log": self.log_lines}, indent=2, default=str) + "\n")
        (self.out_dir / f"{NAME}.log").write_text("\n".join(self.log_lines) + "\n")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    # -- timing -----------------------------------------------------------------------------------
    def forward(self, model, x, t, ctx):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION}[self.args.sdpa] \
            if self.cuda else SDPBackend.MATH
        with torch.no_grad(), sdpa_kernel([backend]):
            return model(x, t, ctx, return_dict=False)[0]

    def timed(self, key: str, model, x, t, ctx, both_ranks: bool) -> torch.Tensor:
        """--warmup forwards, then --repeats timed ones (CUDA events; perf_counter on a CPU);
        on two ranks each repeat starts after a barrier and counts as the slower rank's."""
        args = self.args
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.dev)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            out = self.forward(model, x, t, ctx)
        self.sync()
        warm_s = time.perf_counter() - t0
        ms = []
        for _ in range(args.repeats):
            if both_ranks:
                self.dist.barrier()
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                out = self.forward(model, x, t, ctx)
                end.record()
                end.synchronize()
                ms.append(start.elapsed_time(end))
            else:
                t1 = time.perf_counter()
                out = self.forward(model, x, t, ctx)
                ms.append((time.perf_counter() - t1) * 1e3)
        peak = torch.cuda.max_memory_allocated(self.dev) / 2**30 if self.cuda else None
        row = {"config": CONFIGS[key], "warmup_s": warm_s, "peak_gib": peak}
        if both_ranks:
            every = [None] * WORLD
            self.dist.all_gather_object(every, {"ms": ms, "warmup_s": warm_s, "peak_gib": peak})
            slowest = [max(r["ms"][i] for r in every) for i in range(args.repeats)]
            row.update(ms=statistics.median(slowest), all_ms=slowest,
                       per_rank_ms=[r["ms"] for r in every],
                       warmup_s=max(r["warmup_s"] for r in every),
                       peak_gib=every[0]["peak_gib"])
        else:
            row.update(ms=statistics.median(ms), all_ms=ms)
        self.result["rows"][key] = row
        gib = f", peak {row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else ""
        self.say(f"({key}) {CONFIGS[key]}: {row['ms']:.1f} ms median of {args.repeats} "
                 f"(all {[round(m, 1) for m in row['all_ms']]}; warm-up {row['warmup_s']:.1f} s"
                 f"{gib})")
        return out.float()

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            if self.rank == 0:
                self.result["error"] = f"{type(exc).__name__}: {exc}"
                self.result["traceback"] = traceback.format_exc()
                self.say(f"FAILED: {self.result['error']}")
            raise

    def _run(self) -> None:
        from tilegen.integrations import diffusers as tgd

        args, w, dist = self.args, self.w, self.dist
        self.result["env"] = env = self.environment()
        self.say(f"env: {env}")
        t0 = time.perf_counter()
        model = build_model(w, self.dev, args.seed)
        n_params = sum(p.numel() for p in model.parameters())
        with torch.no_grad():
            checksum = float(sum(p.float().sum() for p in model.parameters()))
        every = [None] * WORLD
        dist.all_gather_object(every, checksum)
        mem = (f", {torch.cuda.memory_allocated(self.dev) / 2**30:.1f} GiB" if self.cuda else "")
        self.result["params"] = n_params
        self.result["weights_checksum"] = every
        if len(set(every)) != 1:
            raise RuntimeError(f"the ranks' weights differ (checksums {every})")
        self.say(f"built {n_params / 1e9:.2f} B params in {time.perf_counter() - t0:.1f} s{mem} "
                 f"on each rank, same weights (checksum {checksum:.6g})")
        x, t, ctx = inputs(w, self.dev, args.seed)
        sparse_kw = dict(sparsity=args.sparsity, dense_layers=w["dense_layers"])

        dist.barrier()
        outs = {}
        if self.rank == 0:  # one GPU; rank 1 waits at the barrier below, its GPU idle
            outs["a"] = self.timed("a", model, x, t, ctx, both_ranks=False)
            tgd.enable_block_sparse(model, **sparse_kw)
            outs["b"] = self.timed("b", model, x, t, ctx, both_ranks=False)
            tgd.disable_block_sparse(model)
            if self.cuda:
                torch.cuda.empty_cache()
        dist.barrier()

        how = enable_context_parallel(model, self.dev, self.say)
        self.result["context_parallel_setup"] = how
        self.say(f"context parallelism (ulysses_degree={WORLD}): {how}")
        outs["c"] = self.timed("c", model, x, t, ctx, both_ranks=True)
        tgd.enable_block_sparse(model, **sparse_kw)
        procs = [b.attn1.processor for b in model.blocks]
        assert all(isinstance(p, tgd.BlockSparseWanAttnProcessor) and p._parallel_config
                   is not None for i, p in enumerate(procs) if i not in w["dense_layers"]), \
            "tilegen's processors did not take diffusers' context-parallel config"
        outs["d"] = self.timed("d", model, x, t, ctx, both_ranks=True)
        if self.rank == 0:
            self.report(outs)
        dist.barrier()

    def environment(self) -> dict:
        import diffusers

        env = {"torch": torch.__version__, "diffusers": diffusers.__version__,
               "backend": self.args.backend, "device": self.args.device,
               "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")}
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
        if self.cuda:
            env["gpus"] = [torch.cuda.get_device_name(i) for i in range(WORLD)]
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        return env

    def report(self, outs: dict) -> None:
        args, w, res = self.args, self.w, self.result
        rows = res["rows"]
        ms = {k: rows[k]["ms"] for k in CONFIGS}
        sp = res["speedups"]
        sp["b_over_d"] = ms["b"] / ms["d"]
        sp["c_over_d"] = ms["c"] / ms["d"]
        sp["a_over_b"] = ms["a"] / ms["b"]
        sp["a_over_c"] = ms["a"] / ms["c"]
        sp["a_over_d"] = ms["a"] / ms["d"]
        gated = self.cuda and not args.small
        checks = res["checks"]
        for key, (a, ref, what) in {
            "d_vs_b": ("d", "b", "2-GPU tilegen against 1-GPU tilegen (the check)"),
            "c_vs_a": ("c", "a", "2-GPU SDPA against 1-GPU SDPA (diffusers' own, for scale)"),
            "b_vs_a": ("b", "a", "1-GPU tilegen against 1-GPU SDPA (the sparsity, for scale)"),
        }.items():
            checks[key] = {"what": what, "rel_l1": rel_l1(outs[a], outs[ref]),
                           "cosine": cosine(outs[a], outs[ref]),
                           "finite": bool(torch.isfinite(outs[a]).all())}
        c = checks["d_vs_b"]
        # within bf16 tolerance, and closer to (b) than the sparsity moves (b) from (a): a
        # wrong head or token layout across the ranks would move it at least that far
        c["pass"] = bool(c["finite"] and c["rel_l1"] <= args.max_rel_l1
                         and c["rel_l1"] < checks["b_vs_a"]["rel_l1"]
                         and c["cosine"] >= args.min_cos)
        res["pass"] = c["pass"]
        self.say("done")

        est = res["estimate"].get("ms", {})
        layers = (f"{w['layers']} of A14B's 40 layers" if w["layers"] != 40 and not args.small
                  else f"{w['layers']} layers")
        where = " x ".join(res["env"].get("gpus", [])) or f"{args.device}, {args.backend}"
        note = "" if self.cuda else " (each 'GPU' here is a CPU rank)"
        lines = [
            "",
            f"## {'tiny Wan' if args.small else 'Wan2.2-A14B-shaped'} transformer forward, "
            f"{describe(w)}",
            f"## {layers}; {where}{note}; bf16, random weights; tilegen sparsity {w['sparsity']} "
            f"({w['topk']} of {w['n_cubes']:,} cubes kept), SDPA on layers {w['dense_layers']}",
            "",
            "| config | ms (median) | min | max | estimate ms | peak GiB |",
            "|---|---|---|---|---|---|",
        ]
        for k, name in CONFIGS.items():
            r = rows[k]
            e = f"{est[k]:.0f}" if k in est else "-"
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
            lines.append(f"| ({k}) {name} | {r['ms']:.1f} | {min(r['all_ms']):.1f} | "
                         f"{max(r['all_ms']):.1f} | {e} | {peak} |")
        lines += ["", "| speedup | x | gate | |", "|---|---|---|---|"]
        names = {"b_over_d": "(b)/(d) 1-GPU tilegen / 2-GPU tilegen",
                 "c_over_d": "(c)/(d) 2-GPU SDPA / 2-GPU tilegen",
                 "a_over_b": "(a)/(b) 1-GPU SDPA / 1-GPU tilegen",
                 "a_over_c": "(a)/(c) 1-GPU SDPA / 2-GPU SDPA",
                 "a_over_d": "(a)/(d) 1-GPU SDPA / 2-GPU tilegen"}
        res["gates"] = {}
        for k, name in names.items():
            if k in GATES:
                ok = sp[k] >= GATES[k]
                res["gates"][k] = {"min": GATES[k], "value": sp[k], "pass": ok}
                verdict = ("PASS" if ok else "FAIL") if gated else "not gated (smoke)"
                lines.append(f"| {name} | {sp[k]:.2f} | >= {GATES[k]} | {verdict} |")
            else:
                lines.append(f"| {name} | {sp[k]:.2f} | | |")
        lines += ["", "| output | rel L1 | cosine | finite | |", "|---|---|---|---|---|"]
        for ch in checks.values():
            verdict = ""
            if "pass" in ch:
                verdict = (f"{'PASS' if ch['pass'] else 'FAIL'} (rel L1 <= {args.max_rel_l1} "
                           f"and below the sparsity's, cos >= {args.min_cos})")
            lines.append(f"| {ch['what']} | {ch['rel_l1']:.2e} | {ch['cosine']:.6f} | "
                         f"{ch['finite']} | {verdict} |")
        lines.append("")
        lines.append(f"tokens the model sees: {w['tokens']:,} (grid {w['grid']}); tilegen's "
                     f"cube layout: {w['cube_slots']:,} slots; context parallelism: "
                     f"{res['context_parallel_setup']}; wall {time.time() - self.t_launch:.0f} s "
                     f"since launch")
        res["table"] = "\n".join(lines)
        self.log_lines += lines
        self.save()
        print("\n".join(lines), flush=True)


def _rank_main(rank: int, args: argparse.Namespace, w: dict, est: dict, pre: list[str],
               port: int, t_launch: float) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off, before any NCCL init
    import torch.distributed as dist

    if args.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or WORLD) // WORLD))
    kw = dict(backend=args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
              world_size=WORLD, timeout=datetime.timedelta(minutes=30))
    if args.backend == "nccl":
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(**kw)
    try:
        Rank(rank, args, w, est, pre, t_launch).run()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None,
                    help="transformer blocks (default 40, A14B's depth; 4 with --small)")
    ap.add_argument("--repeats", type=int, default=5, help="timed forwards per config")
    ap.add_argument("--warmup", type=int, default=1, help="untimed forwards per config first")
    ap.add_argument("--sparsity", type=float, default=0.875)
    ap.add_argument("--dense-layers", type=lambda s: [int(i) for i in s.split(",") if i],
                    default=[0, -1], help="blocks that keep SDPA (default 0,-1)")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=720)
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--small", action="store_true", help="a tiny config: a smoke test")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--sdpa", choices=("cudnn", "flash", "efficient"), default="cudnn",
                    help="SDPA's kernel on a GPU (the math kernel on a CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-rel-l1", type=float, default=0.01,
                    help="the (d) vs (b) check: largest relative L1")
    ap.add_argument("--min-cos", type=float, default=0.999,
                    help="the (d) vs (b) check: smallest cosine")
    ap.add_argument("--deadline-s", type=float, default=570.0,
                    help="stop the ranks after this many seconds (the JSON so far stays)")
    ap.add_argument("--estimate-only", action="store_true",
                    help="print the workload and the time estimate, start nothing")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"),
                    help="output folder (default $OUT, else ./out)")
    args = ap.parse_args()
    if args.layers is None:
        args.layers = 4 if args.small else 40
    if args.layers < 3:
        ap.error("--layers must be at least 3 (the first and the last keep SDPA)")
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats >= 1 and --warmup >= 0")
    if args.backend == "nccl" and args.device != "cuda":
        ap.error("--backend nccl needs --device cuda")
    if args.device == "cpu" and not args.small:
        ap.error("the full A14B shape on a CPU takes hours: add --small")
    if args.device == "cuda" and torch.cuda.device_count() < WORLD and not args.estimate_only:
        ap.error(f"--device cuda needs {WORLD} GPUs, this machine has "
                 f"{torch.cuda.device_count()}")
    if not 0.0 <= args.sparsity < 1.0:
        ap.error("--sparsity must be in [0, 1)")

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited by the ranks
    os.environ.setdefault("TORCH_CUDNN_SDPA_ENABLED", "1")
    t_launch = time.time()
    w = workload(args)
    est = estimate(w, args)
    pre = print_estimate(w, est, args)
    if args.estimate_only:
        return 0

    import torch.multiprocessing as mp

    ctx = mp.spawn(_rank_main, args=(args, w, est, pre, _free_port(), t_launch), nprocs=WORLD,
                   join=False)
    while not ctx.join(timeout=1.0):
        if time.time() - t_launch > args.deadline_s:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(10)
            print(f"STOPPED at the deadline ({args.deadline_s:.0f} s): what was measured is in "
                  f"{Path(args.out) / (NAME + '.json')}", flush=True)
            return 1
    result = json.loads((Path(args.out) / f"{NAME}.json").read_text())
    return 0 if result.get("pass") else 1


if __name__ == "__main__":
    sys.exit(main())
