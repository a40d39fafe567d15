"""`tilegen doctor`: does tilegen work on this machine, as users call it? A pass/fail table in
seconds.

On a small synthesized workload with the spec's kernel fields (head dim, dtype, layout, blocks)
and an outlier head whose logits overflow a naive softmax, it checks:

- ``load``: which kernel family and config `tilegen.load(spec)` resolves here, and why;
- ``fp32 oracle``: the op's output against the fp32 reference on every head (finite, per-head
  cosine >= 0.9999, max|Δ| <= 3e-2; the contract's mean|Δ| bound is for its full-size rows);
- ``reference variant``: the op against the reference variant with the contract's scoring rule;
- ``custom op``: `tilegen.ops.block_sparse_attention` gives the op's output (default-spec
  kernels only: it serves the default spec of q's dtype and head dim);
- ``gradients``: dq, dk, dv through autograd against the fp32 autograd reference (the gradient
  rule: finite, per-head cosine >= 0.9999, max|Δ| <= 1e-2 max|ref|);
- ``no host sync``, ``CUDA graph`` (GPU only): a call under ``set_sync_debug_mode("error")``;
  capture in a CUDA graph, replay, same output;
- ``bad index``: on a GPU the row with an out-of-range index comes out NaN, the others stay
  finite, and ``op.check()`` raises ValueError; on the CPU the call raises before any work;
- ``timing`` (GPU only, informational): the op as called beside the bare kernel.

On a CPU the op runs its PyTorch path (or Triton's interpreter with ``TRITON_INTERPRET=1``);
the GPU-only checks are SKIP with that reason. Exit status: 0 when no check failed, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tilegen.spec import Spec

#: the doctor's workload: partial cubes on every axis (10 = 4 + 4 + 2, ...), a few heads
GPU_WORKLOAD = {"grid": (10, 14, 30), "num_heads": 4, "topk": 12, "batch": 1}
CPU_WORKLOAD = {"grid": (6, 7, 9), "num_heads": 2, "topk": 3, "batch": 1}


@dataclass
class Check:
    name: str
    status: str  # PASS, FAIL, SKIP or INFO
    detail: str


def doctor_spec(spec: Spec, device: str) -> Spec:
    """The spec's kernel fields at the doctor's small workload."""
    work = dict(GPU_WORKLOAD if device == "cuda" else CPU_WORKLOAD)
    if not spec.encoding_info.takes_lut:
        raise ValueError(f"tilegen doctor checks the lut encoding; the spec's is "
                         f"{spec.encoding!r} (its op runs the lut kernel: --spec of the lut spec)")
    return spec.replace(**work)


def _default_kernel(spec: Spec) -> bool:
    """block_sparse_attention serves the default spec of q's dtype and head dim."""
    return spec.kernel_hash == Spec(head_dim=spec.head_dim, dtype=spec.dtype).kernel_hash


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _run(name: str, fn: Callable[[], tuple[str, str]], checks: list[Check]) -> None:
    """One check; an exception is a FAIL naming it, and the next check still runs."""
    try:
        status, detail = fn()
    except Exception as exc:  # noqa: BLE001 - report and go on, as bench does
        status, detail = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        traceback.print_exc()
    checks.append(Check(name, status, detail))


