"""`tilegen.integrations.parallel.ulysses_attention` and the diffusers processor past one GPU,
on the CPU: two processes on torch.distributed's gloo backend (`torch.multiprocessing.spawn` on
a free loopback port), each held to a deadline, then terminated and failed; the ranks' side is
in `_parallel_workers.py`. Each rank compares its share of the parallel result with the
one-process result it computes itself.

- `ulysses_attention` (grid 4x8x8, 4 heads of 64, fp32, batch 2, 2 of 4 cubes kept): the
  output and the gradients of q, k and v equal the one-process `sparse_attention`; heads or
  tokens that do not divide by the group size are refused in one line.
- Context parallelism: diffusers' split/gather hooks and its Ulysses group (``ulysses_degree=2``)
  around the tiny Wan of `test_integration_diffusers.py` with a calibration plan applied: the
  one-process output. diffusers 0.42's ``enable_parallelism`` does not run on a CPU-only
  machine (it builds its device mesh on the accelerator: ``rank %
  torch.accelerator.device_count()`` divides by zero, checked below), so the workers build the
  same mesh on the CPU and do the rest of ``enable_parallelism`` themselves.
- Tensor parallelism: diffusers 0.42 cannot shard Wan (``WanTransformer3DModel`` has no
  ``_tp_plan``, and its tensor parallelism takes accelerator meshes only: both checked below),
  so the workers head-shard the tiny Wan's self-attention by hand and run
  `enable_block_sparse` on each rank unchanged.

Not exercised here: NCCL and GPUs (the two-GPU timing of issue #25).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import _parallel_workers

import _parallel_workers as workers  # noqa: E402

DEADLINE_S = 120.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(name: str, world: int = 2) -> None:
    """Run ``_parallel_workers.<name>(rank, world)`` on ``world`` gloo ranks; a rank's exception
    fails the test with its traceback, and ranks still running at the deadline are terminated
    and fail it."""
    ctx = mp.spawn(workers.entry,
                   args=(name, _free_port(), world, os.environ.get("TRITON_INTERPRET")),
                   nprocs=world, join=False)
    end = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > end:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(10)
            pytest.fail(f"{name}: the ranks did not finish within {DEADLINE_S:.0f} s")


def test_ulysses_equals_one_process_forward_and_backward():
    spawn("ulysses_forward_backward")


def test_ulysses_refuses_what_does_not_divide():
    spawn("ulysses_errors")


def test_ulysses_needs_torch_distributed():
    from tilegen.integrations.parallel import ulysses_attention

    q = torch.randn(1, 256, 4, 64)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        ulysses_attention(q, q, q, (4, 8, 8), group=None)


def test_wan_under_context_parallelism_equals_one_process():
    pytest.importorskip("diffusers")
    spawn("wan_context_parallel")


def test_wan_head_sharded_equals_one_process():
    pytest.importorskip("diffusers")
    spawn("wan_head_sharded")


def test_ring_and_ulysses_anything_are_refused_and_calibration_wants_one_process():
    """Checked from the config alone, in this process: ``ring_degree > 1`` by
    `enable_block_sparse` and by the processor at its call, ``ulysses_anything``, and
    `calibrate` on a context-parallel transformer."""
    diffusers = pytest.importorskip("diffusers")
    import test_integration_diffusers as t

    from tilegen.integrations import diffusers as tgd

    def parallel(**cp):
        return diffusers.ParallelConfig(
            context_parallel_config=diffusers.ContextParallelConfig(**cp))

    model = t.tiny()
    model.blocks[0].attn1.processor._parallel_config = parallel(ring_degree=2)
    with pytest.raises(ValueError, match=r"ring_degree=2 is refused .*ulysses_degree=P\)$"):
        tgd.enable_block_sparse(model)
    assert not isinstance(model.blocks[0].attn1.processor, tgd.BlockSparseWanAttnProcessor)

    model = t.tiny()
    tgd.enable_block_sparse(model)
    model.blocks[1].attn1.processor._parallel_config = parallel(ring_degree=2, ulysses_degree=2)
    with pytest.raises(ValueError, match="ring_degree=2 is refused.*ulysses_degree"):
        t.run(model, t.call())
    model.blocks[1].attn1.processor._parallel_config = parallel(ulysses_degree=2,
                                                                ulysses_anything=True)
    with pytest.raises(ValueError, match=r"ulysses_anything=True\) is refused$"):
        t.run(model, t.call())

    model = t.tiny()
    model._parallel_config = parallel(ulysses_degree=2)
    with pytest.raises(ValueError, match="calibrate runs on one process"):
        tgd.calibrate(model, t.call())


def test_diffusers_parallelism_does_not_run_wan_on_this_cpu():
    """Why the workers set parallelism up by hand: diffusers 0.42 refuses tensor parallelism of
    Wan (no ``_tp_plan``), and ``enable_parallelism`` computes its device from the accelerator
    count, which is 0 on a CPU-only machine. When one of these stops failing, use diffusers'
    own setup in the workers."""
    diffusers = pytest.importorskip("diffusers")
    import test_integration_diffusers as t

    with pytest.raises(ValueError, match="`_tp_plan` must be set"):
        t.tiny().enable_parallelism(config=diffusers.TensorParallelConfig(tp_degree=2))
    if torch.accelerator.device_count() > 0:
        pytest.skip("this machine has an accelerator")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ZeroDivisionError):
            t.tiny().enable_parallelism(config=diffusers.ContextParallelConfig(ulysses_degree=2))
    finally:
        dist.destroy_process_group()
