"""The bench loop: every variant of the plan on every capture, then the table and files;
the timers the tuner shares."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from tilegen import captures
from tilegen.bench.backward import run_backward
from tilegen.bench.peers import FlexPeer, run_dense, run_flex
from tilegen.bench.plan import (
    BACKWARD_FLOPS_FORMULA,
    DENSE_PEERS,
    FLOPS_FORMULA,
    NO_GPU_MESSAGE,
    Plan,
    Variant,
    dense_flops,
    real_key_flops,
    slot_flops,
)
from tilegen.bench.plot import plot
from tilegen.bench.points import (
    Point,
    do_bench_timer,
    free_memory,
    heads_of,
    iter_points,
    new_row,
    oracle_heads,
    synchronize,
    to_bhsd,
)
from tilegen.bench.report import (
    Reporter,
    Row,
    environment,
    fill_speedups,
    print_table,
    results_json,
    verdict,
    write_json,
)
from tilegen.config import reference_config
from tilegen.encodings import call_args, lut_spec, reference_lut, validate
from tilegen.spec import Spec


def steps_per_point(plan: Plan) -> int:
    """Progress units per capture: the capture, each variant, the fp32 check, each backward
    row."""
    return len(plan.variants) + 2 + len(plan.backward_variants)


def run_points(plan: Plan, *, device: str = "cuda", timer: Callable | None = None,
               loader: Callable | None = None, flex: FlexPeer | None = None,
               reporter: Reporter | None = None, env: dict[str, str] | None = None) -> list[Row]:
    """Run every variant of `plan` on every capture and return the rows (no table, no files).

    `timer(fn) -> ms` defaults to do_bench with the plan's warmup and rep; `loader` to
    `tilegen.load`; both are parameters so that tests run the loop on the CPU."""
    from tilegen.ops import load

    timer = timer or do_bench_timer(plan.warmup_ms, plan.rep_ms)
    loader = loader or load
    flex = flex or FlexPeer(compile=device.startswith("cuda"))
    env = env or environment()
    points = iter_points(plan)
    reporter = reporter or Reporter(len(points) * steps_per_point(plan), plain=True)
    rows: list[Row] = []
    with torch.no_grad():
        for point in points:
            rows += _run_point(plan, point, device, timer, loader, flex, reporter, env)
            free_memory(device)
    fill_speedups(rows)
    return rows


def _run_point(plan: Plan, point: Point, device: str, timer: Callable, loader: Callable,
               flex: FlexPeer, reporter: Reporter, env: dict[str, str]) -> list[Row]:
    rows: list[Row] = []

    def finish(row: Row) -> None:
        row.update_rates()
        rows.append(row)
        reporter.step(_summary(row))
        if row.error:
            reporter.log(f"  ! {row.capture} {row.variant}: {row.error[:400]}")
        elif row.note and "failed" in row.note:
            reporter.log(f"  ! {row.capture} {row.variant}: {row.note[:400]}")

    reporter.status(f"{point.name}: loading capture")
    t0 = time.perf_counter()
    try:
        cap, spec = point.load(device)
        synchronize(device)
    except Exception as exc:  # noqa: BLE001 - one bad capture must not stop the bench
        reporter.step(f"{point.name}: capture failed: {type(exc).__name__}: {exc}")
        for v in plan.variants:
            row = new_row(point, point.spec, env, v.label, v.kind, v.backend)
            row.fail(f"capture: {type(exc).__name__}: {exc}")
            finish(row)
        row = new_row(point, point.spec, env, "reference-vs-fp32", "oracle", "fp32")
        row.fail(f"capture: {type(exc).__name__}: {exc}")
        finish(row)
        for v in plan.backward_variants:
            row = new_row(point, point.spec, env, v.label, v.kind, v.backend)
            row.fail(f"capture: {type(exc).__name__}: {exc}")
            finish(row)
        free_memory(device)
        return rows
    reporter.step(f"{point.name}: capture ready in {time.perf_counter() - t0:.1f}s "
                  f"(TOPK {spec.topk}, outlier heads {cap.get('outlier_heads', [])})")
    layout = spec.layout
    args = call_args(spec, cap)
    idx, counts = reference_lut(spec, cap)  # the pattern as a LUT: lut row, flex, oracle
    lut_args = (cap["q"], cap["k"], cap["v"], idx, cap["vbs"], counts)
    sparse_flops = (real_key_flops(idx, cap["vbs"], spec.block_q, spec.head_dim, counts),
                    slot_flops(idx, spec.block_q, spec.block_kv, spec.head_dim, counts))
    all_flops = dense_flops(spec.batch, spec.num_heads, spec.seq_len, spec.head_dim, cap["vbs"])
    o_ref = cap.get("o_ref")
    against = "bundled o_ref" if o_ref is not None else "reference variant"
    peer_inputs: tuple[torch.Tensor, ...] | None = None

    for variant in plan.variants:
        reporter.status(f"{point.name}: {variant.label}")
        row = new_row(point, spec, env, variant.label, variant.kind, variant.backend)
        row.set_flops(*(all_flops if variant.label in DENSE_PEERS else sparse_flops))
        oracle: Row | None = None
        try:
            if variant.kind == "tilegen":
                if variant.label == "lut":
                    out, _ = _run_tilegen(plan, variant, lut_spec(spec, idx.shape[-1]),
                                          lut_args, loader, timer, row, device)
                elif variant.label.startswith("quant-"):
                    mode = variant.label.removeprefix("quant-")
                    out, op = _run_tilegen(plan, variant, spec.replace(quant=mode), args,
                                           loader, timer, row, device)
                    from tilegen.quant import p_exp_of

                    _quant_score(spec, cap, lut_args, out, mode, row, p_exp_of(op))
                    del out
                    finish(row)
                    continue
                else:
                    out, _ = _run_tilegen(plan, variant, spec, args, loader, timer, row,
                                          device)
                if variant.label == "reference":
                    if o_ref is None:
                        o_ref = out
                        row.set_score(captures.score(out, out, layout=layout),
                                      "itself (it is the reference)")
                    else:
                        row.set_score(captures.score(out, o_ref, layout=layout), against)
                    oracle = _oracle_row(spec, cap, lut_args, out,
                                         new_row(point, spec, env, "reference-vs-fp32",
                                                  "oracle", "fp32"))
                elif o_ref is None:
                    row.fail("no reference output to score against (the reference variant "
                             "failed)")
                else:
                    row.set_score(captures.score(out, o_ref, layout=layout), against)
                del out
            else:
                if peer_inputs is None:
                    peer_inputs = tuple(to_bhsd(t, layout) for t in args[:3])
                if variant.backend == "flex":
                    run_flex(spec, idx, cap["vbs"], peer_inputs, flex, timer, row, o_ref,
                              against, device)
                else:
                    run_dense(spec, variant, peer_inputs, timer, row, device)
        except Exception as exc:  # noqa: BLE001 - a failing variant must not stop the bench
            row.fail(exc)
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                row.add_note("out of memory")
            free_memory(device)
        finish(row)
        if variant.label == "reference":
            if oracle is None:
                oracle = new_row(point, spec, env, "reference-vs-fp32", "oracle", "fp32")
                oracle.fail("not run: the reference variant failed")
            finish(oracle)
    if plan.backward_variants:
        del peer_inputs
        free_memory(device)
        for row in run_backward(plan, point, spec, cap, args, sparse_flops, device, timer,
                                 loader, flex, reporter, env):
            finish(row)
        del cap, args, o_ref
        return rows
    del cap, args, o_ref, peer_inputs
    return rows


def _summary(r: Row) -> str:
    ms = f"{r.ms_op:.3f} ms" if r.ms_op is not None else "-"
    bare = f", bare {r.ms_bare:.3f} ms" if r.ms_bare is not None else ""
    custom = f", custom op {r.ms_custom_op:.3f} ms" if r.ms_custom_op is not None else ""
    return f"{r.capture} {r.variant} [{r.config}]: {ms}{custom}{bare} -> {verdict(r)}"


def _run_tilegen(plan: Plan, variant: Variant, spec: Spec, args: tuple, loader: Callable,
                 timer: Callable, row: Row, device: str) -> tuple[torch.Tensor, Any]:
    """Load, run once (scored by the caller), then time the op, the custom op and the bare
    launch. Returns the op's output and the op."""
    if variant.label == "reference":
        op = loader(spec, reference_config(spec))
    elif variant.label in ("default", "config", "lut"):
        op = loader(spec, plan.config)
    elif variant.label.startswith("quant-"):
        op = loader(spec)  # the 8-bit spec's own family and config
    else:
        op = loader(spec, backend=variant.backend)
    row.backend = getattr(op, "backend", variant.backend)
    row.config_source = getattr(op, "config_source", None)
    t0 = time.perf_counter()
    o = op(*args, return_lse=False)
    synchronize(device)
    row.first_call_s = time.perf_counter() - t0
    row.config = _config_name(op, args[0].device)
    # the call as users make it, then the bare kernel
    row.ms_op = timer(lambda: op(*args, return_lse=False))
    if variant.label in ("default", "config"):
        _time_custom_op(spec, args, timer, row)
    try:
        shapes = validate(op.spec if hasattr(op, "spec") else spec, *args)
        q = args[0]
        out = (torch.empty_like(q), torch.empty((shapes.batch, shapes.heads, shapes.seq_len),
                                                dtype=torch.float32, device=q.device))
        row.ms_bare = timer(lambda: op.launch(*args, shapes=shapes, out=out, store_lse=False))
    except Exception as exc:  # noqa: BLE001 - the op's timing stands without the bare one
        row.add_note(f"bare launch failed: {type(exc).__name__}: {exc}")
    if hasattr(op, "check"):
        op.check()  # a bad value met on the device (none expected) raises here
    return o, op


