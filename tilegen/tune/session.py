"""A tuning session: an Optuna study over the search space, trials run by persistent workers.

Optuna does the bookkeeping; this module only says what a trial is:

- **the trial log is Optuna's storage** (SQLite next to the tilegen DB by default, or
  ``--storage URL``). Each trial's user attributes carry its outcome: ``status`` ("pass", a
  failure class of `tilegen.tune.objective.FAILURE_CLASSES`, "pruned" for a config the target
  cannot run, "duplicate"), ``median_ms``, ``tflops``, per-capture ``scores``, ``timer``, the
  ``variant`` key, ``config``, ``env`` (where it ran), ``host`` and ``pid``. The tilegen DB keeps
  what Optuna does not: the environment, the candidates (config + variant key), which study
  tuned which workload, and the winner. Nothing is stored twice, nothing is reconciled;
- **states**: a passing trial is COMPLETE (value: mean of the per-capture medians, ms); a
  failing or infeasible one is PRUNED (TPE ranks it below every passing one); FAIL is left to
  trials that did not finish (a killed session or host);
- **killed sessions**: the storage runs with heartbeats (``--heartbeat``; the objective writes
  a trial's first beat itself, before any work, so a trial killed at once has one); a RUNNING
  trial whose heartbeat stops is failed by `optuna.storages.fail_stale_trials` and queued again by
  `RetryHeartbeatStaleTrialCallback` (Optuna's ``RetryFailedTrialCallback``), so re-running the
  same command resumes: only the remainder of ``--trials`` runs;
- **budget across hosts**: `optuna.study.MaxTrialsCallback` over COMPLETE + PRUNED trials of
  the study, whoever ran them (hosts racing for the last trials overshoot by at most one per
  extra worker);
- **seeds**: the target default, the reference variant and any known winner (current, stale, or
  the nearest workload's) are queued with `Study.enqueue_trial` (``skip_if_exists``);
- **samplers**: when the space fits in the budget, `BruteForceSampler` tries every point once
  and stops the study; otherwise TPE (multivariate, constant liar) or random;
- **workers**: one persistent worker process per GPU (`objective.WorkerHandle`), driven by
  ``study.optimize(n_jobs=workers)``; its setup checks the gate's reference against the fp32
  oracle. A config the sampler repeats is answered from the earlier trial (no GPU time).

At the end the best passing trial becomes the winner in the tilegen DB
(`TuningDB.set_winner`, keyed by workload, backend, device and target, storing the variant key
and the timer); a table of the top configs is printed, and optionally an export (merged into the
file when it already holds one), a summary JSON and a plot are written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from tilegen.cache import atomic_write
from tilegen.config import KernelConfig
from tilegen.spec import Spec
from tilegen.targets import Target, get_target
from tilegen.tune.ledger import TrialLedger
from tilegen.tune.objective import (
    DEFAULT_OP_FACTORY,
    FAKE_NOTE,
    TIMERS,
    TrialRequest,
    TrialResult,
    WorkerInfo,
    WorkerSetup,
    WorkerSetupError,
    is_fake_timer,
    ms_unit,
)
from tilegen.tune.pool import PoolError, WorkerPool
from tilegen.tune.report import (
    Progress,
    SessionResult,
    TrialRow,
    plot_history,
    print_summary,
)
from tilegen.tune.space import SearchSpace, Value, seed_configs
from tilegen.tune.storage import (
    DEFAULT_HEARTBEAT_S,
    default_storage_url,
    default_study_name,
    open_study_storage,
    record_first_heartbeat,
    sources_digest,
)

SAMPLERS = ("auto", "tpe", "random", "grid")
_MAX_ERROR = 2000


class SessionError(RuntimeError):
    """The session cannot run (no device, bad options, a worker that cannot start)."""


@dataclass
class TuneOptions:
    """Everything `run_session` needs; the CLI flags map one to one (see tilegen.tune.cli)."""

    spec: Spec = field(default_factory=Spec)
    target: str | None = None  # default: the worker's device
    backend: str = "triton"
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
    heartbeat_s: int = DEFAULT_HEARTBEAT_S
    op_factory: str = DEFAULT_OP_FACTORY
    reference_factory: str = ""
    oracle_check: str = "auto"
    progress: IO[str] | None = None  # default: sys.stderr
    out: IO[str] | None = None  # default: sys.stdout


# ============================================================================ helpers


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


def _clean(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


# ============================================================================ progress


# ============================================================================ the session


class _Session:
    def __init__(self, opts: TuneOptions) -> None:
        import optuna

        from tilegen import backends
        from tilegen.db.engine import check_writable, db_setting, inspect_file, resolve_db_path

        self.optuna = optuna
        self.TS = optuna.trial.TrialState
        self.opts = opts
        self.out = opts.out or sys.stdout
        if opts.timer not in TIMERS:
            raise SessionError(f"unknown timer {opts.timer!r}; known: {list(TIMERS)}")
        if opts.sampler not in SAMPLERS:
            raise SessionError(f"unknown sampler {opts.sampler!r}; known: {list(SAMPLERS)}")
        if opts.trials < 1 or opts.workers < 1 or opts.heartbeat_s < 1:
            raise SessionError("--trials, --workers and --heartbeat must be >= 1")
        try:
            self.backend = backends.get(opts.backend)
        except ValueError as exc:
            raise SessionError(str(exc)) from None
        self.spec = opts.spec
        self.db_path = resolve_db_path(opts.db_path)
        # First: a DB that cannot be written (not a DB, read-only) stops us before any worker;
        # the file itself is opened (created) in prepare(), once no refusal can come.
        if self.db_path.exists():
            inspect_file(self.db_path)
        check_writable(self.db_path, db_setting(opts.db_path))
        self.db: Any = None
        self.storage_url = opts.storage or default_storage_url(self.db_path)
        self.host = socket.gethostname()
        self.pool: WorkerPool | None = None
        self.ran = 0
        self.fatal: BaseException | None = None
        self.labels: dict[str, str] = {}
        self.variants: dict[str, dict[str, str]] = {}
        self.lock = threading.Lock()
        self.progress = Progress(opts.progress or sys.stderr, opts.trials, opts.timer)

    def say(self, text: str) -> None:
        self.progress.say(text)

    # -- setup -------------------------------------------------------------------------
    def start_workers(self) -> WorkerInfo:
        o = self.opts
        setup = WorkerSetup(self.spec.canonical_json(), o.captures,
                            tuple(range(max(1, o.seeds))), o.timer, o.op_factory,
                            o.reference_factory, o.oracle_check, o.backend)
        try:
            self.pool = WorkerPool(setup, o.workers, o.setup_timeout_s)
            first = self.pool.start(self.say)
        except PoolError as exc:
            raise SessionError(str(exc)) from None
        for note in first.notes:
            self.say(f"tune: note: {note}")
        caps = "; ".join(f"{c.name} ({'outlier, ' if c.outlier else ''}ref: {c.reference}, "
                         f"vs fp32 oracle: {c.oracle})" for c in first.captures)
        self.say(f"tune: {first.device_name} ready in {first.setup_s:.1f}s; captures: {caps}")
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
        from tilegen.db.records import TuningDB
        from tilegen.winners import current_template_set_hash, find_winner

        o, optuna = self.opts, self.optuna
        self.info, self.target = info, target
        self.space = SearchSpace.from_target(self.spec, target, o.space, self.backend.name)
        self.toolchain = self.backend.toolchain(target)
        self.env = {
            "device_name": info.device_name, "arch": target.name, "driver": info.driver,
            "torch": info.torch, "triton": info.triton,
            "nvcc": _tool_version("nvcc", r"release (\d+\.\d+)"),
            "clang": _tool_version("clang++", r"clang version (\d+\.\d+\.\d+)"),
            "tilegen_version": __version__,
            "template_set_hash": current_template_set_hash(self.backend.name),
        }
        self.db = TuningDB.open(self.db_path)
        self.db.upsert_workload(self.spec.hash, self.spec.kernel_hash, self.spec.to_dict())
        self.study_name = o.study or default_study_name(
            self.spec, target, info.device_name, sources_digest(self.space, self.backend),
            o.timer, self.backend.name)
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        self.storage = open_study_storage(optuna, self.storage_url, int(o.heartbeat_s))
        self.exhaustive = o.sampler == "grid" or (o.sampler == "auto"
                                                  and self.space.size <= o.trials)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if self.exhaustive:
                sampler = optuna.samplers.BruteForceSampler(seed=o.sampler_seed)
                self.sampler_name = "exhaustive (BruteForceSampler)"
            elif o.sampler == "random":
                sampler = optuna.samplers.RandomSampler(seed=o.sampler_seed)
                self.sampler_name = "random"
            else:
                sampler = optuna.samplers.TPESampler(
                    seed=o.sampler_seed, multivariate=True, constant_liar=True,
                    n_startup_trials=max(4, min(10, o.trials // 4)))
                self.sampler_name = "tpe"
        self.study = optuna.create_study(storage=self.storage, study_name=self.study_name,
                                         direction="minimize", sampler=sampler,
                                         load_if_exists=True)
        self.ledger = TrialLedger(optuna, self.study, self.space, o.sampler_seed)
        attrs = self.study.user_attrs
        wanted = {"spec_hash": self.spec.hash, "kernel_hash": self.spec.kernel_hash,
                  "backend": self.backend.name, "target": target.name,
                  "device_name": info.device_name, "timer": o.timer}
        # Hosts starting together race to create the study: whoever finds an attribute
        # missing writes it; only a conflicting value is an error.
        for key, value in wanted.items():
            if key not in attrs:
                self.study.set_user_attr(key, value)
        bad = [k for k in ("spec_hash", "timer", "backend") if attrs.get(k, wanted[k]) != wanted[k]]
        if bad:
            raise SessionError(f"study {self.study_name!r} in {self.storage_url} was made for "
                               f"spec {str(attrs.get('spec_hash'))[:12]}, backend "
                               f"{attrs.get('backend')}, timer {attrs.get('timer')}; pick "
                               "another --study name")
        self.db.record_study(self.storage_url, self.study_name, self.spec.hash,
                             backend=self.backend.name, device_name=info.device_name,
                             target=target.name, timer=o.timer)
        # Known winners (current, stale or the nearest workload's): good seeds.
        known: list[tuple[str, KernelConfig]] = []
        with contextlib.suppress(Exception):
            found = find_winner(self.spec, target, backend=self.backend.name,
                                device_name=info.device_name, db_path=self.db_path)
            if found.config is not None:
                kind = "nearest workload's" if found.nearest else found.status
                known.append((f"known winner ({kind})", found.config))
        self.seeds = seed_configs(self.space, known)
        self.labels = {cfg.name: label for label, cfg in self.seeds}
        for label, cfg in self.seeds:
            self.study.enqueue_trial(self.space.params(cfg), user_attrs={"label": label},
                                     skip_if_exists=True)

    # -- the study ---------------------------------------------------------------------
    def variant(self, cfg: KernelConfig) -> dict[str, str]:
        if cfg.name not in self.variants:
            self.variants[cfg.name] = self.backend.variant_key(
                self.spec, cfg, self.target).to_dict()
        return self.variants[cfg.name]

    def objective(self, trial: Any) -> float:
        """One trial: pick a config, answer repeats and infeasible configs without a worker,
        else run it in a worker. Returns the latency (COMPLETE) or raises TrialPruned; any
        other exception (a bug, a storage error) ends the trial FAIL with the traceback in its
        ``error`` attribute, not counted."""
        try:
            return self._objective(trial)
        except self.optuna.TrialPruned:
            raise
        except BaseException as exc:
            import traceback

            with contextlib.suppress(Exception):
                if "status" not in trial.user_attrs:
                    trial.set_user_attr("status", "error")
                trial.set_user_attr("error", "".join(
                    traceback.format_exception(exc))[-_MAX_ERROR:])
            raise

    def _objective(self, trial: Any) -> float:
        optuna = self.optuna
        record_first_heartbeat(trial)
        cfg = self.space.suggest(trial)
        reasons = self.space.violations(cfg)
        # a config the target cannot build has no source, so no variant key (rendering one
        # raises: the CUDA wgmma kernel's traits refuse it)
        for key, value in (("config", cfg.name), ("config_json", cfg.to_json()),
                           ("host", self.host), ("pid", os.getpid()),
                           ("timer", self.opts.timer),
                           ("variant", {} if reasons else self.variant(cfg)),
                           ("env", self.env)):
            trial.set_user_attr(key, value)
        if self.labels.get(cfg.name):
            trial.set_user_attr("label", self.labels[cfg.name])
        prior = self.ledger.same_config(trial.number, cfg.name)
        if prior is not None:
            trial.set_user_attr("duplicate_of", prior.number)
            self.ledger.queue_unseen(trial.number)
            if prior.state == self.TS.COMPLETE:
                trial.set_user_attr("status", prior.user_attrs.get("status", "pass"))
                trial.set_user_attr("median_ms", prior.value)
                return float(prior.value)
            status = ("duplicate" if prior.state == self.TS.RUNNING
                      else prior.user_attrs.get("status", "pruned"))
            trial.set_user_attr("status", status)
            raise optuna.TrialPruned(f"same config as trial #{prior.number}")
        if reasons:
            trial.set_user_attr("status", "pruned")
            trial.set_user_attr("error", "; ".join(reasons))
            raise optuna.TrialPruned("; ".join(reasons))
        handle = self.pool.get()
        try:
            res = handle.run(TrialRequest(trial.number, cfg.to_dict()), cfg.name,
                             self.opts.timeout_s)
        except KeyboardInterrupt:
            self._interrupted(trial, "KeyboardInterrupt")
            raise
        except BaseException as exc:  # a worker that cannot restart: stop the session
            self.fatal = self.fatal or exc
            self._interrupted(trial, f"{type(exc).__name__}: {exc}")
            self.study.stop()
            raise
        finally:
            self.pool.put(handle)
        with self.lock:
            self.ran += 1
        self._record(trial, res)
        if res.passed and res.median_ms is not None:
            return res.median_ms
        raise optuna.TrialPruned(f"{res.status}: {_first_line(res.error_text)}")

    def _interrupted(self, trial: Any, why: str) -> None:
        """A trial that could not finish (Ctrl-C, a dead worker): it ends FAIL (not counted)
        and its config is queued again, as Optuna's retry callback does for a killed host."""
        with contextlib.suppress(Exception):
            trial.set_user_attr("status", "interrupted")
            trial.set_user_attr("error", why[:_MAX_ERROR])
            self.study.enqueue_trial(dict(trial.params), user_attrs={"retry_of": trial.number})

    def _record(self, trial: Any, res: TrialResult) -> None:
        trial.set_user_attr("status", res.status)
        trial.set_user_attr("wall_s", round(res.wall_s, 3))
        if res.compile_s is not None:
            trial.set_user_attr("first_call_s", round(res.compile_s, 3))
        if res.median_ms is not None:
            trial.set_user_attr("median_ms", res.median_ms)
        if res.tflops is not None:
            trial.set_user_attr("tflops", res.tflops)
        trial.set_user_attr("scores", [
            {k: _clean(r[k]) for k in ("capture", "passed", "finite", "min_head_cos",
                                       "max_abs", "mean_abs", "ms") if k in r}
            for r in res.captures])
        if not res.passed:
            trial.set_user_attr("error_class", res.error_class or "")
            trial.set_user_attr("error", (res.error_text or "")[:_MAX_ERROR])

    # -- callbacks ---------------------------------------------------------------------
    def after_trial(self, study: Any, frozen: Any) -> None:
        """Progress line, and stop once every point of the space has a result."""
        row = self.row(frozen)
        if row is None:
            return
        rows = [r for r in self.rows() if r.duplicate_of is None]
        best = min((r for r in rows if r.passed and r.ms is not None),
                   key=lambda r: (r.ms, r.number), default=None)
        fails = Counter(r.status for r in rows if r.status != "pass")
        self.progress.trial(self.ledger.counted(), row, best, fails)
        if self.ledger.exhausted():
            study.stop()

    # -- reading the study -------------------------------------------------------------
    def row(self, t: Any) -> TrialRow | None:
        if t.state not in (self.TS.COMPLETE, self.TS.PRUNED):
            return None
        name = t.user_attrs.get("config")
        if not name:
            if set(t.params) != set(self.space.names):
                return None
            name = self.space.config(t.params).name
        raw = t.user_attrs.get("config_json")
        cfg = json.loads(raw) if raw else self.space.config(t.params).to_dict()
        status = t.user_attrs.get("status") or (
            "pass" if t.state == self.TS.COMPLETE else "pruned")
        dup = t.user_attrs.get("duplicate_of")
        msg = f"same config as trial #{dup}" if dup is not None else t.user_attrs.get("error", "")
        ms = t.value if t.state == self.TS.COMPLETE else None
        return TrialRow(t.number, name, cfg, status, ms, t.user_attrs.get("tflops"),
                        self.labels.get(name, t.user_attrs.get("label", "")),
                        _first_line(msg, 200), dup)

    def rows(self) -> list[TrialRow]:
        """Every trial of the study with a result (all sessions, all hosts)."""
        out = []
        for t in self.study.get_trials(deepcopy=False,
                                       states=(self.TS.COMPLETE, self.TS.PRUNED)):
            row = self.row(t)
            if row is not None:
                out.append(row)
        return out

    # -- the end -----------------------------------------------------------------------
    def set_winner(self, best: TrialRow | None) -> str:
        from tilegen.winners import variant_currency

        if best is None:
            return "none (no passing trial)"
        trial = self.study.trials[best.number]
        cfg = KernelConfig.from_dict(best.config)
        variant = trial.user_attrs.get("variant") or self.variant(cfg)
        cid = self.db.add_candidate(variant, cfg.to_dict())
        env = trial.user_attrs.get("env") or self.env
        env_id = self.db.upsert_environment(env)
        res = self.db.set_winner(
            self.spec.hash, cid, device_name=self.info.device_name,
            median_ms=float(best.ms or 0.0), timer=self.opts.timer, environment_id=env_id,
            study=self.study_name, trial_number=best.number,
            template_set_hash=env.get("template_set_hash", ""), currency=variant_currency)
        fake = "" if not is_fake_timer(self.opts.timer) else (
            f" [timer {self.opts.timer}: test only, never used by tilegen.load nor exported]")
        unit = ms_unit(self.opts.timer)
        if res.action == "kept":
            if res.reason == "same":
                return f"unchanged: {best.config_name} ({best.ms:.4f} {unit}){fake}"
            # the stored winner may have been timed by another timer than this session's
            kept_unit = ms_unit(res.previous.timer) if res.previous else unit
            return (f"kept the stored winner ({res.median_ms:.4f} {kept_unit}; {res.reason}) "
                    f"over {best.config_name} at {best.ms:.4f} {unit}{fake}")
        return f"{res.action}: {best.config_name} ({best.ms:.4f} {unit}){fake}"

    def record_candidates(self) -> None:
        """Every config a worker ran, as a candidate (config + variant key) in the tilegen DB."""
        for t in self.study.get_trials(deepcopy=False,
                                       states=(self.TS.COMPLETE, self.TS.PRUNED)):
            a = t.user_attrs
            if a.get("duplicate_of") is None and a.get("status") not in (None, "pruned") \
                    and a.get("variant") and a.get("config_json"):
                self.db.add_candidate(a["variant"], json.loads(a["config_json"]))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        with contextlib.suppress(Exception):
            self.db.close()


