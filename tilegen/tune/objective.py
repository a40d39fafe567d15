"""One tuning trial, run in a worker process: build the op, gate it on every capture, time it.

Why a worker process: a kernel that faults (illegal address, device-side assert) leaves the CUDA
context unusable for the rest of its process, and a kernel that hangs never returns. So trials
run in a child started with multiprocessing's "spawn" method (fork is unsafe once CUDA is up),
and the session only talks to it through a pipe:

- the worker is **persistent**: it starts once (imports torch and Triton, synthesizes or loads
  the captures on its device, computes the reference outputs once per capture) and then serves
  many trials, because a spawn plus that setup costs seconds;
- a trial that exceeds its time limit gets the worker killed and is recorded as ``timeout``;
- a worker that dies (a segfault, a lost context) is recorded as a failed trial and respawned
  for the next one; after an error that poisons the CUDA context the worker answers, then exits
  on purpose so the next trial gets a fresh context;
- with several GPUs each worker is pinned to one through ``CUDA_VISIBLE_DEVICES``.

A trial (`TrialRequest` -> `TrialResult`):

1. the op is built with the config (``op_factory``, default `tilegen.ops.load`);
2. it runs on every capture of the set (an outlier one included) and each output is scored with
   `tilegen.captures.score` against the reference: the capture's bundled ``o_ref`` where there
   is one, else the reference variant's output (`tilegen.config.REFERENCE_CONFIG`), computed
   once per capture and kept in the worker. At setup that reference is itself scored against
   the fp32 oracle (`tilegen.reference.attention_fp32`); a reference that does not pass fails
   the setup, so the gate is never self-referential. One failing capture fails the trial
   (``fail_correctness``), so a wrong kernel can never win;
3. a passing op is timed on every capture with `tilegen.bench.time_op` (``triton.testing.
   do_bench``: warmed, kernel-only, median of CUDA-event timings); the objective is the mean of
   the per-capture medians.

A backward kernel set (``tilegen tune --backward``: a backend with ``gradients``, e.g.
``triton_bwd``) is gated and timed on its gradients instead: at setup the fp32 autograd
reference gradients (`tilegen.bench.grad_reference`: `tilegen.reference.attention_grads_fp32`
one head at a time) are computed once per capture on the outlier head(s), the first and the
last head (`tilegen.bench.backward_heads`), for a seeded dO (`tilegen.bench.backward_do`); a
trial runs the op's forward for gradients (fp32 O and lse) and its backward with the trial's
config, and each of dq, dk, dv must pass the gradient rule (`tilegen.captures.grad_score`) on
those heads of every capture. The time is that of ``op.launch_backward`` as the autograd
backward calls it (delta, the maps built from the LUT, and the kernels); FLOPs are the
backward's nominal 2.5x the forward's (`tilegen.bench.backward_flops`).

Exceptions are mapped to a failure class by `classify`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

#: Failure classes of a trial (the DB's trial statuses, less "pass" and "pruned").
FAILURE_CLASSES: tuple[str, ...] = (
    "compile_error",
    "out_of_resources",
    "fail_correctness",
    "timeout",
    "illegal_memory_access",
    "runtime_error",
)

#: Timers. "fake-deterministic" is TEST-ONLY: it derives a latency from the config's name, so
#: CPU tests (Triton interpreter) get stable rankings; the correctness gate still runs for real.
TIMERS: tuple[str, ...] = ("do_bench", "fake-deterministic")

DEFAULT_OP_FACTORY = "tilegen.ops:load"

#: What the worker setup does when the gate's reference fails the fp32 oracle on a capture:
#: "enforce" (the setup fails, no trial runs), "report" (a note, the session goes on), "auto"
#: (enforce with a real timer; report with the test-only timer, whose tiny CPU shapes have too
#: few keys per row for bf16 outputs to meet the contract's mean|Δ| <= 1e-4 against fp32).
ORACLE_CHECKS: tuple[str, ...] = ("auto", "enforce", "report")

# Substrings (lower case) of error messages, by class. Type checks come first (see classify).
# (Not bare "device-side assert": torch appends "to enable device-side assertions" to every
# CUDA error.)
_IMA_MARKERS = ("illegal memory access", "illegal address", "misaligned address",
                "unspecified launch failure", "device-side assert triggered",
                "memory access fault", "illegal instruction", "invalid address space",
                "global/shared address space", "hiperrorillegaladdress",
                "cudaerrorillegaladdress", "cudaerrorinvalidaddressspace")
_OOR_MARKERS = ("out of resource", "out of memory", "outofresources",
                "too many resources requested", "cudaerrorlaunchoutofresources")
_COMPILE_MARKERS = ("ptxas", "passmanager", "compilationerror", "mlir", "llvm error",
                    "failed to compile", "lld:", "hsaco")
# After one of these the CUDA/HIP context may be unusable: the worker restarts.
_CONTEXT_MARKERS = ("cuda error", "hip error", "triton error [cuda]", "triton error [hip]",
                    "acceleratorerror", "cublas_status", "cudnn_status")
_MAX_TEXT = 8000


# ============================================================================ messages


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker needs once: the spec, the capture set, the timer and the op factory.

    ``captures`` is "synthetic" (seeds ``seeds``, each with an outlier head, at the spec's
    workload shape) or a directory of capture ``.pt`` files. ``op_factory`` is
    ``"module:function"`` taking ``(spec, config)`` and returning an op with ``__call__`` and
    ``launch`` like `tilegen.ops.BlockSparseAttention` (tests inject faulty ops through it);
    ``reference_factory`` likewise builds the reference op (tests inject a wrong one, which the
    setup's fp32-oracle check must refuse).
    """

    spec_json: str
    captures: str = "synthetic"
    seeds: tuple[int, ...] = (0, 1)
    timer: str = "do_bench"
    op_factory: str = DEFAULT_OP_FACTORY
    reference_factory: str = ""  # test hook: "module:function" building the reference op
    oracle_check: str = "auto"  # "enforce" | "report" | "auto" (see ORACLE_CHECKS)
    backend: str = "triton"  # the kernel family the op factory builds


