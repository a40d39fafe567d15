"""`tilegen bench`: every variant and peer in one process, on the same inputs, side by side.

Variants (all on the same q, k, v, topk_idx, vbs of each capture):

- ``reference``: the contract's reference variant, ``tilegen.load(spec, reference_config(spec))``;
  the base of every speedup and the output every other variant is scored against (unless the
  capture bundles its own ``o_ref``). It is itself checked against the fp32 oracle on a subset of
  heads that includes the outlier head(s) (row ``reference-vs-fp32``).
- ``default``: the tuned default, ``tilegen.load(spec)`` (whatever backend its winner is), or the
  ``--config`` variant; also timed through ``tilegen.ops.block_sparse_attention``
  (``ms_custom_op``).
- one row per kernel family asked for with ``--backends``: ``tilegen.load(spec, backend=name)``.
- ``quant-<mode>`` (``--quant``; default: every 8-bit mode a family computes on this GPU,
  `quant_modes_for`): ``tilegen.load(spec.replace(quant=mode))``, its pre-pass included in
  ``ms_op``, scored by the quantized rule (`captures.quant_score`, ``rule`` "quantized") against
  the fp32 oracle and `tilegen.quant.emulate` (check 4) on the oracle's heads, padded query rows
  left out; the row carries the rule's margins (``cos``, ``rel_l1``, ``min_head_cos``,
  ``emul_max_ratio``, ``emul_mean_ratio``).
- ``flex`` (peer): ``torch.nn.attention.flex_attention`` compiled with ``torch.compile``, with a
  BlockMask built from the LUT (`flex_block_mask`: full cubes as full blocks, partial cubes as
  partial blocks whose ``mask_mod`` hides the padding past ``vbs``), 64x64 kernel blocks.
- ``sdpa-cudnn``, ``sdpa-flash`` (peers): dense ``scaled_dot_product_attention`` pinned to one
  backend (BHSD). Dense attention attends every key, padding included: it computes a different
  function, so it is timed, never scored.

Timings are ``triton.testing.do_bench`` medians (warmed; L2 flushed between repetitions):

- ``ms_op``: the op as users call it, ``op(q, k, v, idx, vbs, return_lse=False)`` (host-side
  validation, error-flag bookkeeping and output allocation included);
- ``ms_custom_op`` (default variant): ``block_sparse_attention(q, k, v, idx, vbs)``;
- ``ms_bare``: the bare kernel, ``op.launch(..., shapes=<validated once>, out=<preallocated>,
  store_lse=False)``;
- ``ms_mask`` (flex): building the BlockMask from the LUT (not part of ``ms_op``).

Peers get contiguous BHSD copies of q, k, v made outside the timed region (their native layout).

FLOPs (`FLOPS_FORMULA`): ``4 * D * sum over (b, h, query row) of the real keys that row attends``.
Every one of the S query rows counts, padded rows included (the kernels compute them); the real
keys of KV cube ``c`` are ``vbs[c]``. ``tflops = flops / ms_op / 1e9``. ``tflops_slots`` counts
every key slot the kernel multiplies instead (TOPK x 64 per row; S per row for dense attention).

A variant that fails (compile error, unsupported spec, OOM, FlexAttention not compiling) never
stops the bench: its row carries the error and the bench goes on. The exit status is 0 when
every tilegen row (and the fp32 check) passed, 1 otherwise, 2 without a CUDA GPU. Peers never
change it.

Backward (``--backward``; issue #10 item 5), on the same captures, after the forward variants,
for the Triton family (the one with backward kernels); rows of ``kind`` "backward", dO random
(seeded by the capture's seed), timed with the same timer:

- ``fwd+bwd``: ``block_sparse_attention(q, k, v, idx, vbs)`` on requires_grad q, k, v, then
  ``torch.autograd.grad(o, (q, k, v), dO)``: the whole training step of the op;
- ``bwd kernels``: ``op.launch_backward(dO, q, k, v, o_acc, lse, idx, vbs, inverse=<prebuilt>,
  config=op.backward_config)`` with ``op = tilegen.load(spec, backend="triton")`` and (o_acc,
  lse) from ``op.forward_for_grad``: the three backward kernels alone;
- ``inverse map``: ``backward_maps(idx, None, vbs, NKV, 64, op.backward_config)`` alone: the
  maps every real backward builds per call (the inverse map, and the dQ plan with ds_store);
- ``flex fwd+bwd`` (peer): the FlexAttention peer (same compiled function, same BlockMask) forward
  plus ``torch.autograd.grad``; a compile failure is recorded in the row, never fatal.

The dq, dk, dv of ``fwd+bwd``, ``bwd kernels`` (and flex) are scored with the gradient rule
(`captures.grad_score`: finite, per-head cosine >= 0.9999, max|Δ| <= 1e-2 max|ref|) against the
fp32 autograd reference (`tilegen.reference.attention_grads_fp32`) recomputed on the heads
`backward_heads` picks (outlier head(s), first, last), one head at a time.
FLOPs (`BACKWARD_FLOPS_FORMULA`): the backward is 2.5x the forward's real-key FLOPs, fwd+bwd
3.5x. Backward rows are in the table and the JSON, not in the plot.

The pure parts (argument parsing, FLOP counting, the BlockMask index tensors, rows, JSON, table,
plot) run on the CPU and are tested in tests/test_bench.py; `run_points` takes the timer and the
op loader as arguments so the whole loop runs on the CPU too.

Modules: `plan` (arguments, sweep, FLOPs, variants), `points` (captures walked, shared runner
helpers), `peers` (FlexAttention, dense SDPA), `backward` (the --backward rows), `report` (rows,
JSON, table, progress), `plot`, `run` (the loop, `run_bench`, the timers the tuner uses). This
package re-exports their public names: `tilegen.bench.X` is the spelling callers use.
"""