def _config_name(op: Any, device: torch.device) -> str:
    """The op's config name (the CUDA op resolves its config per device, at the first call)."""
    cfg = getattr(op, "config", None) or getattr(op, "_config", None)
    if cfg is None and hasattr(op, "kernel"):
        try:
            cfg = op.kernel(device, False)[1]
        except Exception:  # noqa: BLE001
            cfg = None
    return cfg.name if cfg is not None else "target default"


def _time_custom_op(spec: Spec, args: tuple, timer: Callable, row: Row) -> None:
    """block_sparse_attention(...) (the torch.library op users call), when its kernel is this
    spec's: it builds the default spec for q's dtype, head dim and layout."""
    from tilegen.ops import _op_for, block_sparse_attention

    plain = Spec(head_dim=spec.head_dim, dtype=spec.dtype, layout=spec.layout)
    if not spec.encoding_info.takes_lut:
        row.add_note(f"block_sparse_attention not timed: it takes a LUT, not encoding "
                     f"{spec.encoding!r}")
        return
    if plain.kernel_dict() != spec.kernel_dict():
        row.add_note("block_sparse_attention not timed: it runs the default kernel fields, "
                     "not this spec's")
        return
    try:
        q = args[0]
        custom_cfg = _op_for(q, spec.layout).config.name
        block_sparse_attention(*args, layout=spec.layout)  # first call outside the timing
        row.ms_custom_op = timer(lambda: block_sparse_attention(*args, layout=spec.layout))
        if custom_cfg != row.config:
            row.add_note(f"block_sparse_attention ran config {custom_cfg}")
    except Exception as exc:  # noqa: BLE001
        row.add_note(f"block_sparse_attention failed: {type(exc).__name__}: {exc}")