@dataclass
class CaptureInfo:
    name: str
    flops: float
    outlier: bool
    reference: str  # "bundled" | "reference variant"
    oracle: str = ""  # the reference's score against the fp32 oracle (it passed)


@dataclass
class WorkerInfo:
    """What a worker reports once it is ready."""

    pid: int
    device_type: str  # "cuda" | "cpu"
    device_name: str
    detected_target: str | None
    interpreter: bool
    driver: str
    torch: str
    triton: str
    captures: list[CaptureInfo]
    setup_s: float
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TrialRequest:
    number: int
    config: dict[str, Any]


@dataclass
class TrialResult:
    """The outcome of one trial. ``status`` is "pass" or one of `FAILURE_CLASSES`."""

    number: int
    config_name: str
    status: str
    median_ms: float | None = None
    tflops: float | None = None
    captures: list[dict[str, Any]] = field(default_factory=list)
    error_class: str | None = None
    error_text: str | None = None
    compile_s: float | None = None
    wall_s: float = 0.0
    poisoned: bool = False
    timer: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "pass"


class WorkerSetupError(RuntimeError):
    """The worker could not start (bad captures, no device, reference failed): fatal."""


# ============================================================================ classification


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 16:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _qualname(exc: BaseException) -> str:
    t = type(exc)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _clip(text: str, limit: int = _MAX_TEXT) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - limit} characters cut] ...\n{text[-half:]}"


def classify(exc: BaseException) -> tuple[str, str, str]:
    """Map an exception raised by a trial to ``(failure class, exception type, message)``.

    Types first, then messages (CUDA errors reach Python as RuntimeError/AcceleratorError with
    the driver's text):

    - ``timeout``: TimeoutError;
    - ``out_of_resources``: Triton's OutOfResources (shared memory / registers over the
      limit), torch.OutOfMemoryError, or such a message;
    - ``illegal_memory_access``: an illegal/misaligned address, a launch failure, a
      device-side assert (the context is lost with it);
    - ``compile_error``: Triton's CompilationError / CompileTimeAssertionFailure / PTXASError,
      the interpreter's InterpreterError around a semantic error (a ValueError such as
      "arange's range must be a power of 2"), or an MLIR/LLVM/ptxas failure message;
    - ``runtime_error``: anything else.
    """
    chain = _chain(exc)
    names = {type(e).__name__ for e in chain}
    text = "\n".join(f"{_qualname(e)}: {e}" for e in chain)
    low = text.lower()
    message = _clip(text + "\n\n" + "".join(traceback.format_exception(exc))[-4000:])
    kind = _qualname(exc)
    if any(isinstance(e, TimeoutError) for e in chain):
        return "timeout", kind, message
    if names & {"OutOfResources", "OutOfMemoryError"}:
        return "out_of_resources", kind, message
    if any(m in low for m in _IMA_MARKERS):
        return "illegal_memory_access", kind, message
    if names & {"CompilationError", "CompileTimeAssertionFailure", "PTXASError"}:
        return "compile_error", kind, message
    if "InterpreterError" in names and any(
            isinstance(e, ValueError | TypeError | AssertionError | NotImplementedError)
            for e in chain):
        return "compile_error", kind, message
    if any(m in low for m in _OOR_MARKERS):
        return "out_of_resources", kind, message
    if any(m in low for m in _COMPILE_MARKERS):
        return "compile_error", kind, message
    return "runtime_error", kind, message


