"""The worker side of a tuning trial: a spawned process that sets up once (captures, references,
the fp32 oracle check) and then builds, gates and times one config per request."""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from tilegen.tune.failures import classify, poisons_context
from tilegen.tune.messages import (
    ORACLE_CHECKS,
    TIMERS,
    CaptureInfo,
    TrialRequest,
    TrialResult,
    WorkerInfo,
    WorkerSetup,
    WorkerSetupError,
    fake_deterministic_ms,
)


def _driver_version() -> str:
    """The GPU driver version (NVML, else nvidia-smi / rocm-smi), or "" when unknown."""
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    import shutil
    import subprocess

    for cmd in (["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                ["rocm-smi", "--showdriverversion"]):
        if shutil.which(cmd[0]):
            with contextlib.suppress(Exception):
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
                lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
                if lines:
                    return lines[0].split(":")[-1].strip()
    return ""


def _resolve(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"op factory must be 'module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)


class _WorkerState:
    """Everything a worker keeps between trials (runs inside the worker process)."""

    def __init__(self, setup: WorkerSetup) -> None:
        t0 = time.perf_counter()
        import torch
        import triton

        from tilegen import bench, captures
        from tilegen.backends.triton.jit import interpreting
        from tilegen.spec import Spec
        from tilegen.targets import detect_target

        self.torch = torch
        self.spec = Spec.from_json(setup.spec_json)
        self.setup = setup
        if setup.timer not in TIMERS:
            raise WorkerSetupError(f"unknown timer {setup.timer!r}; known: {list(TIMERS)}")
        if setup.oracle_check not in ORACLE_CHECKS:
            raise WorkerSetupError(f"unknown oracle check {setup.oracle_check!r}; known: "
                                   f"{list(ORACLE_CHECKS)}")
        self.enforce_oracle = setup.oracle_check == "enforce" or (
            setup.oracle_check == "auto" and setup.timer == "do_bench")
        self.notes: list[str] = []
        if torch.cuda.is_available():
            self.device = "cuda"
            device_name = torch.cuda.get_device_name()
            target = detect_target()
            detected = target.name if target else None
        else:
            if not interpreting():
                raise WorkerSetupError(
                    "no GPU found; tuning on the CPU needs the Triton interpreter "
                    "(TRITON_INTERPRET=1) and --timer fake-deterministic (test only)")
            if setup.timer == "do_bench":
                raise WorkerSetupError(
                    "--timer do_bench times kernels with CUDA events and needs a GPU; under "
                    "the CPU interpreter use --timer fake-deterministic (test only)")
            self.device = "cpu"
            device_name = "cpu"
            detected = None
        self.factory = _resolve(setup.op_factory)
        from tilegen import backends

        self.gradients = backends.get(setup.backend).gradients
        if self.gradients and not self.spec.encoding_info.takes_lut:
            raise WorkerSetupError(
                f"tuning the backward kernels takes a LUT spec; encoding "
                f"{self.spec.encoding!r} reaches them through its own cursor and maps, which "
                "the gradient gate does not build (tune its forward instead)")
        self.caps: list[tuple[str, dict]] = []
        self.refs: list[Any] = []
        self.infos: list[CaptureInfo] = []
        for name, cap in self._captures(captures):
            ref, how, oracle = self._reference(name, cap)
            outlier = bool(cap.get("outlier_heads")) or "o_ref" in cap
            self.caps.append((name, cap))
            self.refs.append(ref)
            self.infos.append(CaptureInfo(name, bench.flops_of(cap, self.spec), outlier, how,
                                          oracle))
        if not any(i.outlier for i in self.infos):
            # The gate must see an overflow-prone head (contract: "including an outlier one").
            cap = captures.synthesize_for(self.spec, seed=0, device=self.device, outlier=True)
            ref, how, oracle = self._reference("synthetic_outlier_seed0", cap)
            self.caps.append(("synthetic_outlier_seed0", cap))
            self.refs.append(ref)
            self.infos.append(CaptureInfo("synthetic_outlier_seed0",
                                          bench.flops_of(cap, self.spec), True, how, oracle))
            self.notes.append("no capture of the set had an outlier head; added a synthetic "
                              "outlier capture (seed 0)")
        driver = _driver_version() if self.device == "cuda" else ""
        self.info = WorkerInfo(
            pid=os.getpid(), device_type=self.device, device_name=device_name,
            detected_target=detected, interpreter=interpreting(), driver=driver,
            torch=torch.__version__, triton=triton.__version__, captures=self.infos,
            setup_s=time.perf_counter() - t0, notes=self.notes)

    def _captures(self, captures: Any):
        """The capture set in the spec's dtype and layout (files on disk are BSHD)."""
        from pathlib import Path

        if self.setup.captures == "synthetic":
            for seed in self.setup.seeds:
                yield f"synthetic_seed{seed}", captures.synthesize_for(
                    self.spec, seed=seed, device=self.device, outlier=True)
            return
        paths = sorted(Path(self.setup.captures).glob("*.pt"))
        if not paths:
            raise WorkerSetupError(f"no capture .pt files in {self.setup.captures}")
        for path in paths:
            try:
                cap = captures.load(path, device=self.device)
            except ValueError as exc:  # a damaged capture: one clear line, no traceback
                raise WorkerSetupError(str(exc)) from exc
            yield path.name, captures.for_spec(cap, self.spec)

    def _grad_reference(self, name: str, cap: dict) -> tuple[Any, str, str]:
        """For a backward kernel set: (dO, the heads scored, fp32 reference (dq, dk, dv) on
        them), computed once per capture (see the module docstring)."""
        from tilegen import bench
        from tilegen.inputs import validate_inputs

        args = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"])
        try:
            validate_inputs(self.spec, *args)
        except (TypeError, ValueError) as exc:
            raise WorkerSetupError(f"capture {name} does not fit the spec: {exc}") from exc
        heads = bench.backward_heads(self.spec.num_heads, cap.get("outlier_heads") or ())
        do = bench.backward_do(cap["q"], cap.get("seed"))
        ref = bench.grad_reference(self.spec, args, do, heads)
        return (do, heads, ref), "fp32 autograd reference", f"heads {heads}"

    def _reference(self, name: str, cap: dict) -> tuple[Any, str, str]:
        """The output a candidate is scored against, computed once per capture, and its check
        against the fp32 oracle (`tilegen.reference.attention_fp32`).

        The gate is only as good as its reference: the reference variant's output must itself
        pass the scoring rule against the fp32 oracle on every capture, or the worker setup
        fails (loudly, naming the capture and the scores) and no trial runs. A bundled
        ground truth (``o_ref``) is the contract's reference; its oracle score is reported.
        """
        from tilegen import captures, encodings
        from tilegen.config import reference_config
        from tilegen.inputs import validate_inputs
        from tilegen.ops import BlockSparseAttention
        from tilegen.reference import attention_fp32

        if self.gradients:
            return self._grad_reference(name, cap)
        try:
            encodings.validate(self.spec, *encodings.call_args(self.spec, cap), check_values=True)
        except (TypeError, ValueError) as exc:
            raise WorkerSetupError(f"capture {name} does not fit the spec: {exc}") from exc
        if self.spec.quant != "none":
            return self._quant_reference(name, cap)
        # every encoding's yardstick is the LUT reference on the equivalent LUT (the capture's
        # own for lut and mask, the windows' for sliding_tile)
        idx, counts = encodings.reference_lut(self.spec, cap)
        args = (cap["q"], cap["k"], cap["v"], idx, cap["vbs"], counts)
        ref_spec = encodings.lut_spec(self.spec, idx.shape[-1])
        validate_inputs(ref_spec, *args)
        o32, _ = attention_fp32(*args, layout=self.spec.layout, block=self.spec.block_kv)
        oracle = o32.to(cap["q"].dtype)
        del o32
        if "o_ref" in cap:
            s = captures.score(cap["o_ref"], oracle, layout=self.spec.layout)
            if not s.passed:
                self.notes.append(f"bundled reference of {name} vs the fp32 oracle: {s}")
            return cap["o_ref"], "bundled", str(s)
        cfg = reference_config(ref_spec)
        try:
            if self.setup.reference_factory:
                ref_op = _resolve(self.setup.reference_factory)(ref_spec, cfg)
            else:
                # Built directly (not through load): the reference variant is the contract's
                # kernel, used as the yardstick even where its tiles exceed a target's
                # preference.
                ref_op = BlockSparseAttention(ref_spec, cfg, None, "reference")
            o, _ = ref_op(*args)
            self._sync()
        except Exception as exc:  # noqa: BLE001 - no reference: no gate
            raise WorkerSetupError(
                f"the gate's reference (reference variant {cfg.name}) failed on capture "
                f"{name}: {type(exc).__name__}: {str(exc)[:300]}") from exc
        s = captures.score(o, oracle, layout=self.spec.layout)
        if not s.passed:
            text = (f"the gate's reference (reference variant {cfg.name}) does not pass the "
                    f"fp32 oracle on capture {name}: {s}")
            if self.enforce_oracle:
                raise WorkerSetupError(
                    f"{text}; a gate against it would accept wrong kernels and reject right "
                    "ones, so no trial runs (fix the reference kernel first)")
            self.notes.append(f"{text} (--oracle-check report: not enforced)")
        return o, "reference variant", str(s)

    def _quant_reference(self, name: str, cap: dict) -> tuple[Any, str, str]:
        """An 8-bit spec's gate: the quantized rule (`tilegen.captures.quant_score`, check 4
        included) against the fp32 oracle and the recipe's emulation on the oracle's heads
        (`tilegen.quant.quant_reference`), computed once per capture."""
        from tilegen import bench, encodings, quant

        idx, counts = encodings.reference_lut(self.spec, cap)
        heads = bench.oracle_heads(self.spec.num_heads, cap.get("outlier_heads") or ())
        ref = quant.quant_reference(self.spec.quant, cap["q"], cap["k"], cap["v"], idx,
                                    cap["vbs"], counts, heads, sm_scale=self.spec.sm_scale,
                                    block=self.spec.block_kv)
        return ref, "fp32 oracle and tilegen.quant.emulate", f"heads {heads}"

    def _gate_gradients(self, op: Any, name: str, cap: dict, ref: Any
                        ) -> tuple[dict[str, Any], Callable[[], Any]]:
        """Score the op's dq, dk, dv on one capture (the gradient rule on the reference's heads)
        and return the row and the call to time (its backward as autograd runs it)."""
        from tilegen import captures

        do, heads, (rq, rk, rv) = ref
        args = (cap["q"], cap["k"], cap["v"])
        lut = (cap["topk_idx"], cap["vbs"])
        _o, lse, o_acc = op.forward_for_grad(*args, *lut)
        grads = op.backward(do, *args, o_acc, lse, *lut)
        self._sync()
        dim = 2 if self.spec.layout == "bshd" else 1
        sel = self.torch.tensor(heads, device=do.device)
        scores = [captures.grad_score(g.index_select(dim, sel), r, layout=self.spec.layout)
                  for g, r in zip(grads, (rq, rk, rv), strict=True)]
        del grads
        text = "; ".join(f"{n}: {s}" for n, s in zip(("dq", "dk", "dv"), scores, strict=True))
        row = {"capture": name, "passed": all(s.passed for s in scores),
               "finite": all(s.finite for s in scores),
               "min_head_cos": min(s.min_head_cos for s in scores),
               "max_abs": max(s.max_abs for s in scores), "mean_abs": None,
               "score": f"heads {heads}: {text}"}
        return row, lambda: op.backward(do, *args, o_acc, lse, *lut)

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def run_trial(self, req: TrialRequest) -> TrialResult:
        from tilegen import bench, captures, encodings
        from tilegen.config import KernelConfig

        t0 = time.perf_counter()
        cfg = KernelConfig.from_dict(req.config)
        res = TrialResult(req.number, cfg.name, "runtime_error", timer=self.setup.timer)
        try:
            op = self.factory(self.spec, cfg, backend=self.setup.backend)
            rows: list[dict[str, Any]] = []
            timed: list[Callable[[], Any]] = []
            for i, ((name, cap), ref) in enumerate(zip(self.caps, self.refs, strict=True)):
                tc = time.perf_counter()
                if self.gradients:
                    row, call = self._gate_gradients(op, name, cap, ref)
                    rows.append(row)
                    timed.append(call)
                    if i == 0:
                        res.compile_s = time.perf_counter() - tc
                    continue
                o, _ = op(*encodings.call_args(self.spec, cap))
                self._sync()
                if i == 0:
                    res.compile_s = time.perf_counter() - tc  # first call: JIT compile + run
                if self.spec.quant != "none":  # the quantized rule (`_quant_reference`)
                    qs = ref.score(o, p_exp=str(dict(cfg.options).get("p_exp", "ex2")))
                    del o
                    rows.append({"capture": name, "passed": qs.passed, "finite": qs.finite,
                                 "min_head_cos": qs.min_head_cos, "max_abs": None,
                                 "mean_abs": None, "score": str(qs)})
                    continue
                s = captures.score(o, ref, layout=self.spec.layout)
                del o
                rows.append({"capture": name, "passed": s.passed, "finite": s.finite,
                             "min_head_cos": s.min_head_cos, "max_abs": s.max_abs,
                             "mean_abs": s.mean_abs, "score": str(s)})
            res.captures = rows
            failed = [r for r in rows if not r["passed"]]
            if failed:
                res.status = "fail_correctness"
                res.error_class = "tilegen.captures.score"
                res.error_text = "; ".join(f"{r['capture']}: {r['score']}" for r in failed)
            else:
                total_ms = 0.0
                total_flops = 0.0
                for j, (row, (_name, cap), info) in enumerate(
                        zip(rows, self.caps, self.infos, strict=True)):
                    if self.setup.timer != "do_bench":
                        ms = fake_deterministic_ms(cfg.name)
                    elif self.gradients:
                        ms = bench.time_fn(timed[j])
                    else:
                        ms = bench.time_op(op, cap)
                    row["ms"] = ms
                    total_ms += ms
                    total_flops += (bench.backward_flops(info.flops) or 0.0
                                    if self.gradients else info.flops)
                res.status = "pass"
                res.median_ms = total_ms / len(rows)
                res.tflops = total_flops / total_ms / 1e9 if total_ms > 0 else None
        except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded class
            res.status, res.error_class, res.error_text = classify(exc)
            res.poisoned = poisons_context(res.status, res.error_text)
            if not res.poisoned and self.device == "cuda":
                with contextlib.suppress(Exception):
                    self.torch.cuda.empty_cache()
        res.wall_s = time.perf_counter() - t0
        return res


def _watch_parent(parent_pid: int) -> None:
    """Exit when the session process is gone (killed): an orphan must not hold the GPU."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def worker_main(conn: Connection, setup: WorkerSetup, parent_pid: int) -> None:
    """Entry point of a worker process: set up once, then serve trials until told to stop."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        state = _WorkerState(setup)
    except BaseException as exc:  # noqa: BLE001 - reported to the session, which stops
        text = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, WorkerSetupError):
            text += "\n" + "".join(traceback.format_exception(exc))[-4000:]
        with contextlib.suppress(Exception):
            conn.send(("setup_error", text))
        return
    conn.send(("ready", state.info))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        result = state.run_trial(msg)
        try:
            conn.send(("result", result))
        except (BrokenPipeError, OSError):
            return
        if result.poisoned:
            return  # the session respawns a worker with a fresh context
