"""Where a study lives: Optuna storage URLs, study names, heartbeats and the retry of a killed
session's trials, SQLite locking."""

from __future__ import annotations

import hashlib
import random
import re
import time
import warnings
from pathlib import Path
from typing import Any

from tilegen.spec import Spec
from tilegen.targets import Target
from tilegen.tune.space import SearchSpace

OPTUNA_FILENAME = "optuna.sqlite"
DEFAULT_HEARTBEAT_S = 15
#: a RUNNING trial without a heartbeat for this many intervals is failed and queued again
GRACE_INTERVALS = 3
MAX_RETRIES = 3


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def default_study_name(spec: Spec, target: Target, device_name: str, sources: str,
                       timer: str, backend: str = "triton") -> str:
    """One study per (spec, backend, target, device, rendered sources, timer): trials of another
    source or timer are not comparable, so they never share a study. ``sources`` is a digest
    of the sha256s of the sources the space renders (`sources_digest`)."""
    name = (f"tilegen-{spec.short_hash}-{target.name}-{_slug(device_name)}-{backend}"
            f"-s{sources[:8]}")
    return name if timer == "do_bench" else f"{name}-{_slug(timer)}"


def sources_digest(space: SearchSpace, backend: Any) -> str:
    """sha256 over the sha256s of every distinct source the space renders (one per render
    fragment point; launch parameters share a source). A point the target cannot build has no
    source (the CUDA wgmma kernel's traits refuse to render one) and is left out."""
    shas = set()
    seen: set[str] = set()
    for cfg in space.configs():
        if cfg.render_name not in seen:
            seen.add(cfg.render_name)
            if space.violations(cfg):
                continue
            shas.add(backend.render(space.spec, cfg, space.target).sha256)
    return hashlib.sha256("\n".join(sorted(shas)).encode()).hexdigest()


def default_storage_url(db_path: Path) -> str:
    """SQLite file ``optuna.sqlite`` next to the tilegen DB."""
    return f"sqlite:///{db_path.parent / OPTUNA_FILENAME}"


def open_storage(optuna: Any, url: str, kwargs: dict[str, Any]) -> Any:
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


def serialize_sqlite(storage: Any) -> None:
    """Make every transaction of an Optuna SQLite storage take the write lock up front.

    Python's sqlite3 module runs a SELECT outside any transaction and BEGINs only before the
    UPDATE, and SQLite ignores SELECT ... FOR UPDATE: two workers popping the same enqueued trial
    could both see it WAITING and both run it. With BEGIN IMMEDIATE (SQLAlchemy's recipe for
    serializable SQLite) Optuna's check-and-set of a trial's state is atomic across threads and
    processes. PostgreSQL storages honour FOR UPDATE and are left alone."""
    from sqlalchemy import event

    engine = storage.engine

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened before the listeners are dropped


def retry_callback(optuna: Any) -> Any:
    """Optuna's retry-on-stale-heartbeat callback (``RetryFailedTrialCallback`` before 4.9)."""
    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    if cls is None:
        cls = optuna.storages.RetryFailedTrialCallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(max_retry=MAX_RETRIES)


def record_first_heartbeat(trial: Any) -> None:
    """Write the trial's heartbeat now, from the objective, before any work.

    Optuna beats from a thread it starts beside the objective, and a trial with no heartbeat row
    is never stale to it. Under load that thread's first write can lose the SQLite lock to the
    objective's own writes for longer than the trial takes to reach a worker; a session killed
    then left the trial RUNNING for good, never failed nor queued again. Racing the thread is
    safe: Optuna ignores the loser's unique-key violation."""
    storage = trial.storage
    if getattr(storage, "get_heartbeat_interval", lambda: None)() is not None:
        storage.record_heartbeat(trial._trial_id)


def open_study_storage(optuna: Any, url: str, heartbeat_s: int) -> Any:
    """The study's RDB storage with heartbeats (a trial silent for GRACE_INTERVALS beats is
    stale, and Optuna's callback queues it again); SQLite files get their folder, a lock wait
    and serialized transactions."""
    kwargs: dict[str, Any] = {"heartbeat_interval": heartbeat_s,
                              "grace_period": heartbeat_s * GRACE_INTERVALS}
    if url.startswith("sqlite"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental / deprecation notes
        kwargs["heartbeat_stale_trial_callback" if hasattr(
            optuna.storages, "RetryHeartbeatStaleTrialCallback")
            else "failed_trial_callback"] = retry_callback(optuna)
        storage = open_storage(optuna, url, kwargs)
    if url.startswith("sqlite"):
        serialize_sqlite(storage)
    return storage