def _quant_score(spec: Spec, cap: dict, args: tuple, o_variant: torch.Tensor, mode: str,
                 row: Row, p_exp: str = "ex2") -> None:
    """An 8-bit row against the fp32 oracle and the recipe's emulation (check 4) on the
    oracle's subset of heads (`tilegen.quant.quant_reference`), padded query rows left out."""
    from tilegen import quant

    if spec.layout != "bshd":
        raise ValueError("the 8-bit rows score BSHD tensors (the 8-bit kernel's layout)")
    heads = oracle_heads(spec.num_heads, cap.get("outlier_heads") or ())
    row.heads_checked = heads
    counts = args[5] if len(args) > 5 else None
    ref = quant.quant_reference(mode, *args[:5], counts, heads, sm_scale=spec.sm_scale,
                                block=spec.block_kv)
    row.set_quant_score(ref.score(o_variant, p_exp),
                        f"fp32 oracle and tilegen.quant.emulate, heads {heads}")


def _oracle_row(spec: Spec, cap: dict, args: tuple, o_variant: torch.Tensor, row: Row) -> Row:
    """The reference variant against the fp32 oracle on a subset of heads (outlier included);
    the oracle's output is rounded to the op's dtype first, as the kernel's output is."""
    from tilegen.reference import attention_fp32

    heads = oracle_heads(spec.num_heads, cap.get("outlier_heads") or ())
    row.config = "tilegen.reference.attention_fp32"
    row.heads_checked = heads
    try:
        layout = spec.layout
        q, k, v = (heads_of(t, layout, heads).contiguous() for t in args[:3])
        idx = args[3][:, heads].contiguous()
        vbs = args[4] if spec.variable_block_sizes else None
        counts = args[5][:, heads].contiguous() if len(args) > 5 and args[5] is not None else None
        o32, _ = attention_fp32(q, k, v, idx, vbs, counts, layout=layout, block=spec.block_kv)
        s = captures.score(heads_of(o_variant, layout, heads), o32.to(q.dtype), layout=layout)
        row.set_score(s, f"fp32 oracle, heads {heads}")
        del q, k, v, idx, o32
    except Exception as exc:  # noqa: BLE001
        row.fail(exc)
    return row


