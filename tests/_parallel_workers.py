"""The rank side of tests/test_parallel.py: what each of the two gloo processes runs.

Nothing heavy at import: the spawned child unpickles `entry` by importing this module, and
`entry` sets TRITON_INTERPRET as the parent has it before torch, triton or tilegen load (Triton
reads it once, at its import). Each worker computes its own one-process reference on the full
tensors (same seeds on both ranks) and compares its rank's share of the parallel result to it;
a failed check raises, and the parent reports the child's traceback.
"""

from __future__ import annotations

import datetime
import os
import re


def entry(rank: int, name: str, port: int, world: int, interpret: str | None) -> None:
    if interpret is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = interpret
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on a small machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=90))
    try:
        globals()[name](rank, world)
    finally:
        dist.destroy_process_group()


def _raises(exc: type[BaseException], match: str, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert re.search(match, str(e)), f"{exc.__name__} says {e!s}, expected /{match}/"
        assert "\n" not in str(e), f"not one line: {e!s}"
        return str(e)
    raise AssertionError(f"{fn.__name__} did not raise {exc.__name__} /{match}/")


# -- ulysses_attention on synthetic tensors -----------------------------------------------------
GRID, CUBE, HEADS, HEAD_DIM, TOPK = (4, 8, 8), (4, 4, 4), 4, 64, 2  # 256 tokens, 4 cubes


def ulysses_forward_backward(rank: int, world: int) -> None:
    """Forward and the gradients of q, k, v of `ulysses_attention` over the two ranks equal
    the one-process `sparse_attention` on the full sequence, in fp32, batch 2, 2 of 4 cubes."""
    import torch
    import torch.distributed as dist

    from tilegen.integrations.attention import sparse_attention
    from tilegen.integrations.parallel import ulysses_attention

    g = torch.Generator().manual_seed(0)
    n = GRID[0] * GRID[1] * GRID[2]
    q, k, v, w = (torch.randn(2, n, HEADS, HEAD_DIM, generator=g) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = sparse_attention(*full, GRID, CUBE, TOPK)
    (ref * w).sum().backward()

    share = slice(rank * n // world, (rank + 1) * n // world)
    local = [t[:, share].clone().requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*local, GRID, group=dist.group.WORLD, topk=TOPK, cube=CUBE)
    assert out.shape == (2, n // world, HEADS, HEAD_DIM) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref[:, share], rtol=1e-5, atol=1e-5)
    (out * w[:, share]).sum().backward()
    for name, a, b in zip("qkv", local, full, strict=True):
        assert a.grad is not None and a.grad.abs().sum() > 0, f"no gradient of {name}"
        torch.testing.assert_close(a.grad, b.grad[:, share], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")


def ulysses_errors(rank: int, world: int) -> None:
    """Shapes the two ranks cannot split are refused in one line, on both ranks alike, before
    any collective (so neither rank waits on the other)."""
    import torch
    import torch.distributed as dist

    from tilegen.integrations.parallel import ulysses_attention

    group = dist.group.WORLD
    n = GRID[0] * GRID[1] * GRID[2]
    three = torch.randn(1, n // world, 3, HEAD_DIM)
    _raises(ValueError, r"3 heads do not divide by the group size 2", ulysses_attention,
            three, three, three, GRID, group=group)
    odd = torch.randn(1, 38, HEADS, HEAD_DIM)  # the grid (3, 5, 5) has 75 tokens
    _raises(ValueError, r"75 tokens, which do not divide by the group size 2",
            ulysses_attention, odd, odd, odd, (3, 5, 5), group=group)
    whole = torch.randn(1, n, HEADS, HEAD_DIM)  # every token on each rank: not a shard
    _raises(ValueError, r"holds 256 tokens per rank, 2 ranks hold 512, the grid \(4, 8, 8\) "
            r"has 256", ulysses_attention, whole, whole, whole, GRID, group=group)
    _raises(TypeError, r"group must be a torch.distributed ProcessGroup", ulysses_attention,
            whole, whole, whole, GRID, group=None)
    # both ranks still agree afterwards: the group is not left half-way through a collective
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    assert t.item() == 1.0


# -- the tiny Wan transformer of tests/test_integration_diffusers.py ---------------------------
def _tiny_wan():
    import test_integration_diffusers as t  # the tiny model's config, call and run

    return t


def _context_parallel_on_cpu(model, cp_config):
    """What ``model.enable_parallelism(config=cp_config)`` does, on a CPU mesh: diffusers 0.42
    builds its device mesh on the accelerator (``rank % torch.accelerator.device_count()``
    divides by zero on a CPU-only machine), so build the same ("ring", "ulysses") mesh on the
    CPU, set the config up, hand it to every attention processor that takes one, and apply the
    model's context-parallel plan (diffusers' split and gather hooks)."""
    import functools
    import logging

    import torch
    import torch.distributed as dist
    from diffusers import ParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models.attention import AttentionModuleMixin
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", cp_config.mesh_shape, mesh_dim_names=cp_config.mesh_dim_names)
    config = ParallelConfig(context_parallel_config=cp_config)
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    model._parallel_config = config
    for module in model.modules():
        if isinstance(module, AttentionModuleMixin) and hasattr(module.processor,
                                                                "_parallel_config"):
            module.processor._parallel_config = config
    if not hasattr(logging.Logger, "warning_once"):
        # diffusers 0.42.1's split hook warns through Logger.warning_once, which transformers
        # installs (a Wan pipeline imports it for its text encoder); without transformers, Wan's
        # 1-D timestep (its plan expects 2-D, so it is not split) raises AttributeError there
        logging.Logger.warning_once = functools.lru_cache(None)(logging.Logger.warning)
    apply_context_parallel(model, cp_config, model._cp_plan)
    return config


def wan_context_parallel(rank: int, world: int) -> None:
    """The tiny Wan (2 heads, grid 8x8x8) under diffusers' context parallelism with
    ``ulysses_degree=2``: a calibration plan (layer 0 sparse at 87.5%, layer 1 dense) gives the
    one-process output; layer 0 runs `ulysses_attention` on the config's Ulysses group; after
    `disable_block_sparse` diffusers' restored processor attends over the whole sequence too,
    and `enable_block_sparse` after parallelism (the other order) gives the plan's output again."""
    import torch
    from diffusers import ContextParallelConfig

    from tilegen.integrations import diffusers as tgd

    t = _tiny_wan()
    model, kwargs = t.tiny(), t.call()
    dense = t.run(model, kwargs)
    plan = tgd.calibrate(model, kwargs, rel_l1=1.0, sparsity=[0.875, 0.5],
                         layer_gates={1: 0.0})
    assert [layer.sparsity for layer in plan.layers] == [0.875, None]
    tgd.enable_block_sparse(model, plan=plan)
    ref = t.run(model, kwargs)
    assert t.rel_l1(ref, dense) > 1e-3  # layer 0 really is sparse

    config = _context_parallel_on_cpu(model, ContextParallelConfig(ulysses_degree=world))
    proc = model.blocks[0].attn1.processor
    assert isinstance(proc, tgd.BlockSparseWanAttnProcessor) and proc._parallel_config is config
    calls = []
    real = tgd.ulysses_attention

    def counted(q, k, v, grid, **kw):
        calls.append((tuple(q.shape), tuple(grid), kw["group"]))
        return real(q, k, v, grid, **kw)

    tgd.ulysses_attention = counted
    try:
        out = t.run(model, kwargs)
    finally:
        tgd.ulysses_attention = real
    group = config.context_parallel_config._ulysses_mesh.get_group()
    assert calls == [((1, 256, 2, 64), (8, 8, 8), group)], calls  # layer 0 only, S/2 tokens
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)

    tgd.disable_block_sparse(model)
    assert model.blocks[0].attn1.processor._parallel_config is config  # handed to diffusers'
    torch.testing.assert_close(t.run(model, kwargs), dense, rtol=1e-4, atol=1e-4)
    # enabled after parallelism: the new processor takes the config of the one it replaces
    tgd.enable_block_sparse(model, plan=plan)
    assert model.blocks[0].attn1.processor._parallel_config is config
    torch.testing.assert_close(t.run(model, kwargs), ref, rtol=1e-4, atol=1e-4)


def _shard_heads(attn, rank: int, world: int) -> None:
    """Tensor-parallel ``attn`` by hand (what a ``_tp_plan`` would do): q/k/v projections
    column-sharded by heads; the q/k RMS norms, which span all heads in Wan, on the rank's
    channels with the sum of squares all-reduced; the output projection row-sharded with an
    all-reduce; ``attn.heads`` the rank's heads."""
    import torch
    import torch.distributed as dist

    inner = attn.to_q.out_features
    share = slice(rank * inner // world, (rank + 1) * inner // world)

    class ShardedRMSNorm(torch.nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.weight = torch.nn.Parameter(norm.weight.detach()[share].clone())
            self.eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps

        def forward(self, x):
            ss = x.float().square().sum(-1, keepdim=True)
            dist.all_reduce(ss)
            return (x.float() * torch.rsqrt(ss / inner + self.eps)).type_as(x) * self.weight

    class RowParallel(torch.nn.Module):
        def __init__(self, full):
            super().__init__()
            self.weight = torch.nn.Parameter(full.weight.detach()[:, share].clone())
            self.bias = torch.nn.Parameter(full.bias.detach().clone())

        def forward(self, x):
            y = x @ self.weight.T
            dist.all_reduce(y)
            return y + self.bias

    for name in ("to_q", "to_k", "to_v"):
        full = getattr(attn, name)
        part = torch.nn.Linear(full.in_features, inner // world)
        with torch.no_grad():
            part.weight.copy_(full.weight[share])
            part.bias.copy_(full.bias[share])
        setattr(attn, name, part)
    attn.norm_q, attn.norm_k = ShardedRMSNorm(attn.norm_q), ShardedRMSNorm(attn.norm_k)
    attn.to_out[0] = RowParallel(attn.to_out[0])
    attn.heads //= world


def wan_head_sharded(rank: int, world: int) -> None:
    """The tiny Wan with its self-attention head-sharded over the two ranks (one head each) and
    `enable_block_sparse` on each rank, unchanged: the processor sees one head per rank and the
    output is the one-process block-sparse output."""
    import torch

    from tilegen.integrations import diffusers as tgd

    t = _tiny_wan()
    model, kwargs = t.tiny(), t.call()
    tgd.enable_block_sparse(model, sparsity=0.5)  # 4 of 8 cubes
    ref = t.run(model, kwargs)
    tgd.disable_block_sparse(model)
    for block in model.blocks:
        _shard_heads(block.attn1, rank, world)
    tgd.enable_block_sparse(model, sparsity=0.5)
    heads = []
    real = tgd.sparse_attention

    def seen(q, k, v, *args, **kwargs):
        heads.append(q.shape[2])
        return real(q, k, v, *args, **kwargs)

    tgd.sparse_attention = seen
    try:
        out = t.run(model, kwargs)
    finally:
        tgd.sparse_attention = real
    assert heads == [1, 1], heads  # both layers, 2 heads / 2 ranks
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