# ============================================================================ output


def export_spec(db: Any, spec: Spec, dest: str | Path, out: IO[str]) -> None:
    """``--export``: write the spec's workload, candidates and (real-timer) winners to `dest`.

    An existing export at `dest` is merged with, not overwritten
    (`tilegen.db.records.merge_export_file`), so that exporting a second spec to
    ``tuning_db/winners.json`` keeps the winners already shipped there. The tuning results are
    in the DB before this runs; a file that cannot be merged is a `SessionError` naming it.
    """
    from tilegen.db.errors import ExportFormatError
    from tilegen.db.records import merge_export_file
    from tilegen.winners import variant_currency

    doc = db.export_dict(spec_hash=spec.hash)
    left = doc.get("_left_out_fake", 0)
    try:
        report = merge_export_file(dest, doc, currency=variant_currency)
    except (ExportFormatError, ValueError, OSError) as exc:
        raise SessionError(
            f"--export {dest}: {exc}; the session's results are in the tuning DB {db.path} "
            f"(move the file away and run `tilegen db export --spec-hash {spec.short_hash} "
            f"--out {dest}`)") from exc
    note = (f" (left out {left} winner(s) timed by a test-only timer)") if left else ""
    if report is None:
        print(f"exported winners of spec {spec.short_hash} to {dest}{note}", file=out)
        return
    print(f"merged winners of spec {spec.short_hash} into {dest}"
          + ("" if report.changed else " (no change)") + note, file=out)
    for line in report.notes:
        print(f"  {line}", file=out)


