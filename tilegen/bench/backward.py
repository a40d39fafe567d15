"""The backward rows of `tilegen bench --backward`: the training step, the kernels alone, the
inverse map, each scored with the gradient rule."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tilegen import captures
from tilegen.bench.peers import FlexPeer, bwd_flex
from tilegen.bench.plan import BACKWARD_ROWS, Plan
from tilegen.bench.points import Point, first_call, free_memory, new_row
from tilegen.bench.report import Reporter, Row
from tilegen.spec import Spec

# ============================================================================ backward


def backward_heads(heads: int, outlier_heads: Sequence[int] = ()) -> list[int]:
    """Heads the backward check recomputes fp32 gradients on: the outlier head(s), the first
    and the last."""
    return sorted({*(h for h in outlier_heads if 0 <= h < heads), 0, heads - 1})


def backward_do(q: torch.Tensor, seed: int | None) -> torch.Tensor:
    """The incoming gradient dO: standard normal, like q, seeded by the capture's seed."""
    g = torch.Generator(device=q.device).manual_seed(1_000_003 + (seed or 0))
    return torch.randn(q.shape, generator=g, device=q.device).to(q.dtype)


def head_dim_of(layout: str) -> int:
    return 2 if layout == "bshd" else 1


def grad_reference(spec: Spec, args: tuple, do: torch.Tensor, heads: Sequence[int]
                   ) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of the fp32 autograd reference on `heads` only (the heads selected with
    index_select, in the spec's layout), computed one head at a time to bound memory."""
    from tilegen.reference import attention_grads_fp32

    layout, dim = spec.layout, head_dim_of(spec.layout)
    vbs = args[4] if spec.variable_block_sizes else None
    parts = []
    for h in heads:
        sel = torch.tensor([h], device=args[0].device)
        q, k, v, d = (t.index_select(dim, sel).contiguous() for t in (*args[:3], do))
        idx = args[3].index_select(1, sel).contiguous()
        parts.append(attention_grads_fp32(q, k, v, idx, vbs, None, d, layout=layout,
                                          block=spec.block_kv, sm_scale=spec.sm_scale))
        del q, k, v, d
    return tuple(torch.cat([p[i] for p in parts], dim=dim) for i in range(3))


def set_grad_score(row: Row, grads: Sequence[torch.Tensor], ref: Sequence[torch.Tensor],
                   layout: str, heads: list[int]) -> None:
    """Score (dq, dk, dv), restricted to `heads`, against the reference on those heads with
    `captures.grad_score`; the row passes iff all three pass."""
    sel = torch.tensor(heads, device=grads[0].device)
    scores = [captures.grad_score(g.index_select(head_dim_of(layout), sel), r, layout=layout)
              for g, r in zip(grads, ref, strict=True)]
    row.passed = all(s.passed for s in scores)
    row.finite = all(s.finite for s in scores)
    row.min_head_cos = min(s.min_head_cos for s in scores)
    row.max_abs = max(s.max_abs for s in scores)
    row.score = "; ".join(f"{n}: {s}" for n, s in zip(("dq", "dk", "dv"), scores, strict=True))
    row.scored_against = f"fp32 autograd reference (attention_grads_fp32), heads {heads}"
    row.heads_checked = list(heads)


def run_backward(plan: Plan, point: Point, spec: Spec, cap: dict, args: tuple,
                  sparse_flops: tuple[float, float], device: str, timer: Callable,
                  loader: Callable, flex: FlexPeer, reporter: Reporter,
                  env: dict[str, str]) -> list[Row]:
    """The backward rows of one capture (`BACKWARD_ROWS`); failures are recorded per row."""
    heads = backward_heads(spec.num_heads, cap.get("outlier_heads") or ())
    ref: tuple[torch.Tensor, ...] | None = None
    ref_error: str | None = None
    reporter.status(f"{point.name}: fp32 reference gradients on heads {heads}")
    try:
        do = backward_do(args[0], point.seed)
        with torch.enable_grad():
            ref = grad_reference(spec, args, do, heads)
    except Exception as exc:  # noqa: BLE001 - the timings stand without the check
        ref_error = f"{type(exc).__name__}: {exc}"
        do = backward_do(args[0], point.seed)
        free_memory(device)
    runners = {"fwd+bwd": _bwd_custom_op, "fwd (grad)": _fwd_for_grad,
               "reference fwd+bwd": _bwd_reference_step, "bwd kernels": _bwd_kernels,
               "inverse map": _bwd_inverse_map, "flex fwd+bwd": bwd_flex}
    rows = []
    for variant in plan.backward_variants:
        reporter.status(f"{point.name}: backward, {variant.label}")
        row = new_row(point, spec, env, variant.label, variant.kind, variant.backend)
        factor = BACKWARD_ROWS[variant.label][0]
        if factor is not None:
            row.set_flops(factor * sparse_flops[0], factor * sparse_flops[1])
        try:
            with torch.enable_grad():
                grads = runners[variant.label](spec, args, do, timer, row, device,
                                               loader=loader, flex=flex)
            if grads is not None:
                if ref is None:
                    row.fail(f"not scored: the fp32 reference gradients failed ({ref_error})")
                else:
                    set_grad_score(row, grads, ref, spec.layout, heads)
            del grads
        except Exception as exc:  # noqa: BLE001 - a failing row must not stop the bench
            row.fail(exc)
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                row.add_note("out of memory")
            free_memory(device)
        rows.append(row)
    del ref, do
    return rows


def _bwd_custom_op(spec: Spec, args: tuple, do: torch.Tensor, timer: Callable, row: Row,
                   device: str, **_: Any) -> tuple[torch.Tensor, ...] | None:
    """fwd+bwd: the custom op on requires_grad leaves, then torch.autograd.grad."""
    from tilegen.ops import _op_for, block_sparse_attention

    plain = Spec(head_dim=spec.head_dim, dtype=spec.dtype, layout=spec.layout)
    if plain.kernel_dict() != spec.kernel_dict():
        row.add_note("not run: block_sparse_attention runs the default kernel fields, not this "
                     "spec's (the bwd kernels row runs this spec's)")
        return None
    q, k, v = (t.detach().requires_grad_(True) for t in args[:3])
    idx, vbs = args[3], args[4]

    def step() -> tuple[torch.Tensor, ...]:
        o = block_sparse_attention(q, k, v, idx, vbs, layout=spec.layout, sm_scale=spec.sm_scale)
        return torch.autograd.grad(o, (q, k, v), do)

    grads = first_call(step, row, device)
    row.config = _op_for(args[0], spec.layout, "triton").backward_config.name
    row.ms_op = timer(step)
    return grads


def _fwd_for_grad(spec: Spec, args: tuple, do: torch.Tensor, timer: Callable, row: Row,
                  device: str, **_: Any) -> None:
    """fwd (grad): the custom op's forward on requires_grad leaves (timed, not scored: the
    fwd+bwd row scores the gradients it leads to)."""
    from tilegen.ops import _op_for, block_sparse_attention

    plain = Spec(head_dim=spec.head_dim, dtype=spec.dtype, layout=spec.layout)
    if plain.kernel_dict() != spec.kernel_dict():
        row.add_note("not run: block_sparse_attention runs the default kernel fields")
        return None
    q, k, v = (t.detach().requires_grad_(True) for t in args[:3])

    def step() -> torch.Tensor:
        return block_sparse_attention(q, k, v, args[3], args[4], layout=spec.layout,
                                      sm_scale=spec.sm_scale)

    first_call(step, row, device)
    fast = _op_for(args[0], spec.layout, "triton").grad_forward()
    row.backend = getattr(fast, "backend", "triton")
    row.config = fast.config.name if fast is not None else "triton forward_for_grad"
    row.ms_op = timer(step)
    return None


def _bwd_reference_step(spec: Spec, args: tuple, do: torch.Tensor, timer: Callable, row: Row,
                        device: str, *, loader: Callable, **_: Any
                        ) -> tuple[torch.Tensor, ...]:
    """reference fwd+bwd: the Triton family's forward and its default backward kernels (the
    training step before the Gluon backward), through the op's autograd."""
    from tilegen.backends.triton.backward import BackwardConfig

    op = loader(spec, backend="triton")
    op.grad_forward_family = "triton"
    op.backward_config = BackwardConfig().fit(spec)
    row.config = f"{op.config.name} + {op.backward_config.name}"
    q, k, v = (t.detach().requires_grad_(True) for t in args[:3])

    def step() -> tuple[torch.Tensor, ...]:
        o = op(q, k, v, args[3], args[4], return_lse=False)
        return torch.autograd.grad(o, (q, k, v), do)

    grads = first_call(step, row, device)
    row.ms_op = timer(step)
    return grads


def _bwd_kernels(spec: Spec, args: tuple, do: torch.Tensor, timer: Callable, row: Row,
                 device: str, *, loader: Callable, **_: Any) -> tuple[torch.Tensor, ...]:
    """bwd kernels: op.launch_backward with the maps prebuilt (the inverse map, and the packed
    tiles of a config that packs; o_acc, lse from forward_for_grad, outside the timing)."""
    from tilegen.backends.triton.backward import backward_maps

    op = loader(spec, backend="triton")
    row.backend = getattr(op, "backend", "triton")
    q, k, v, idx, vbs = args
    _, lse, o_acc = op.forward_for_grad(q, k, v, idx, vbs)
    cfg = op.backward_config
    inv = backward_maps(idx, None, vbs, vbs.shape[0], spec.block_kv, cfg)
    row.config = cfg.name
    bargs = (do, q, k, v, o_acc, lse, idx, vbs)

    def call() -> tuple[torch.Tensor, ...]:
        return op.launch_backward(*bargs, inverse=inv, config=cfg)

    grads = first_call(call, row, device)
    row.ms_op = timer(call)
    if hasattr(op, "check"):
        op.check()
    return grads


def _bwd_inverse_map(spec: Spec, args: tuple, do: torch.Tensor, timer: Callable, row: Row,
                     device: str, *, loader: Callable, **_: Any) -> None:
    """inverse map: the maps the op's backward config builds per call (`backward_maps`: the
    CSR map of query cubes per KV cube, and the dQ plan with ds_store), alone (timed, not
    scored)."""
    from tilegen.backends.triton.backward import backward_maps

    idx, vbs = args[3], args[4]
    cfg = loader(spec, backend="triton").backward_config

    def build() -> object:
        return backward_maps(idx, None, vbs, vbs.shape[0], spec.block_kv, cfg)

    row.config = (f"{cfg.name}: "
                  + ("device maps (maps.py: Triton keys, one stable sort, scatter)"
                     if idx.is_cuda else "torch: stable sort + bincount"))
    first_call(build, row, device)
    row.ms_op = timer(build)
    return None


