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

Modules: `tilegen.tune.messages` (what the two sides send, the timers), `tilegen.tune.worker`
(the worker process), `tilegen.tune.failures` (the failure classes); this module is the
session's side (`WorkerHandle`) and re-exports the names callers use.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import Connection

from tilegen.db.policy import FAKE_NOTE
from tilegen.tune.failures import FAILURE_CLASSES, classify, poisons_context
from tilegen.tune.messages import (
    DEFAULT_OP_FACTORY,
    ORACLE_CHECKS,
    TIMERS,
    CaptureInfo,
    TrialRequest,
    TrialResult,
    WorkerInfo,
    WorkerSetup,
    WorkerSetupError,
    fake_deterministic_ms,
    is_fake_timer,
    ms_unit,
    result_to_dict,
)
from tilegen.tune.worker import worker_main

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


__all__ = [
    "DEFAULT_OP_FACTORY",
    "FAILURE_CLASSES",
    "FAKE_NOTE",
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
    "is_fake_timer",
    "ms_unit",
    "poisons_context",
    "result_to_dict",
    "worker_main",
]