from __future__ import annotations

from tilegen.bench.backward import (  # noqa: F401
    backward_do,
    backward_heads,
    grad_reference,
    head_dim_of,
    run_backward,
    set_grad_score,
)
from tilegen.bench.peers import (  # noqa: F401
    FlexPeer,
    bwd_flex,
    flex_block_mask,
    lut_block_tensors,
    padding_mask_mod,
    run_dense,
    run_flex,
)
from tilegen.bench.plan import (  # noqa: F401
    BACKWARD_FLOPS_FACTOR,
    BACKWARD_FLOPS_FORMULA,
    BACKWARD_ROWS,
    DEFAULT_REP_MS,
    DEFAULT_WARMUP_MS,
    DENSE_PEERS,
    FLOPS_FORMULA,
    NO_GPU_MESSAGE,
    SWEEP_TOPK,
    Plan,
    Variant,
    backward_flops,
    default_plot_path,
    dense_flops,
    encoding_spec,
    flops_of,
    make_plan,
    parse_backends,
    parse_grid,
    parse_int_list,
    quant_modes_for,
    real_key_flops,
    slot_flops,
    sweep_topks,
    workload_spec,
)
from tilegen.bench.plot import (  # noqa: F401
    plot,
    plot_series,
)
from tilegen.bench.points import (  # noqa: F401
    Point,
    do_bench_timer,
    first_call,
    free_memory,
    from_bhsd,
    heads_of,
    iter_points,
    new_row,
    oracle_heads,
    spec_for_capture,
    synchronize,
    to_bhsd,
)
from tilegen.bench.report import (  # noqa: F401
    BACKWARD_FOOTNOTE,
    TABLE_COLUMNS,
    TABLE_FOOTNOTE,
    Reporter,
    Row,
    environment,
    fill_speedups,
    format_table,
    print_table,
    results_json,
    table_cells,
    verdict,
    write_json,
)
from tilegen.bench.run import (  # noqa: F401
    run_bench,
    run_points,
    steps_per_point,
    time_fn,
    time_op,
)
