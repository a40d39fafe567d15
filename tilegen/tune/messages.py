"""What the session and a tuning worker say to each other (setup, trial, result, info) and the
timers a trial can be timed with."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

from tilegen.db.policy import is_real_timer

#: Timers. "fake-deterministic" is TEST-ONLY: it derives a latency from the config's name, so
#: CPU tests (Triton interpreter) get stable rankings; the correctness gate still runs for real.
TIMERS: tuple[str, ...] = ("do_bench", "fake-deterministic")


def is_fake_timer(timer: str) -> bool:
    """True for a timer that measures nothing (the real ones: `tilegen.db.policy.REAL_TIMERS`)."""
    return not is_real_timer(timer)


def ms_unit(timer: str) -> str:
    """The unit a latency of `timer` is printed with: ``ms``, or ``fake-ms``."""
    return "fake-ms" if is_fake_timer(timer) else "ms"


DEFAULT_OP_FACTORY = "tilegen.ops:load_kernel_set"


#: What the worker setup does when the gate's reference fails the fp32 oracle on a capture:
#: "enforce" (the setup fails, no trial runs), "report" (a note, the session goes on), "auto"
#: (enforce with a real timer; report with the test-only timer, whose tiny CPU shapes have too
#: few keys per row for bf16 outputs to meet the contract's mean|Δ| <= 1e-4 against fp32).
ORACLE_CHECKS: tuple[str, ...] = ("auto", "enforce", "report")


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


def result_to_dict(result: TrialResult) -> dict[str, Any]:
    return dataclasses.asdict(result)


def fake_deterministic_ms(config_name: str) -> float:
    """TEST-ONLY timer: a latency in [1, 2) ms derived from the config name (sha256).

    Never use it to pick a winner for a real device; it exists so that CPU tests under the
    Triton interpreter get a stable ranking while the correctness gate still runs for real.
    """
    digest = hashlib.sha256(config_name.encode()).digest()
    return 1.0 + int.from_bytes(digest[:4], "big") / 2**32