def run_bench(plan: Plan, *, command: str | None = None, device: str = "cuda",
              timer: Callable | None = None, file=None) -> int:
    """The `tilegen bench` command: run, print the table, write the JSON and the plot. Exit
    status: 0 when every tilegen row passed, 1 otherwise, 2 with no CUDA GPU. (`device` and
    `timer` other than the defaults are for tests: they run the command on the CPU.)"""
    file = file or sys.stdout
    if device == "cuda" and not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    if device.startswith("cuda"):
        plan.resolve_quant()
    env = environment()
    print(f"tilegen bench on {env['device']}: torch {env['torch']}, triton {env['triton']}, "
          f"tilegen {env['tilegen']}", file=file, flush=True)
    print(plan.describe(), file=file, flush=True)
    points = iter_points(plan)
    t0 = time.perf_counter()
    with Reporter(len(points) * steps_per_point(plan), file=file) as reporter:
        rows = run_points(plan, device=device, timer=timer, reporter=reporter, env=env)
    print(f"\nbench finished in {time.perf_counter() - t0:.0f}s", file=file, flush=True)
    print_table(rows, file=file)
    print(FLOPS_FORMULA, file=file)
    if plan.backward:
        print(BACKWARD_FLOPS_FORMULA, file=file)
    doc = results_json(plan, rows, env, command)
    print(f"json: wrote {write_json(plan.json_path, doc)}", file=file)
    s = plan.spec
    print(plot(rows, plan.plot_path,
               title=f"tilegen bench, {env['device']}: grid {s.grid}, {s.num_heads} heads, "
                     f"D={s.head_dim}, {s.dtype}; {env['date']}"), file=file)
    bad = [r for r in rows if not r.ok]
    if bad:
        print(f"{len(bad)} tilegen row(s) failed or errored: "
              + ", ".join(sorted({f"{r.variant} (TOPK {r.topk})" for r in bad})), file=file)
        return 1
    return 0


# ============================================================================ kept for tune


def time_op(op: Any, cap: dict, *, store_lse: bool = True, warmup: int = 100,
            rep: int = 500) -> float:
    """Median ms of the bare launch (inputs validated once, outputs preallocated), as
    `tilegen.tune` times trials."""
    args = call_args(op.spec, cap)
    shapes = validate(op.spec, *args)
    out = (torch.empty_like(cap["q"]),
           torch.empty(shapes.batch, shapes.heads, shapes.seq_len, dtype=torch.float32,
                       device=cap["q"].device))
    timer = do_bench_timer(warmup, rep)
    return timer(lambda: op.launch(*args, shapes=shapes, out=out, store_lse=store_lse))


def time_fn(fn: Callable[[], Any], *, warmup: int = 100, rep: int = 500) -> float:
    """Median ms of `fn` (`do_bench`, warmed), as `tilegen.tune` times a backward trial."""
    return do_bench_timer(warmup, rep)(fn)