def run_session(opts: TuneOptions) -> SessionResult:
    """Run (or resume) a tuning session; see the module docstring."""
    t0 = time.perf_counter()
    sess = _Session(opts)
    try:
        info = sess.start_workers()
        target = sess.resolve_target(info)
        sess.prepare(info, target)
        optuna = sess.optuna
        retried = sess.ledger.fail_stale()
        done = sess.ledger.counted()
        sess.say(f"tune: study {sess.study_name} in {sess.storage_url}")
        sess.say(f"tune: space {sess.space.describe()} ({len(sess.space.feasible())} feasible); "
                 f"sampler {sess.sampler_name}; seeds: "
                 + (", ".join(f"{lbl} {c.name}" for lbl, c in sess.seeds) or "none"))
        if is_fake_timer(opts.timer):
            sess.say(f"tune: timer {opts.timer} is test only: the latencies below are fake-ms, "
                     f"derived from config names ({FAKE_NOTE}); the correctness gate is real")
        if done or retried:
            sess.say(f"tune: resuming with {done}/{opts.trials} trials done"
                     + (f"; {retried} trial(s) left running by a killed session failed "
                        "(interrupted) and queued again" if retried else ""))
        remaining = opts.trials - done
        if remaining > 0 and not sess.ledger.exhausted():
            try:
                with sess.progress:
                    sess.study.optimize(
                        sess.objective, n_trials=remaining, n_jobs=len(sess.pool),
                        callbacks=[optuna.study.MaxTrialsCallback(
                            opts.trials, states=(optuna.trial.TrialState.COMPLETE,
                                                 optuna.trial.TrialState.PRUNED)),
                            sess.after_trial],
                        gc_after_trial=False)
            except Exception as exc:
                if sess.fatal is None:
                    raise
                raise SessionError(f"tuning stopped: {sess.fatal}") from exc
        if sess.fatal is not None:
            raise SessionError(f"tuning stopped: {sess.fatal}") from sess.fatal
        rows = sess.rows()
        best = min((r for r in rows if r.passed and r.ms is not None and r.duplicate_of is None),
                   key=lambda r: (r.ms, r.number), default=None)
        sess.record_candidates()
        winner = sess.set_winner(best)
        if best is not None:
            best.label = f"winner ({best.label})" if best.label else "winner"
        first = {}
        for r in sorted(rows, key=lambda r: r.number):
            if r.duplicate_of is None:
                first.setdefault(r.config_name, r)
        seeds = [TrialRow(row.number, row.config_name, row.config, row.status, row.ms,
                          row.tflops, label, row.message)
                 for label, cfg in sess.seeds if (row := first.get(cfg.name)) is not None]
        # Speedups over the hand-picked configs of this same run (not over a known winner).
        speedup = {s.label: s.ms / best.ms for s in seeds
                   if best is not None and best.ms and s.passed and s.ms
                   and ("target default" in s.label or "reference" in s.label)}
        result = SessionResult(
            study=sess.study_name, storage=sess.storage_url, device_name=info.device_name,
            target=target.name, backend=sess.backend.name, timer=opts.timer,
            sampler=sess.sampler_name, trials_requested=opts.trials, trials_counted=len(rows),
            trials_this_session=sess.ran, wall_s=time.perf_counter() - t0,
            counts=dict(Counter(r.status for r in rows)), space=sess.space.describe(),
            exhausted=sess.ledger.exhausted(), best=best, seeds=seeds, rows=rows, winner=winner,
            captures=[asdict(c) for c in info.captures], speedup_vs=speedup)
        print_summary(result, sess.out, top=opts.top, spec_short_hash=opts.spec.short_hash,
                      space_size=sess.space.size)
        if opts.export:
            export_spec(sess.db, opts.spec, opts.export, sess.out)
        if opts.summary:
            Path(opts.summary).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(Path(opts.summary), json.dumps(result.to_dict(), indent=2,
                                                        sort_keys=True, default=str) + "\n")
        if opts.plot:
            print(plot_history(rows, opts.plot, sess.study_name, timer=opts.timer),
                  file=sess.out)
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
    "sources_digest",
]
