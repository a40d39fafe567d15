"""A tuning session: an Optuna study over the search space, trials run by persistent workers.

Flow (`run_session`):

1. start one worker per GPU (`objective.WorkerHandle`); each sets up its captures and
   reference outputs once and reports the device;
2. build the space (`space.SearchSpace`) for the device's target, open the Optuna study in RDB
   storage (SQLite next to the tilegen DB by default, or ``--storage URL``) with
   ``load_if_exists=True``;
3. resume: trials left RUNNING by a killed session are marked FAIL ("interrupted") and their
   configs are queued again; only trials with a result count (COMPLETE, PRUNED, FAIL with a
   failure class), and only the remainder up to ``--trials`` runs, so a re-run of the same
   command neither loses nor duplicates trials;
4. seed: the target default, the reference variant and any known winner are enqueued first;
   when the whole space fits in the trial budget every point is enqueued (exhaustive search),
   otherwise Optuna's TPE sampler proposes the rest;
5. each trial: infeasible configs are pruned before compiling (`tilegen.config.violations`,
   reasons recorded); a config already measured in this study is answered from that result
   (no GPU time); everything else runs in a worker (compile, correctness gate on every capture,
   timing). Every trial is recorded in the tilegen DB (`record_trial`) and told to Optuna
   (failures as FAIL, with class and message in the trial's user attributes);
6. the best passing trial becomes the winner in the tilegen DB (`set_winner`, keyed by spec
   hash, device name, arch, template-set hash and toolchain key); a table of the top configs
   is printed, and optionally an export (merged into the file when it already holds one), a
   summary JSON and a plot are written.

Scaling out: with ``--workers N`` one session drives N local GPUs (one worker each, pinned
with ``CUDA_VISIBLE_DEVICES``) over one study. Several hosts share a study through
``--storage postgresql://...`` and the same ``--study`` name: each host runs the same command,
and trials are counted study-wide (hosts racing for the last trials can overshoot ``--trials``
by at most one per extra worker).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from tilegen.backends.triton.render import render_triton
from tilegen.config import KernelConfig
from tilegen.spec import Spec
from tilegen.targets import Target, get_target
from tilegen.tune.objective import (
    DEFAULT_OP_FACTORY,
    FAILURE_CLASSES,
    TIMERS,
    TrialRequest,
    TrialResult,
    WorkerHandle,
    WorkerInfo,
    WorkerSetup,
    WorkerSetupError,
)
from tilegen.tune.space import SearchSpace, Value, seed_configs

SAMPLERS = ("auto", "tpe", "random", "grid")
OPTUNA_FILENAME = "optuna.sqlite"
INTERRUPTED = "interrupted"
# user attr set once a trial owns its config (see Session._claimed_elsewhere)
CLAIMED = "claimed"
# A RUNNING trial without our attributes is a session killed between ask() and tagging it.
_UNTAGGED_GRACE_S = 30.0


def _open_storage(optuna: Any, url: str, kwargs: dict[str, Any]) -> Any:
    """Optuna's RDB storage. Hosts that start on a fresh database at the same moment race to
    create its tables (PostgreSQL then raises a unique violation on its catalog); the loser
    retries and finds the tables made."""
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(url, **kwargs)
        except (IntegrityError, ProgrammingError):
            if attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1) + random.random() * 0.5)
    raise AssertionError("unreachable")


class SessionError(RuntimeError):
    """The session cannot run (no device, bad options, a worker that cannot start)."""


@dataclass
class TuneOptions:
    """Everything `run_session` needs; the CLI flags map one to one (see tilegen.tune.cli)."""

    spec: Spec = field(default_factory=Spec)
    target: str | None = None  # default: the worker's device
    captures: str = "synthetic"
    seeds: int = 2
    trials: int = 40
    storage: str | None = None
    study: str | None = None
    workers: int = 1
    timeout_s: float = 240.0
    setup_timeout_s: float = 900.0
    timer: str = "do_bench"
    db_path: str | None = None
    sampler: str = "auto"
    sampler_seed: int = 0
    space: dict[str, tuple[Value, ...]] = field(default_factory=dict)
    export: str | None = None
    summary: str | None = None
    plot: str | None = None
    top: int = 10
    op_factory: str = DEFAULT_OP_FACTORY
    progress: IO[str] | None = None  # default: sys.stderr
    out: IO[str] | None = None  # default: sys.stdout


@dataclass
class TrialRow:
    """One trial of the study, as the table and the summary show it."""

    number: int
    config_name: str
    config: dict[str, Any]
    status: str
    ms: float | None
    tflops: float | None
    label: str = ""
    message: str = ""
    duplicate_of: int | None = None  # answered from that earlier trial of the same config

    @property
    def passed(self) -> bool:
        return self.status == "pass"


@dataclass
class SessionResult:
    """What a session did; `to_dict` is the ``--summary`` JSON."""

    study: str
    storage: str
    device_name: str
    target: str
    timer: str
    trials_requested: int
    trials_counted: int
    trials_this_session: int
    wall_s: float
    counts: dict[str, int]
    space: str
    exhausted: bool
    best: TrialRow | None
    seeds: list[TrialRow]
    rows: list[TrialRow]
    winner: str
    captures: list[dict[str, Any]]
    speedup_vs: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("rows")
        return d


# ============================================================================ helpers


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def default_study_name(spec: Spec, target: Target, device_name: str, template_hash: str,
                       timer: str) -> str:
    """One study per (spec, target, device, template set, timer): results under another
    template set or timer are not comparable, so they never share a study."""
    name = f"tilegen-{spec.short_hash}-{target.name}-{_slug(device_name)}-t{template_hash[:8]}"
    return name if timer == "do_bench" else f"{name}-{_slug(timer)}"


def default_storage_url(db_path: Path) -> str:
    """SQLite file ``optuna.sqlite`` next to the tilegen DB."""
    return f"sqlite:///{db_path.parent / OPTUNA_FILENAME}"


def _tool_version(cmd: str, pattern: str) -> str:
    path = shutil.which(cmd)
    if not path:
        return ""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    m = re.search(pattern, out.stdout + out.stderr)
    return m.group(1) if m else ""


def _first_line(text: str | None, limit: int = 300) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0][:limit] if lines else ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _gpu_slots(workers: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES values for `workers` workers (None: leave the env alone)."""
    if workers == 1:
        return [None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        ids = [x.strip() for x in visible.split(",") if x.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    if not ids:
        return [None] * workers  # CPU (Triton interpreter): N CPU workers
    if workers > len(ids):
        raise SessionError(f"--workers {workers} but only {len(ids)} GPU(s) are visible")
    return ids[:workers]


# ============================================================================ the session


class _Session:
    def __init__(self, opts: TuneOptions) -> None:
        import optuna

        from tilegen.db import TuningDB, resolve_db_path

        self.optuna = optuna
        self.opts = opts
        self.progress = opts.progress or sys.stderr
        self.out = opts.out or sys.stdout
        if opts.timer not in TIMERS:
            raise SessionError(f"unknown timer {opts.timer!r}; known: {list(TIMERS)}")
        if opts.sampler not in SAMPLERS:
            raise SessionError(f"unknown sampler {opts.sampler!r}; known: {list(SAMPLERS)}")
        if opts.trials < 1 or opts.workers < 1:
            raise SessionError("--trials and --workers must be >= 1")
        self.spec = opts.spec
        self.db_path = resolve_db_path(opts.db_path)
        self.db = TuningDB.open(self.db_path)
        self.storage_url = opts.storage or default_storage_url(self.db_path)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.fatal: BaseException | None = None
        self.host = socket.gethostname()
        self.session_id = uuid.uuid4().hex[:12]
        self.in_flight: dict[int, tuple[Any, KernelConfig]] = {}
        self.finished: dict[str, TrialRow] = {}  # config name -> first result in the study
        self.labels: dict[str, str] = {}
        self.cand_ids: dict[str, int] = {}
        self.ran = 0
        self.handles: list[WorkerHandle] = []

    # -- setup -------------------------------------------------------------------------
    def start_workers(self) -> WorkerInfo:
        o = self.opts
        setup = WorkerSetup(self.spec.canonical_json(), o.captures,
                            tuple(range(max(1, o.seeds))), o.timer, o.op_factory)
        slots = _gpu_slots(o.workers)
        self.handles = [WorkerHandle(setup, gpu=g, setup_timeout_s=o.setup_timeout_s,
                                     label=f"worker{i}" + (f"@gpu{g}" if g else ""))
                        for i, g in enumerate(slots)]
        self._say(f"tune: starting {len(self.handles)} worker(s) (captures, references) ...")
        with ThreadPoolExecutor(len(self.handles)) as pool:
            infos = list(pool.map(lambda h: h.start(), self.handles))
        first = infos[0]
        names = {i.device_name for i in infos}
        if len(names) > 1:
            raise SessionError(f"workers see different devices {sorted(names)}; a study is "
                               "per device kind: pin --workers to GPUs of one kind")
        for note in first.notes:
            self._say(f"tune: note: {note}")
        caps = ", ".join(f"{c.name} ({'outlier, ' if c.outlier else ''}ref: {c.reference})"
                         for c in first.captures)
        self._say(f"tune: {first.device_name} ready in {first.setup_s:.1f}s; captures: {caps}")
        return first

    def resolve_target(self, info: WorkerInfo) -> Target:
        o = self.opts
        if o.target:
            target = get_target(o.target)
            if info.detected_target and info.detected_target != target.name:
                raise SessionError(f"--target {target.name} but this device "
                                   f"({info.device_name}) is {info.detected_target}")
            return target
        if info.detected_target is None:
            raise SessionError(f"no tilegen target matches {info.device_name}; pass --target "
                               "(under the CPU interpreter too, e.g. --target sm_90)")
        return get_target(info.detected_target)

    def prepare(self, info: WorkerInfo, target: Target) -> None:
        from tilegen import __version__
        from tilegen.tune.toolchain import current_toolchain_key
        from tilegen.winners import current_template_set_hash, find_winner

        o, optuna = self.opts, self.optuna
        self.info, self.target = info, target
        self.space = SearchSpace.from_target(self.spec, target, o.space)
        self.all_names = {c.name for c in self.space.configs()}
        self.template_hash = current_template_set_hash()
        self.toolchain = current_toolchain_key()
        self.env = {
            "device_name": info.device_name, "arch": target.name, "driver": info.driver,
            "torch": info.torch, "triton": info.triton,
            "nvcc": _tool_version("nvcc", r"release (\d+\.\d+)"),
            "clang": _tool_version("clang++", r"clang version (\d+\.\d+\.\d+)"),
            "tilegen_version": __version__, "template_set_hash": self.template_hash,
        }
        self.db.upsert_workload(self.spec.hash, self.spec.to_dict())
        self.env_id = self.db.upsert_environment(self.env)
        self.study_name = o.study or default_study_name(self.spec, target, info.device_name,
                                                       self.template_hash, o.timer)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        kwargs: dict[str, Any] = {}
        if self.storage_url.startswith("sqlite"):
            Path(self.storage_url.removeprefix("sqlite:///")).parent.mkdir(parents=True,
                                                                            exist_ok=True)
            kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
        self.storage = _open_storage(optuna, self.storage_url, kwargs)
        self.enumerate = o.sampler == "grid" or (o.sampler == "auto"
                                                 and self.space.size <= o.trials)
        if o.sampler == "random":
            sampler = optuna.samplers.RandomSampler(seed=o.sampler_seed)
        else:
            sampler = optuna.samplers.TPESampler(
                seed=o.sampler_seed, multivariate=True, constant_liar=True,
                n_startup_trials=max(4, min(10, o.trials // 4)))
        self.study = optuna.create_study(storage=self.storage, study_name=self.study_name,
                                         direction="minimize", sampler=sampler,
                                         load_if_exists=True)
        attrs = self.study.user_attrs
        wanted = {"spec_hash": self.spec.hash, "target": target.name,
                  "device_name": info.device_name, "timer": o.timer,
                  "template_set_hash": self.template_hash}
        # Hosts starting together race to create the study: whoever finds an attribute
        # missing writes it; only a conflicting value is an error.
        for key, value in wanted.items():
            if key not in attrs:
                self.study.set_user_attr(key, value)
        if any(attrs.get(k, wanted[k]) != wanted[k] for k in ("spec_hash", "timer")):
            raise SessionError(f"study {self.study_name!r} in {self.storage_url} was made for "
                               f"spec {str(attrs.get('spec_hash'))[:12]} with timer "
                               f"{attrs.get('timer')}; pick another --study name")
        # Known winner (current or stale) from the DB and the shipped exports: a good seed.
        known: list[tuple[str, KernelConfig]] = []
        with contextlib.suppress(Exception):
            found = find_winner(self.spec, target, device_name=info.device_name,
                                db_path=self.db_path)
            if found.config is not None:
                known.append((f"known winner ({found.status})", found.config))
        self.seeds = seed_configs(self.space, known)
        self.labels = {cfg.name: label for label, cfg in self.seeds}

    def _name_of(self, t: Any) -> str | None:
        name = t.user_attrs.get("config")
        if name:
            return name
        params = t.system_attrs.get("fixed_params", t.params)
        if set(params) == set(self.space.names):
            return self.space.config(params).name
        return None

    def resume(self) -> None:
        """Fail the trials a killed session left RUNNING, queue their configs again, queue
        the seeds (and the whole space when enumerating) that are not in the study yet."""
        TS = self.optuna.trial.TrialState
        now = datetime.now(UTC)
        stale_after = 2 * self.opts.timeout_s + self.opts.setup_timeout_s
        requeue: list[Any] = []
        for t in self.study.get_trials(deepcopy=False, states=(TS.RUNNING,)):
            host, pid = t.user_attrs.get("host"), t.user_attrs.get("pid")
            start = t.datetime_start
            age = (now - start.replace(tzinfo=UTC)).total_seconds() if start else math.inf
            dead = (host == self.host and isinstance(pid, int) and not _pid_alive(pid)) or (
                host is None and age > _UNTAGGED_GRACE_S) or age > stale_after
            if not dead:
                continue
            trial = self.optuna.trial.Trial(self.study, t._trial_id)
            if self._restore_from_db(trial, t):
                continue
            trial.set_user_attr("status", INTERRUPTED)
            self.study.tell(t.number, state=TS.FAIL, skip_if_finished=True)
            requeue.append(t)
        present: set[str] = set()
        for t in self.study.get_trials(deepcopy=False):
            if (t.user_attrs.get("status") == INTERRUPTED
                    or t.user_attrs.get("duplicate_of") is not None):
                continue  # a repeat only points at another trial's result
            name = self._name_of(t)
            if name:
                present.add(name)
        if requeue:
            self._say(f"tune: resuming: {len(requeue)} trial(s) interrupted by a killed session "
                      f"marked FAIL ({INTERRUPTED}); their configs are queued again")
        for t in requeue:
            name = self._name_of(t)
            params = t.system_attrs.get("fixed_params", t.params)
            if name and name not in present and set(params) == set(self.space.names):
                self.study.enqueue_trial(dict(params), user_attrs={"retry_of": t.number})
                present.add(name)
        queue = [cfg for _label, cfg in self.seeds]
        if self.enumerate:
            queue = self.space.enumeration(queue)
        for cfg in queue:
            if cfg.name not in present:
                self.study.enqueue_trial(self.space.params(cfg))
                present.add(cfg.name)
        for row in self.rows():
            if row.status != INTERRUPTED and row.duplicate_of is None:
                self.finished.setdefault(row.config_name, row)

    def _restore_from_db(self, trial: Any, t: Any) -> bool:
        """A killed session records a trial in the tilegen DB before telling Optuna; if it
        died in between, the DB row is the trial's result: tell it now instead of re-running."""
        from sqlalchemy import select

        from tilegen.db.models import Trial as DBTrial

        with self.db.session() as s:
            row = s.scalar(select(DBTrial).where(DBTrial.study == self.study_name,
                                                 DBTrial.trial_number == t.number))
            if row is None:
                return False
            status, ms, tflops = row.status, row.median_ms, row.tflops
            error = row.error_text or ""
        TS = self.optuna.trial.TrialState
        trial.set_user_attr("status", status)
        if tflops is not None:
            trial.set_user_attr("tflops", tflops)
        if status == "pass" and ms is not None:
            self.study.tell(t.number, ms, skip_if_finished=True)
        else:
            trial.set_user_attr("reason" if status == "pruned" else "error", error[:2000])
            self.study.tell(t.number, state=TS.PRUNED if status == "pruned" else TS.FAIL,
                            skip_if_finished=True)
        return True

    # -- counting ----------------------------------------------------------------------
    def _counted(self, t: Any) -> bool:
        """A trial with a result of its own: not interrupted, not a repeat of another."""
        TS = self.optuna.trial.TrialState
        if t.user_attrs.get("duplicate_of") is not None:
            return False
        if t.state in (TS.COMPLETE, TS.PRUNED):
            return True
        return t.state == TS.FAIL and t.user_attrs.get("status") != INTERRUPTED

    def _budget(self) -> tuple[int, int]:
        """(trials with a result, trials running now) over the whole study (all hosts)."""
        TS = self.optuna.trial.TrialState
        done = running = 0
        now = datetime.now(UTC)
        for t in self.study.get_trials(deepcopy=False,
                                       states=(TS.COMPLETE, TS.PRUNED, TS.FAIL, TS.RUNNING)):
            if t.state == TS.RUNNING:
                start = t.datetime_start
                age = (now - start.replace(tzinfo=UTC)).total_seconds() if start else 0.0
                if t.number in self.in_flight or age < 2 * self.opts.timeout_s + 60:
                    running += 1
            elif self._counted(t):
                done += 1
        return done, running

    def exhausted(self) -> bool:
        return self.all_names <= set(self.finished)

    # -- the trial loop ----------------------------------------------------------------
    def _next(self) -> tuple[Any, KernelConfig] | None:
        """Claim the next trial that needs a worker (under the lock). Pruned and repeated
        configs are answered here, without a worker."""
        TS = self.optuna.trial.TrialState
        while not self.stop.is_set():
            done, running = self._budget()
            if done + running >= self.opts.trials or self.exhausted():
                return None
            trial = self.study.ask()
            for key, value in (("host", self.host), ("pid", os.getpid()),
                               ("session", self.session_id)):
                trial.set_user_attr(key, value)
            cfg = self.space.suggest(trial)
            trial.set_user_attr("config", cfg.name)
            trial.set_user_attr("config_json", cfg.to_json())
            # Another process sharing the study (a --workers sibling, or another host on
            # PostgreSQL) may hold or have finished this config. Look at running trials first,
            # then at finished ones: a trial that finishes in between is seen by the second.
            running = next((n for n, (_t, c) in self.in_flight.items() if c.name == cfg.name),
                           None)
            if running is None:
                running = self._claimed_elsewhere(trial.number, cfg.name)
            if running is None:
                # claim right after the look: the double-run window is one storage round trip
                trial.set_user_attr(CLAIMED, True)
                self._sync_finished()
            prior = self.finished.get(cfg.name)
            if prior is not None or running is not None:
                # The sampler proposed a config this study already has: answer from that
                # result (no GPU time, not counted) and queue an unseen config so the next
                # trial explores.
                self._answer_duplicate(trial, prior, running)
                if not self._queue_unseen(trial.number):
                    return None  # every config left is running on another worker
                continue
            reasons = self.space.violations(cfg)
            if reasons:
                trial.set_user_attr("status", "pruned")
                trial.set_user_attr("reason", "; ".join(reasons))
                row = TrialRow(trial.number, cfg.name, cfg.to_dict(), "pruned", None, None,
                               message="; ".join(reasons))
                self._record(row, cfg)
                self.study.tell(trial, state=TS.PRUNED)
                self.finished.setdefault(cfg.name, row)
                self._report(row)
                continue
            self.in_flight[trial.number] = (trial, cfg)
            return trial, cfg
        return None

    def _sync_finished(self) -> None:
        """Learn the results other processes sharing the study have finished since."""
        for row in self.rows():
            if row.status != INTERRUPTED and row.duplicate_of is None:
                self.finished.setdefault(row.config_name, row)

    def _claimed_elsewhere(self, number: int, name: str) -> int | None:
        """The RUNNING trial of another process that owns config `name`, if any.

        Claim protocol over the shared storage: a trial first tags itself with its config,
        then looks for others with the same config. It yields to one that has finished its
        claim (CLAIMED), or to a lower-numbered one still claiming; the one that proceeds then
        marks itself CLAIMED at once. Two claimants that tag before either looks thus never both
        run; only a look that lands between another's look and its CLAIMED write (one storage
        round trip) can double up. A claim older than the stale limit (`resume`'s: a host that
        died mid-trial) owns nothing.
        """
        TS = self.optuna.trial.TrialState
        now = datetime.now(UTC)
        stale_after = 2 * self.opts.timeout_s + self.opts.setup_timeout_s
        for t in self.study.get_trials(deepcopy=False, states=(TS.RUNNING,)):
            if t.number == number or t.user_attrs.get("config") != name:
                continue
            if t.user_attrs.get("duplicate_of") is not None:
                continue
            start = t.datetime_start
            if start and (now - start.replace(tzinfo=UTC)).total_seconds() > stale_after:
                continue
            if t.user_attrs.get(CLAIMED) or t.number < number:
                return t.number
        return None

    def _answer_duplicate(self, trial: Any, prior: TrialRow | None, running: int | None
                          ) -> None:
        TS = self.optuna.trial.TrialState
        if prior is None:  # the same config is running on another worker right now
            trial.set_user_attr("duplicate_of", running)
            trial.set_user_attr("status", "duplicate")
            self.study.tell(trial, state=TS.FAIL)
            return
        trial.set_user_attr("duplicate_of", prior.number)
        trial.set_user_attr("status", prior.status)
        if prior.passed and prior.ms is not None:
            self.study.tell(trial, prior.ms)
        else:
            self.study.tell(trial, state=TS.PRUNED if prior.status == "pruned" else TS.FAIL)

    def _queue_unseen(self, number: int) -> bool:
        """Enqueue one config that no trial has (feasible ones first); False if none is left
        outside the running trials."""
        TS = self.optuna.trial.TrialState
        taken = set(self.finished) | {c.name for _t, c in self.in_flight.values()}
        for t in self.study.get_trials(deepcopy=False, states=(TS.WAITING, TS.RUNNING)):
            name = self._name_of(t)
            if name:
                taken.add(name)
        if not self.all_names - taken:
            return False
        rng = random.Random(f"{self.opts.sampler_seed}:{number}")
        unseen = [c for c in self.space.configs() if c.name not in taken]
        feasible = [c for c in unseen if not self.space.violations(c)]
        pick = rng.choice(feasible or unseen)
        self.study.enqueue_trial(self.space.params(pick), user_attrs={"explore": True})
        return True

    def _finish(self, trial: Any, cfg: KernelConfig, res: TrialResult) -> None:
        """Tell Optuna and the tilegen DB how a trial ended (under the lock)."""
        TS = self.optuna.trial.TrialState
        self.in_flight.pop(trial.number, None)
        trial.set_user_attr("status", res.status)
        trial.set_user_attr("wall_s", round(res.wall_s, 3))
        if res.compile_s is not None:
            trial.set_user_attr("first_call_s", round(res.compile_s, 3))
        if res.tflops is not None:
            trial.set_user_attr("tflops", res.tflops)
        trial.set_user_attr("captures", [
            {k: r[k] for k in ("capture", "passed", "min_head_cos", "max_abs", "mean_abs", "ms")
             if k in r and not (isinstance(r[k], float) and not math.isfinite(r[k]))}
            for r in res.captures])
        row = TrialRow(trial.number, cfg.name, cfg.to_dict(), res.status, res.median_ms,
                       res.tflops, message=_first_line(res.error_text))
        # The DB first: a session killed before the Optuna tell is reconciled from it on resume.
        self._record(row, cfg, result=res)
        if res.passed and res.median_ms is not None:
            self.study.tell(trial, res.median_ms)
        else:
            trial.set_user_attr("error_class", res.error_class or "")
            trial.set_user_attr("error", (res.error_text or "")[:2000])
            self.study.tell(trial, state=TS.FAIL)
        self.finished.setdefault(cfg.name, row)
        self.ran += 1
        self._report(row)

    def _interrupt(self, trial: Any, cfg: KernelConfig, why: str) -> None:
        """A trial that could not run (the session stops): FAIL 'interrupted', queued again."""
        TS = self.optuna.trial.TrialState
        self.in_flight.pop(trial.number, None)
        with contextlib.suppress(Exception):
            trial.set_user_attr("status", INTERRUPTED)
            trial.set_user_attr("error", why[:2000])
            self.study.tell(trial, state=TS.FAIL, skip_if_finished=True)
            self.study.enqueue_trial(self.space.params(cfg), user_attrs={"retry_of": trial.number})

    def drive(self, handle: WorkerHandle) -> None:
        """One worker's loop (a thread per worker)."""
        while not self.stop.is_set():
            with self.lock:
                job = self._next()
            if job is None:
                return
            trial, cfg = job
            try:
                res = handle.run(TrialRequest(trial.number, cfg.to_dict()), cfg.name,
                                 self.opts.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - a worker that cannot restart
                with self.lock:
                    self._interrupt(trial, cfg, f"{type(exc).__name__}: {exc}")
                    self.fatal = self.fatal or exc
                self.stop.set()
                return
            if self.stop.is_set() and trial.number not in self.in_flight:
                return  # interrupted by Ctrl-C while running: already re-queued
            with self.lock:
                self._finish(trial, cfg, res)

    # -- recording ---------------------------------------------------------------------
    def _candidate(self, cfg: KernelConfig) -> int:
        if cfg.name not in self.cand_ids:
            run_cfg = cfg.replace(store_lse=True)
            if self.info.interpreter and self.spec.dtype == "bf16":
                run_cfg = run_cfg.replace(interp_bf16=True)  # the source that actually ran
            sha = render_triton(self.spec, run_cfg, self.target).sha256
            self.cand_ids[cfg.name] = self.db.add_candidate(self.spec.hash, cfg.name,
                                                            cfg.to_dict(), sha)
        return self.cand_ids[cfg.name]

    def _record(self, row: TrialRow, cfg: KernelConfig, *,
                result: TrialResult | None = None) -> None:
        scores: Any = None
        if result is not None:
            scores = {"captures": result.captures, "first_call_s": result.compile_s,
                      "wall_s": result.wall_s, "timer": self.opts.timer}
        error_class = None
        error_text = None
        if row.status == "pruned":
            error_class, error_text = "pruned", row.message
        elif result is not None and not result.passed:
            error_class, error_text = result.error_class, result.error_text
        self.db.record_trial(self.study_name, row.number, self._candidate(cfg), self.env_id,
                             row.status, median_ms=row.ms, tflops=row.tflops, scores=scores,
                             error_class=error_class, error_text=error_text)

    # -- reporting ---------------------------------------------------------------------
    def _say(self, text: str) -> None:
        print(text, file=self.progress, flush=True)

    def _report(self, row: TrialRow) -> None:
        done, _ = self._budget()
        n = self.opts.trials
        width = 20
        filled = min(width, round(width * done / n))
        rows = [r for r in self.rows() if r.status != INTERRUPTED and r.duplicate_of is None]
        best = min((r for r in rows if r.passed and r.ms is not None), key=lambda r: r.ms,
                   default=None)
        fails = Counter(r.status for r in rows if r.status != "pass")
        fail_text = " ".join(f"{k}={fails[k]}" for k in (*FAILURE_CLASSES, "pruned")
                             if fails[k]) or "none"
        what = f"{row.ms:.4f} ms" if row.passed and row.ms is not None else row.status
        best_text = f"{best.ms:.4f} ms (#{best.number} {best.config_name})" if best else "-"
        self._say(f"tune [{'#' * filled}{'-' * (width - filled)}] {done}/{n}  "
                  f"#{row.number} {row.config_name}: {what}  | best {best_text}  "
                  f"| failures: {fail_text}")

    def rows(self) -> list[TrialRow]:
        """Every finished trial of the study (all sessions, all hosts)."""
        TS = self.optuna.trial.TrialState
        out = []
        for t in self.study.get_trials(deepcopy=False,
                                       states=(TS.COMPLETE, TS.PRUNED, TS.FAIL)):
            name = self._name_of(t)
            if name is None:
                continue
            raw = t.user_attrs.get("config_json")
            cfg = json.loads(raw) if raw else self.space.config(t.params).to_dict()
            status = t.user_attrs.get("status") or (
                "pass" if t.state == TS.COMPLETE else "pruned" if t.state == TS.PRUNED
                else "runtime_error")
            msg = t.user_attrs.get("reason") or t.user_attrs.get("error") or ""
            ms = t.value if t.state == TS.COMPLETE else None
            dup = t.user_attrs.get("duplicate_of")
            if dup is not None:
                msg = f"same config as trial #{dup}"
            out.append(TrialRow(t.number, name, cfg, status, ms, t.user_attrs.get("tflops"),
                                self.labels.get(name, ""), _first_line(msg, 200), dup))
        return out

    def table(self, rows: list[TrialRow]) -> str:
        passing = sorted((r for r in rows if r.passed and r.ms is not None
                          and r.duplicate_of is None), key=lambda r: (r.ms, r.number))
        seen: set[str] = set()
        shown: list[TrialRow] = []
        for r in passing:
            if r.config_name not in seen:
                seen.add(r.config_name)
                shown.append(r)
        shown = shown[: self.opts.top]
        names = {r.config_name for r in shown}
        extra = [r for r in rows if r.label and r.config_name not in names
                 and r.status != INTERRUPTED and r.duplicate_of is None]
        extra = list({r.config_name: r for r in reversed(extra)}.values())
        head = (f"{'rank':>4s} {'trial':>5s}  {'config':28s} {'ms':>9s} {'TFLOP/s':>8s}  "
                f"{'gate':4s}  note")
        lines = [head, "-" * len(head)]
        for i, r in enumerate(shown + extra):
            rank = str(i + 1) if i < len(shown) else "-"
            ms = f"{r.ms:9.4f}" if r.ms is not None else f"{'-':>9s}"
            tf = f"{r.tflops:8.4g}" if r.tflops is not None else f"{'-':>8s}"
            gate = "PASS" if r.passed else "FAIL"
            note = r.label if r.passed else f"{r.label + ': ' if r.label else ''}{r.status}"
            lines.append(f"{rank:>4s} {r.number:5d}  {r.config_name:28s} {ms} {tf}  {gate:4s}  "
                         f"{note}")
        failed = [r for r in rows if r.status not in ("pass", INTERRUPTED)
                  and r.duplicate_of is None]
        if failed:
            lines.append("")
            lines.append("failed or pruned:")
            for r in failed[:20]:
                lines.append(f"  #{r.number:<4d} {r.config_name:28s} {r.status:22s} {r.message}")
            if len(failed) > 20:
                lines.append(f"  ... {len(failed) - 20} more "
                             f"(tilegen db show {self.spec.short_hash})")
        return "\n".join(lines)

    # -- the end -----------------------------------------------------------------------
    def set_winner(self, best: TrialRow | None) -> str:
        if best is None:
            return "none (no passing trial)"
        if self.opts.timer != "do_bench" and self.info.device_type != "cpu":
            return "not recorded (fake timer on a GPU: test-only timings never win)"
        cfg = KernelConfig.from_dict(best.config)
        res = self.db.set_winner(self.spec.hash, self._candidate(cfg),
                                 device_name=self.info.device_name, arch=self.target.name,
                                 template_set_hash=self.template_hash,
                                 toolchain_key=self.toolchain, median_ms=float(best.ms or 0.0))
        if res.action == "kept":
            if res.median_ms == best.ms:
                return f"unchanged: {best.config_name} ({best.ms:.4f} ms)"
            return (f"kept the stored winner ({res.median_ms:.4f} ms, faster than "
                    f"{best.config_name} at {best.ms:.4f} ms)")
        return f"{res.action}: {best.config_name} ({best.ms:.4f} ms)"

    def close(self) -> None:
        for h in self.handles:
            with contextlib.suppress(Exception):
                h.close()
        with contextlib.suppress(Exception):
            self.db.close()


def plot_history(rows: Sequence[TrialRow], path: str | Path, title: str = "") -> str:
    """Write a PNG of the tuning history (latency per trial, best so far, failures).

    Returns a one-line message; never raises for a missing matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (f"--plot {path}: matplotlib is not installed (pip install matplotlib); "
                "no plot written")
    rows = sorted(rows, key=lambda r: r.number)
    ok = [r for r in rows if r.passed and r.ms is not None]
    bad = [r for r in rows if not r.passed]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if ok:
        ax.scatter([r.number for r in ok], [r.ms for r in ok], s=18, label="pass")
        best, xs, ys = math.inf, [], []
        for r in rows:
            if r.passed and r.ms is not None:
                best = min(best, r.ms)
            if math.isfinite(best):
                xs.append(r.number)
                ys.append(best)
        ax.step(xs, ys, where="post", color="C2", label="best so far")
    if bad:
        top = max((r.ms for r in ok), default=1.0) * 1.05
        ax.scatter([r.number for r in bad], [top] * len(bad), marker="x", color="C3",
                   label="failed / pruned")
    ax.set_xlabel("trial")
    ax.set_ylabel("median latency (ms)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"tune: wrote tuning history plot {path}"


def _current_identity() -> tuple[str, str]:
    """(template set hash, toolchain key) of this checkout: what tilegen.load would match."""
    from tilegen.winners import current_template_set_hash, current_toolchain_key

    return current_template_set_hash(), current_toolchain_key()


def export_spec(db: Any, spec: Spec, dest: str | Path, out: IO[str]) -> None:
    """``--export``: write the spec's workload, candidates and winners to `dest`.

    An existing export at `dest` is merged with, not overwritten
    (`tilegen.db.merge_export_file`), so that exporting a second spec to
    ``tuning_db/winners.json`` keeps the winners already shipped there. The tuning results are
    in the DB before this runs; a file that cannot be merged is a `SessionError` naming it.
    """
    from tilegen.db import merge_export_file

    doc = db.export_dict(spec_hash=spec.hash)
    try:
        report = merge_export_file(dest, doc, current=_current_identity())
    except (ValueError, OSError) as exc:
        raise SessionError(
            f"--export {dest}: {exc}; the session's results are in the tuning DB {db.path} "
            f"(move the file away and run `tilegen db export --spec-hash {spec.short_hash} "
            f"--out {dest}`)") from exc
    if report is None:
        print(f"exported winners of spec {spec.short_hash} to {dest}", file=out)
        return
    print(f"merged winners of spec {spec.short_hash} into {dest}"
          + ("" if report.changed else " (no change)"), file=out)
    for note in report.notes:
        print(f"  {note}", file=out)


def run_session(opts: TuneOptions) -> SessionResult:
    """Run (or resume) a tuning session; see the module docstring."""
    t0 = time.perf_counter()
    sess = _Session(opts)
    try:
        info = sess.start_workers()
        target = sess.resolve_target(info)
        sess.prepare(info, target)
        with sess.lock:
            sess.resume()
            done, _ = sess._budget()
        mode = "exhaustive" if sess.enumerate else opts.sampler if opts.sampler != "auto" \
            else "tpe"
        sess._say(f"tune: study {sess.study_name} in {sess.storage_url}")
        sess._say(f"tune: space {sess.space.describe()} ({len(sess.space.feasible())} feasible); "
                  f"sampler {mode}; seeds: "
                  + (", ".join(f"{lbl} {c.name}" for lbl, c in sess.seeds) or "none"))
        if done:
            sess._say(f"tune: resuming with {done}/{opts.trials} trials done")
        threads = [threading.Thread(target=sess.drive, args=(h,), daemon=True,
                                    name=f"tilegen-tune-{h.label}") for h in sess.handles]
        for th in threads:
            th.start()
        try:
            while any(th.is_alive() for th in threads):
                for th in threads:
                    th.join(0.2)
        except KeyboardInterrupt:
            sess.stop.set()
            with sess.lock:
                for trial, cfg in list(sess.in_flight.values()):
                    sess._interrupt(trial, cfg, "KeyboardInterrupt")
            raise
        if sess.fatal is not None:
            raise SessionError(f"tuning stopped: {sess.fatal}") from sess.fatal
        rows = sess.rows()
        counted = [r for r in rows if r.status != INTERRUPTED and r.duplicate_of is None]
        best = min((r for r in counted if r.passed and r.ms is not None
                    and r.duplicate_of is None), key=lambda r: (r.ms, r.number), default=None)
        if best is not None:
            best.label = f"winner ({best.label})" if best.label else "winner"
        winner = sess.set_winner(best)
        seeds = []
        for label, cfg in sess.seeds:
            row = sess.finished.get(cfg.name)
            if row is not None:
                seeds.append(TrialRow(row.number, row.config_name, row.config, row.status,
                                      row.ms, row.tflops, label, row.message))
        # Speedups over the hand-picked configs of this same run (not over a known winner).
        speedup = {s.label: s.ms / best.ms for s in seeds
                   if best is not None and best.ms and s.passed and s.ms
                   and ("target default" in s.label or "reference" in s.label)}
        result = SessionResult(
            study=sess.study_name, storage=sess.storage_url, device_name=info.device_name,
            target=target.name, timer=opts.timer, trials_requested=opts.trials,
            trials_counted=len(counted), trials_this_session=sess.ran,
            wall_s=time.perf_counter() - t0,
            counts=dict(Counter(r.status for r in counted)), space=sess.space.describe(),
            exhausted=sess.exhausted(), best=best, seeds=seeds, rows=rows, winner=winner,
            captures=[asdict(c) for c in info.captures], speedup_vs=speedup)
        out = sess.out
        print(f"\ntilegen tune: spec {opts.spec.short_hash} on {info.device_name} "
              f"({target.name}), timer {opts.timer}, study {sess.study_name}", file=out)
        print(sess.table(rows), file=out)
        if result.exhausted and len(counted) < opts.trials:
            print(f"\nsearch space exhausted: all {sess.space.size} configs tried in "
                  f"{len(counted)} trials (asked for {opts.trials})", file=out)
        dups = len(rows) - len(counted) - sum(r.status == INTERRUPTED for r in rows)
        print(f"\ntrials: {len(counted)} in the study ({sess.ran} run now; {dups} repeated "
              "proposals answered from earlier results, not counted), "
              f"{', '.join(f'{k} {v}' for k, v in sorted(result.counts.items()))}; "
              f"wall {result.wall_s:.1f} s", file=out)
        for label, factor in speedup.items():
            print(f"speedup of the best over {label}: {factor:.3f}x", file=out)
        print(f"winner: {winner}", file=out)
        if opts.export:
            export_spec(sess.db, opts.spec, opts.export, out)
        if opts.summary:
            Path(opts.summary).parent.mkdir(parents=True, exist_ok=True)
            Path(opts.summary).write_text(json.dumps(result.to_dict(), indent=2,
                                                     sort_keys=True, default=str) + "\n")
        if opts.plot:
            print(plot_history(rows, opts.plot, sess.study_name), file=out)
        return result
    except WorkerSetupError as exc:
        raise SessionError(str(exc)) from exc
    finally:
        sess.close()


__all__ = [
    "SAMPLERS",
    "SessionError",
    "SessionResult",
    "TrialRow",
    "TuneOptions",
    "default_storage_url",
    "default_study_name",
    "export_spec",
    "plot_history",
    "run_session",
]