def run_doctor(spec: Spec | None = None, *, device: str | None = None, seed: int = 0
               ) -> list[Check]:
    """Every check in order (see the module docstring)."""
    import tilegen
    from tilegen import captures
    from tilegen.bench import backward_do, grad_reference
    from tilegen.config import reference_config
    from tilegen.reference import attention_fp32

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device == "cuda"
    interpreted = not on_gpu and os.environ.get("TRITON_INTERPRET") == "1"
    spec = doctor_spec(spec or Spec(), device)
    checks: list[Check] = []
    if on_gpu:
        cap_ = torch.cuda.get_device_capability()
        env = f"{torch.cuda.get_device_name()} (sm_{cap_[0]}{cap_[1]})"
    else:
        path = "the PyTorch path"
        if interpreted:
            path = "Triton's interpreter"
            if spec.dtype == "bf16":  # seen with triton 3.6: its bf16 tl.dot multiplies raw bits
                path += " (whose bf16 dot is wrong: unset TRITON_INTERPRET for the PyTorch path)"
        env = f"no CUDA GPU: the CPU, {path}"
    import triton

    checks.append(Check("environment", "INFO", f"{env}; torch {torch.__version__}, triton "
                        f"{triton.__version__}"))
    checks.append(Check("workload", "INFO", (
        f"grid {spec.grid} ({spec.num_cubes} cubes, partial ones included), {spec.num_heads} "
        f"heads, topk {spec.topk}, D={spec.head_dim} {spec.dtype} {spec.layout}, seed {seed}, "
        "one outlier head")))
    cap = captures.synthesize_for(spec, seed, device)
    args = tuple(cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    state: dict = {}

    def load() -> tuple[str, str]:
        state["op"] = op = tilegen.load(spec)
        state["ref_op"] = tilegen.load(spec, reference_config(spec))
        return "PASS", repr(op)

    def oracle() -> tuple[str, str]:
        o = state["op"](*args, return_lse=False)
        _sync(device)
        state["o"] = o
        o32, _ = attention_fp32(*args, layout=spec.layout, block=spec.block_kv,
                                sm_scale=spec.sm_scale)
        s = captures.score(o, o32.to(o.dtype), layout=spec.layout)
        ok = s.finite and s.min_head_cos >= 0.9999 and s.max_abs <= 3e-2
        return ("PASS" if ok else "FAIL"), (f"finite={s.finite} min_head_cos="
                                             f"{s.min_head_cos:.6f} max|Δ|={s.max_abs:.2e}")

    def reference() -> tuple[str, str]:
        o_ref = state["ref_op"](*args, return_lse=False)
        s = captures.score(state["o"], o_ref, layout=spec.layout)
        note = "" if on_gpu or interpreted else " (on the CPU both run the same PyTorch path)"
        return ("PASS" if s.passed else "FAIL"), str(s) + note

    def custom_op() -> tuple[str, str]:
        from tilegen.ops import block_sparse_attention

        if not _default_kernel(spec):
            return "SKIP", "block_sparse_attention serves the default spec's kernel fields"
        o = block_sparse_attention(*args)
        same = bool(torch.equal(o, state["o"]))
        return ("PASS" if same else "FAIL"), f"same output as the op: {same}"

    def gradients() -> tuple[str, str]:
        from tilegen.ops import block_sparse_attention

        q, k, v = (t.detach().clone().requires_grad_(True) for t in args[:3])
        if _default_kernel(spec):
            o = block_sparse_attention(q, k, v, *args[3:])
        else:
            o = state["op"](q, k, v, *args[3:], return_lse=False)
        do = backward_do(args[0], seed)
        grads = torch.autograd.grad(o, (q, k, v), do)
        heads = list(range(spec.num_heads))
        ref = grad_reference(spec, args, do, heads)
        scores = [captures.grad_score(g, r, layout=spec.layout)
                  for g, r in zip(grads, ref, strict=True)]
        ok = all(s.passed for s in scores)
        return ("PASS" if ok else "FAIL"), "; ".join(
            f"{n}: {s}" for n, s in zip(("dq", "dk", "dv"), scores, strict=True))

    def no_host_sync() -> tuple[str, str]:
        if not on_gpu:
            return "SKIP", "GPU only"
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            state["op"](*args, return_lse=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return "PASS", "a call under torch.cuda.set_sync_debug_mode('error') raised nothing"

    def cuda_graph() -> tuple[str, str]:
        if not on_gpu:
            return "SKIP", "GPU only"
        static = [a.clone() for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            state["op"](*static, return_lse=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_graph = state["op"](*static, return_lse=False)
        graph.replay()
        torch.cuda.synchronize()
        same = bool(torch.equal(o_graph, state["o"]))
        return ("PASS" if same else "FAIL"), f"captured, replayed, same output: {same}"

    def bad_index() -> tuple[str, str]:
        bad = args[3].clone()
        h, row = spec.num_heads - 1, spec.num_cubes // 2
        bad[0, h, row, 0] = 10**6
        bad_args = (*args[:3], bad, args[4])
        op = state["op"]
        if not on_gpu:
            try:
                op(*bad_args, return_lse=False)
            except ValueError as exc:
                return "PASS", f"ValueError before any work: {str(exc).splitlines()[0][:120]}"
            return "FAIL", "an index of 10**6 was accepted"
        o = op(*bad_args, return_lse=False)
        torch.cuda.synchronize()
        rows = slice(row * spec.block_q, (row + 1) * spec.block_q)
        o_bshd = o if spec.layout == "bshd" else o.transpose(1, 2)
        row_nan = bool(o_bshd[0, rows, h].isnan().all())
        others = o_bshd.clone()
        others[0, rows, h] = 0
        others_finite = bool(torch.isfinite(others).all())
        try:
            op.check()
            raised = "nothing"
        except ValueError as exc:
            raised = f"ValueError ({str(exc).splitlines()[0][:80]})"
        ok = row_nan and others_finite and raised != "nothing"
        return ("PASS" if ok else "FAIL"), (f"bad row NaN: {row_nan}, other rows finite: "
                                             f"{others_finite}, op.check() raised {raised}")

    def timing() -> tuple[str, str]:
        if not on_gpu:
            return "SKIP", "GPU only"
        import triton.testing

        from tilegen.inputs import validate_inputs

        op = state["op"]
        shapes = validate_inputs(op.spec, *args)
        out = (torch.empty_like(args[0]), None)

        def bare() -> None:
            op.launch(*args, shapes=shapes, store_lse=False, out=out)

        def call() -> None:
            op(*args, return_lse=False)

        ms_bare = triton.testing.do_bench(bare, warmup=10, rep=50, return_mode="median")
        ms_op = triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")
        return "INFO", (f"op(...) {ms_op:.3f} ms, bare kernel {ms_bare:.3f} ms at this small "
                        "workload (tilegen bench times the full one)")

    for name, fn in (("load", load), ("fp32 oracle", oracle), ("reference variant", reference),
                     ("custom op", custom_op), ("gradients", gradients),
                     ("no host sync", no_host_sync), ("CUDA graph", cuda_graph),
                     ("bad index", bad_index), ("timing", timing)):
        if name != "load" and "op" not in state:
            checks.append(Check(name, "SKIP", "tilegen.load failed"))
            continue
        if name in ("reference variant", "custom op") and "o" not in state:
            checks.append(Check(name, "SKIP", "the op did not run"))
            continue
        _run(name, fn, checks)
    return checks


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':{width}}  result  detail"]
    lines += [f"{c.name:{width}}  {c.status:6}  {c.detail}" for c in checks]
    failed = [c.name for c in checks if c.status == "FAIL"]
    lines.append("tilegen doctor: " + (f"{len(failed)} check(s) failed: {', '.join(failed)}"
                                       if failed else "every check passed"))
    return "\n".join(lines)


def main(spec: Spec | None, json_path: str | None = None) -> int:
    t0 = time.perf_counter()
    checks = run_doctor(spec)
    print(format_checks(checks))
    print(f"({time.perf_counter() - t0:.1f} s)")
    if json_path:
        from tilegen.cache import atomic_write

        atomic_write(Path(json_path), json.dumps([asdict(c) for c in checks], indent=2) + "\n")
    return 1 if any(c.status == "FAIL" for c in checks) else 0