def poisons_context(status: str, text: str | None) -> bool:
    """True when the worker's CUDA/HIP context may be unusable after this failure."""
    low = (text or "").lower()
    return status == "illegal_memory_access" or any(m in low for m in _CONTEXT_MARKERS)


# ============================================================================ timers


def fake_deterministic_ms(config_name: str) -> float:
    """TEST-ONLY timer: a latency in [1, 2) ms derived from the config name (sha256).

    Never use it to pick a winner for a real device; it exists so that CPU tests under the
    Triton interpreter get a stable ranking while the correctness gate still runs for real.
    """
    digest = hashlib.sha256(config_name.encode()).digest()
    return 1.0 + int.from_bytes(digest[:4], "big") / 2**32


# ============================================================================ the worker side


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
        if self.gradients and self.spec.encoding != "lut":
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


# ============================================================================ the session side

_spawn_lock = threading.Lock()


def _signal_name(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class WorkerHandle:
    """The session's end of one persistent worker (one per GPU).

    `run` sends a trial and waits up to ``timeout_s``; on a timeout the worker is killed, on a
    crash it is reaped, and either way the next `run` starts a fresh one. Not thread-safe: use
    one handle per thread.
    """

    def __init__(self, setup: WorkerSetup, *, gpu: str | None = None,
                 setup_timeout_s: float = 900.0, label: str = "worker") -> None:
        self.setup = setup
        self.gpu = gpu
        self.setup_timeout_s = setup_timeout_s
        self.label = label
        self.info: WorkerInfo | None = None
        self.spawns = 0
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> WorkerInfo:
        """Spawn the worker and wait until it is set up; raise WorkerSetupError if it fails."""
        self._reap()
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=worker_main, args=(child_conn, self.setup, os.getpid()),
                           name=f"tilegen-tune-{self.label}", daemon=True)
        # The child copies os.environ at spawn: pin it to its GPU for exactly that moment.
        with _spawn_lock:
            old = os.environ.get("CUDA_VISIBLE_DEVICES")
            if self.gpu is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = self.gpu
            try:
                proc.start()
            finally:
                if self.gpu is not None:
                    if old is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = old
        child_conn.close()
        self._proc, self._conn = proc, parent_conn
        self.spawns += 1
        if not parent_conn.poll(self.setup_timeout_s):
            self._kill()
            raise WorkerSetupError(f"{self.label} did not finish its setup within "
                                   f"{self.setup_timeout_s:.0f} s")
        try:
            kind, payload = parent_conn.recv()
        except (EOFError, OSError):
            proc.join(5)
            code = proc.exitcode
            self._reap()
            raise WorkerSetupError(f"{self.label} died during setup ({_signal_name(code)})"
                                   ) from None
        if kind != "ready":
            self._reap()
            raise WorkerSetupError(f"{self.label} setup failed: {payload}")
        self.info = payload
        return payload

    def run(self, request: TrialRequest, config_name: str, timeout_s: float) -> TrialResult:
        """Run one trial; never raises for a trial's failure (only for a failed setup)."""
        if not self.alive:
            self.start()
        assert self._conn is not None and self._proc is not None
        t0 = time.perf_counter()
        try:
            self._conn.send(request)
        except (BrokenPipeError, OSError):
            self._reap()
            self.start()
            assert self._conn is not None
            self._conn.send(request)
        if not self._conn.poll(timeout_s):
            self._kill()
            return TrialResult(
                request.number, config_name, "timeout", error_class="TimeoutError",
                error_text=f"trial exceeded {timeout_s:g} s (compile + gate + timing); "
                           "worker killed", wall_s=time.perf_counter() - t0)
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            code = self._proc.exitcode
            self._reap()
            return TrialResult(
                request.number, config_name, "runtime_error", error_class="WorkerDied",
                error_text=f"worker process died during the trial ({_signal_name(code)}); "
                           "respawning", wall_s=time.perf_counter() - t0)
        assert kind == "result"
        result: TrialResult = payload
        if result.poisoned:
            self._proc.join(10)
            self._reap()
        return result

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._reap()

    def _reap(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(10)
        self._proc, self._conn = None, None

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not."""
        if self._conn is not None and self.alive:
            with contextlib.suppress(Exception):
                self._conn.send(None)
            assert self._proc is not None
            self._proc.join(10)
        self._kill()


def result_to_dict(result: TrialResult) -> dict[str, Any]:
    return dataclasses.asdict(result)


__all__ = [
    "DEFAULT_OP_FACTORY",
    "FAILURE_CLASSES",
    "ORACLE_CHECKS",
    "TIMERS",
    "CaptureInfo",
    "TrialRequest",
    "TrialResult",
    "WorkerHandle",
    "WorkerInfo",
    "WorkerSetup",
    "WorkerSetupError",
    "classify",
    "fake_deterministic_ms",
    "poisons_context",
    "worker_main",
]
