"""``TuningDB``: workloads, environments, candidates, trials and winners in one SQLite file.

The DB knows nothing about the rest of tilegen: a spec is a hash string plus a JSON object, a
config is a name plus a JSON object, a device is a few strings. Callers compute those.

Concurrency: the file is in WAL mode (readers never block the writer), every connection sets
``busy_timeout``, every write transaction starts with ``BEGIN IMMEDIATE`` (it takes the write
lock up front, so two writers queue on the busy handler instead of failing on a lock upgrade),
and a write that still reports "database is locked" is retried with backoff. Do not share a
``TuningDB`` across ``fork()``: open one per process.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

from sqlalchemy import Engine, create_engine, event, func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from tilegen.cache import atomic_write
from tilegen.db.migrations import MIGRATIONS, Migration, read_version, upgrade
from tilegen.db.models import (
    ENV_FIELDS,
    SCHEMA_VERSION,
    Candidate,
    Environment,
    Trial,
    Winner,
    Workload,
    utcnow,
)
from tilegen.tune.toolchain import TOOLCHAIN_FIELDS, toolchain_key

T = TypeVar("T")

#: Default location when neither an explicit path nor ``TILEGEN_DB`` is given:
#: ``$XDG_CACHE_HOME/tilegen/tuning.sqlite``, ``XDG_CACHE_HOME`` defaulting to ``~/.cache``.
DB_FILENAME = "tuning.sqlite"
DB_ENV_VAR = "TILEGEN_DB"

#: Outcomes of a trial. "pass" is the only one that can win.
TRIAL_STATUSES: tuple[str, ...] = (
    "pass",
    "fail_correctness",
    "compile_error",
    "out_of_resources",
    "timeout",
    "illegal_memory_access",
    "runtime_error",
    "pruned",
)

# ``TOOLCHAIN_FIELDS`` and ``toolchain_key`` (imported above, re-exported by ``tilegen.db``) are
# defined in ``tilegen.tune.toolchain``, the one definition of the key that winners are
# recorded under; it is pure Python so that ``tilegen.winners`` can use it without SQLAlchemy.

EXPORT_FORMAT = "tilegen-tuning-db"
DEFAULT_BUSY_TIMEOUT_MS = 30_000
# Compiler logs can be megabytes; the head and tail hold the useful part.
MAX_ERROR_TEXT = 32_768

_WRITE_OPTION = "tilegen_write"
_LOCK_RETRIES = 8

WinnerStatus = Literal["hit", "stale", "miss"]
WinnerAction = Literal["inserted", "replaced", "kept"]


class ConflictError(ValueError):
    """The same natural key arrived with different content (e.g. one spec hash, two specs)."""


# --------------------------------------------------------------------------- helpers


def default_db_path() -> Path:
    """``$XDG_CACHE_HOME/tilegen/tuning.sqlite``, else ``~/.cache/tilegen/tuning.sqlite``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tilegen" / DB_FILENAME


def resolve_db_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The DB file to use: ``path`` if given, else ``$TILEGEN_DB``, else ``default_db_path()``."""
    if path is not None and str(path) != "":
        return Path(path).expanduser()
    env = os.environ.get(DB_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return default_db_path()


def canonical_json(obj: Any) -> str:
    """Compact, key-sorted JSON: the form stored in the DB (strict, no NaN)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def _json_object(value: str | Mapping[str, Any], what: str) -> dict[str, Any]:
    obj = json.loads(value) if isinstance(value, str) else _plain(value)
    if not isinstance(obj, dict):
        raise TypeError(f"{what} must be a JSON object (dict), got {type(obj).__name__}")
    canonical_json(obj)  # fail here, naming nothing stored yet, if it is not JSON-able
    return obj


def _plain(obj: Any) -> Any:
    """JSON-able copy of ``obj``: tuples to lists, non-finite floats to "nan"/"inf"/"-inf".

    Scores of a failing kernel are often NaN or inf; strings keep the stored JSON strict.
    """
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        x = float(obj)
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    return obj


def _nonempty(value: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    return value


def _finite(value: float | None, what: str, *, required: bool = False) -> float | None:
    if value is None:
        if required:
            raise ValueError(f"{what} is required")
        return None
    x = float(value)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return x


def _clip_error(text: str | None) -> str | None:
    if text is None or len(text) <= MAX_ERROR_TEXT:
        return text
    half = MAX_ERROR_TEXT // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n... [{cut} characters cut] ...\n{text[-half:]}"


def _fmt_time(dt: datetime) -> str:
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(text: str | None) -> datetime:
    if not text:
        return utcnow()
    dt = datetime.fromisoformat(text)
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


def _aware(dt: datetime | None) -> datetime:
    if dt is None:
        return utcnow()
    if dt.tzinfo is None:
        raise ValueError(f"expected a timezone-aware datetime, got {dt!r}")
    return dt


def normalize_env(env: Mapping[str, Any]) -> dict[str, str]:
    """``env`` with every field of ``ENV_FIELDS`` as a string (absent or None -> "").

    Unknown keys raise ``ValueError`` (a misspelt field would silently split environments).
    """
    unknown = sorted(set(env) - set(ENV_FIELDS) - {"env_key"})
    if unknown:
        raise ValueError(f"unknown environment field(s) {unknown}; known: {list(ENV_FIELDS)}")
    out = {f: "" if env.get(f) is None else str(env[f]) for f in ENV_FIELDS}
    for required in ("device_name", "arch"):
        _nonempty(out[required], f"environment field {required!r}")
    return out


def env_key(env: Mapping[str, Any]) -> str:
    """Stable 16-hex-digit hash of an environment's fields (``ENV_FIELDS``)."""
    norm = normalize_env(env)
    return hashlib.sha256(canonical_json(norm).encode()).hexdigest()[:16]


def _identity_text(tpl: str, tool: str, ms: float, when: datetime) -> str:
    return f"{ms:.4g} ms, template set {tpl[:12]}, toolchain {tool!r}, recorded {_fmt_time(when)}"


def _winner_note(
    w: Mapping[str, Any],
    res: SetWinnerResult,
    local: tuple[str, str, float, datetime],
    imported: tuple[str, str, float, datetime],
) -> str:
    """One line for ``ImportReport.notes``: what happened to a conflicting winner, and why."""
    what = f"winner of {w['spec_hash'][:12]} on {w['device_name']} ({w['arch']})"
    mine, theirs = _identity_text(*local), _identity_text(*imported)
    why = {
        "forced": "--force takes the file's winner",
        "faster": "same template set and toolchain, the imported one is faster",
        "slower": "same template set and toolchain, the local one is faster",
        "newer": "another template set or toolchain, so the times are not comparable; "
                 "the imported one was recorded later",
        "older": "another template set or toolchain, so the times are not comparable; "
                 + ("both were recorded at the same time" if local[3] == imported[3]
                    else "the local one was recorded later"),
        "current": "only the imported one matches this checkout's templates and toolchain",
        "stale": "only the local one matches this checkout's templates and toolchain",
    }.get(res.reason, res.reason)
    if res.action == "replaced":
        return f"replaced local {what} ({mine}) with the imported one ({theirs}): {why}"
    return f"kept local {what} ({mine}) over the imported one ({theirs}): {why}"


def _is_locked(exc: OperationalError) -> bool:
    msg = str(exc.orig if exc.orig is not None else exc).lower()
    return "database is locked" in msg or "database is busy" in msg or "table is locked" in msg


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class WinnerLookup:
    """Result of ``TuningDB.lookup_winner``.

    ``status`` is "hit" (use ``config``), "stale" (a winner exists for this spec and device
    kind, recorded under another template set or toolchain; do not use it, log ``message``)
    or "miss". The ``recorded_*`` fields are set for "hit" and "stale".
    """

    status: WinnerStatus
    spec_hash: str
    device_name: str
    arch: str
    current_template_set_hash: str
    current_toolchain_key: str
    recorded_template_set_hash: str | None = None
    recorded_toolchain_key: str | None = None
    config_name: str | None = None
    config: dict[str, Any] | None = None
    source_sha256: str | None = None
    median_ms: float | None = None
    recorded_at: datetime | None = None

    @property
    def hit(self) -> bool:
        """True when the winner can be used as is."""
        return self.status == "hit"

    @property
    def stale_fields(self) -> tuple[str, ...]:
        """Which identities differ: a subset of ("template_set_hash", "toolchain_key")."""
        if self.status != "stale":
            return ()
        out = []
        if self.recorded_template_set_hash != self.current_template_set_hash:
            out.append("template_set_hash")
        if self.recorded_toolchain_key != self.current_toolchain_key:
            out.append("toolchain_key")
        return tuple(out)

    @property
    def message(self) -> str:
        """One log line describing the result."""
        where = f"spec {self.spec_hash[:12]} on {self.device_name} ({self.arch})"
        if self.status == "miss":
            return f"no tuned winner for {where}"
        if self.status == "hit":
            return f"tuned winner {self.config_name} ({self.median_ms:.4g} ms) for {where}"
        diffs = []
        if "template_set_hash" in self.stale_fields:
            diffs.append(f"template set {self.recorded_template_set_hash}, "
                         f"current {self.current_template_set_hash}")
        if "toolchain_key" in self.stale_fields:
            diffs.append(f"toolchain {self.recorded_toolchain_key!r}, "
                         f"current {self.current_toolchain_key!r}")
        return (f"stale winner {self.config_name} for {where} recorded under "
                + "; ".join(diffs) + "; not used (re-tune to refresh)")


@dataclass(frozen=True)
class WorkloadInfo:
    """A workload and how much the DB holds about it."""

    spec_hash: str
    spec: dict[str, Any]
    created_at: datetime
    n_candidates: int
    n_trials: int
    n_winners: int


@dataclass(frozen=True)
class WinnerInfo:
    """A stored winner, with its candidate's config."""

    spec_hash: str
    device_name: str
    arch: str
    template_set_hash: str
    toolchain_key: str
    config_name: str
    config: dict[str, Any]
    source_sha256: str
    median_ms: float
    recorded_at: datetime


@dataclass(frozen=True)
class TrialInfo:
    """A stored trial, with its candidate's name and its environment's key."""

    study: str
    trial_number: int
    config_name: str
    source_sha256: str
    env_key: str
    device_name: str
    arch: str
    status: str
    median_ms: float | None
    tflops: float | None
    scores: Any
    error_class: str | None
    error_text: str | None
    created_at: datetime


@dataclass(frozen=True)
class WorkloadDetail:
    """``TuningDB.show``: a workload, its winners, its fastest passing trials, status counts."""

    workload: WorkloadInfo
    winners: list[WinnerInfo]
    best_trials: list[TrialInfo]
    status_counts: dict[str, int]


@dataclass(frozen=True)
class SetWinnerResult:
    """What ``set_winner`` did: "inserted", "replaced" or "kept" (the old one stays).

    ``reason`` says why: "new" (no winner before), "same" (the same winner again), "forced",
    "faster" or "slower" (same template set and toolchain: times compared), "stale" (the old
    one was recorded under another template set or toolchain, ``set_winner``), "newer" or
    "older" (another template set or toolchain: the more recent recording is kept, import),
    "current" (import: only the imported one matches the caller's current identity; the
    same word "stale" then means only the local one does).
    """

    action: WinnerAction
    median_ms: float
    previous_ms: float | None = None
    reason: str = ""


@dataclass
class ImportReport:
    """Counts of what ``import_json`` added; all zero (winners kept) on a re-import."""

    workloads_added: int = 0
    environments_added: int = 0
    candidates_added: int = 0
    trials_added: int = 0
    trials_skipped: int = 0
    winners_inserted: int = 0
    winners_replaced: int = 0
    winners_kept: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """True when the import wrote anything."""
        return bool(self.workloads_added or self.environments_added or self.candidates_added
                    or self.trials_added or self.winners_inserted or self.winners_replaced)


# --------------------------------------------------------------------------- engine


def _make_engine(path: Path, busy_timeout_ms: int) -> Engine:
    engine = create_engine(f"sqlite+pysqlite:///{path}")

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control from the sqlite3 module (it would BEGIN lazily and run DDL
        # outside transactions); "_on_begin" emits BEGIN itself.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        # busy_timeout first: switching to WAL needs a lock another process may hold.
        cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA foreign_keys = ON")
        # In WAL mode NORMAL is corruption-safe; it only risks the last commits on power loss.
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get(_WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


# --------------------------------------------------------------------------- the DB


class TuningDB:
    """The tuning DB. Create with ``TuningDB.open(path)``; use as a context manager or ``close()``.

    All methods take and return plain values (str, int, float, dict, dataclasses); each runs in
    its own transaction. ``session()`` gives a raw ORM session for anything else.
    """

    def __init__(self, path: Path, engine: Engine) -> None:
        """Use ``TuningDB.open``; this only wires an already prepared engine."""
        self._path = path
        self._engine = engine
        self._read = sessionmaker(bind=engine, expire_on_commit=False)
        self._write = sessionmaker(
            bind=engine.execution_options(**{_WRITE_OPTION: True}), expire_on_commit=False
        )

    # -- lifecycle ---------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
        migrations: Sequence[tuple[int, Migration]] | None = None,
    ) -> TuningDB:
        """Open (creating on first use) the DB at ``resolve_db_path(path)``.

        Applies pending migrations in one transaction; raises ``SchemaVersionError`` when the
        file is newer than ``SCHEMA_VERSION``. ``migrations`` overrides ``MIGRATIONS`` (tests).
        """
        db_path = resolve_db_path(path)
        db_path.parent.mkdir(parents=True, exist_ok=True)
        db = cls(db_path, _make_engine(db_path, busy_timeout_ms))
        try:
            db._ensure_schema(MIGRATIONS if migrations is None else migrations)
        except BaseException:
            db.close()
            raise
        return db

    def _ensure_schema(self, migrations: Sequence[tuple[int, Migration]]) -> None:
        # Cheap read first, so that opening an up-to-date file never waits for the write lock.
        current = self._retry(lambda s: read_version(s.connection()), write=False)
        if current == SCHEMA_VERSION:
            return
        self._retry(lambda s: upgrade(s.connection(), migrations=migrations), write=True)

    @property
    def path(self) -> Path:
        """The SQLite file."""
        return self._path

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (read transactions; use ``session(write=True)`` to write)."""
        return self._engine

    def close(self) -> None:
        """Release all connections."""
        self._engine.dispose()

    def __enter__(self) -> TuningDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TuningDB({str(self._path)!r})"

    @contextmanager
    def session(self, *, write: bool = False) -> Iterator[Session]:
        """An ORM session in one transaction: committed on success, rolled back on error.

        ``write=True`` starts the transaction with ``BEGIN IMMEDIATE`` (takes the write lock
        now, waiting up to ``busy_timeout``). No automatic retry: prefer the methods.
        """
        maker = self._write if write else self._read
        with maker.begin() as session:
            yield session

    def _retry(self, fn: Callable[[Session], T], *, write: bool) -> T:
        """Run ``fn`` in a transaction; retry the whole transaction on "database is locked"."""
        for attempt in range(_LOCK_RETRIES + 1):
            try:
                with self.session(write=write) as session:
                    return fn(session)
            except OperationalError as exc:
                if not _is_locked(exc) or attempt == _LOCK_RETRIES:
                    raise
                time.sleep(min(1.0, 0.05 * 2**attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def schema_version(self) -> int | None:
        """The version stored in the file."""
        return self._retry(lambda s: read_version(s.connection()), write=False)

    # -- writes ------------------------------------------------------------------------

    def upsert_workload(
        self,
        spec_hash: str,
        spec_json: str | Mapping[str, Any],
        *,
        created_at: datetime | None = None,
    ) -> int:
        """Insert the workload if new; return its id.

        ``spec_json`` (a JSON string or dict) is stored in canonical form. An existing
        ``spec_hash`` with a different spec raises ``ConflictError``.
        """
        _nonempty(spec_hash, "spec_hash")
        spec = canonical_json(_json_object(spec_json, "spec_json"))
        when = _aware(created_at)
        return self._retry(lambda s: self._put_workload(s, spec_hash, spec, when)[0].id,
                           write=True)

    @staticmethod
    def _put_workload(
        s: Session, spec_hash: str, spec: str, created_at: datetime
    ) -> tuple[Workload, bool]:
        row = s.scalar(select(Workload).where(Workload.spec_hash == spec_hash))
        if row is not None:
            if row.spec_json != spec:
                raise ConflictError(
                    f"workload {spec_hash} is stored with another spec:\n  stored {row.spec_json}"
                    f"\n  given  {spec}"
                )
            return row, False
        row = Workload(spec_hash=spec_hash, spec_json=spec, created_at=created_at)
        s.add(row)
        s.flush()
        return row, True

    def upsert_environment(self, env: Mapping[str, Any]) -> int:
        """Insert the environment if new; return its id. Fields: ``ENV_FIELDS``."""
        norm = normalize_env(env)
        return self._retry(lambda s: self._put_environment(s, norm)[0].id, write=True)

    @staticmethod
    def _put_environment(s: Session, norm: dict[str, str]) -> tuple[Environment, bool]:
        key = env_key(norm)
        row = s.scalar(select(Environment).where(Environment.env_key == key))
        if row is not None:
            return row, False
        row = Environment(env_key=key, **norm)
        s.add(row)
        s.flush()
        return row, True

    def add_candidate(
        self,
        spec_hash: str,
        config_name: str,
        config: str | Mapping[str, Any],
        source_sha256: str,
    ) -> int:
        """Insert the candidate if new; return its id. The workload must exist.

        Identity is (workload, config_name, source_sha256); on a repeat the first config JSON
        is kept.
        """
        _nonempty(config_name, "config_name")
        _nonempty(source_sha256, "source_sha256")
        cfg = canonical_json(_json_object(config, "config"))

        def run(s: Session) -> int:
            workload = self._workload(s, spec_hash)
            return self._put_candidate(s, workload.id, config_name, cfg, source_sha256)[0].id

        return self._retry(run, write=True)

    @staticmethod
    def _put_candidate(
        s: Session, workload_id: int, name: str, cfg: str, sha: str
    ) -> tuple[Candidate, bool]:
        row = s.scalar(
            select(Candidate).where(
                Candidate.workload_id == workload_id,
                Candidate.config_name == name,
                Candidate.source_sha256 == sha,
            )
        )
        if row is not None:
            return row, False
        row = Candidate(workload_id=workload_id, config_name=name, config_json=cfg,
                        source_sha256=sha)
        s.add(row)
        s.flush()
        return row, True

    def record_trial(
        self,
        study: str,
        trial_number: int,
        candidate_id: int,
        environment_id: int,
        status: str,
        *,
        median_ms: float | None = None,
        tflops: float | None = None,
        scores: Any = None,
        error_class: str | None = None,
        error_text: str | None = None,
        created_at: datetime | None = None,
    ) -> int:
        """Record a trial; return its id. Idempotent on (study, trial_number).

        A repeat of the same (study, trial_number) updates that row to the given values (a
        resumed study re-reports a trial; the latest report is its final state). ``status``
        must be in ``TRIAL_STATUSES``; "pass" needs ``median_ms``. ``scores`` is any JSON-able
        value (per-capture scores); non-finite floats are stored as "nan"/"inf"/"-inf".
        Long ``error_text`` is cut to its head and tail.
        """
        _nonempty(study, "study")
        if status not in TRIAL_STATUSES:
            raise ValueError(f"trial status {status!r} is not one of {TRIAL_STATUSES}")
        values = {
            "candidate_id": int(candidate_id),
            "environment_id": int(environment_id),
            "status": status,
            "median_ms": _finite(median_ms, "median_ms", required=status == "pass"),
            "tflops": _finite(tflops, "tflops"),
            "scores_json": None if scores is None else canonical_json(_plain(scores)),
            "error_class": error_class,
            "error_text": _clip_error(error_text),
            "created_at": _aware(created_at),
        }
        number = int(trial_number)

        def run(s: Session) -> int:
            if s.get(Candidate, values["candidate_id"]) is None:
                raise KeyError(f"no candidate with id {candidate_id}")
            if s.get(Environment, values["environment_id"]) is None:
                raise KeyError(f"no environment with id {environment_id}")
            row = s.scalar(
                select(Trial).where(Trial.study == study, Trial.trial_number == number)
            )
            if row is None:
                row = Trial(study=study, trial_number=number, **values)
                s.add(row)
            else:
                for key, value in values.items():
                    setattr(row, key, value)
            s.flush()
            return row.id

        return self._retry(run, write=True)

    def set_winner(
        self,
        spec_hash: str,
        candidate_id: int,
        *,
        device_name: str,
        arch: str,
        template_set_hash: str,
        toolchain_key: str,
        median_ms: float,
        force: bool = False,
        recorded_at: datetime | None = None,
    ) -> SetWinnerResult:
        """Make ``candidate_id`` the winner of the spec on (device_name, arch) if it should be.

        One winner per (spec, device_name, arch). An existing winner is replaced when the new
        one is faster, when ``force``, or when the existing one was recorded under another
        template set or toolchain (its time is not comparable, and it would only ever be
        reported stale). Otherwise it is kept.
        """
        for what, value in (("device_name", device_name), ("arch", arch),
                            ("template_set_hash", template_set_hash),
                            ("toolchain_key", toolchain_key)):
            _nonempty(value, what)
        ms = _finite(median_ms, "median_ms", required=True)
        assert ms is not None
        when = _aware(recorded_at)

        def run(s: Session) -> SetWinnerResult:
            workload = self._workload(s, spec_hash)
            cand = s.get(Candidate, int(candidate_id))
            if cand is None or cand.workload_id != workload.id:
                raise ValueError(f"candidate {candidate_id} is not a candidate of {spec_hash}")
            return self._put_winner(s, workload.id, cand.id, device_name, arch,
                                    template_set_hash, toolchain_key, ms, when,
                                    force=force, other_identity="replace")

        return self._retry(run, write=True)

    @staticmethod
    def _winner_row(s: Session, workload_id: int, device_name: str, arch: str) -> Winner | None:
        return s.scalar(
            select(Winner).where(
                Winner.workload_id == workload_id,
                Winner.device_name == device_name,
                Winner.arch == arch,
            )
        )

    @staticmethod
    def _put_winner(
        s: Session,
        workload_id: int,
        candidate_id: int,
        device_name: str,
        arch: str,
        template_set_hash: str,
        toolchain: str,
        median_ms: float,
        recorded_at: datetime,
        *,
        force: bool,
        other_identity: Literal["replace", "newer"],
        current: tuple[str, str] | None = None,
    ) -> SetWinnerResult:
        """Insert, replace or keep the winner of (workload, device_name, arch).

        Times are compared only between winners of the same (template set, toolchain). With
        another identity, ``other_identity`` decides: "replace" (``set_winner``: a fresh
        measurement beats a stale one) or "newer" (import). On import, when ``current`` (this
        process's (template set hash, toolchain key)) is given and exactly one of the two
        winners matches it, that one wins: the other would only be reported stale. Otherwise
        the more recent ``recorded_at`` wins. ``force`` always replaces.
        """
        row = TuningDB._winner_row(s, workload_id, device_name, arch)
        if row is None:
            s.add(Winner(workload_id=workload_id, device_name=device_name, arch=arch,
                         template_set_hash=template_set_hash, toolchain_key=toolchain,
                         candidate_id=candidate_id, median_ms=median_ms,
                         recorded_at=recorded_at))
            s.flush()
            return SetWinnerResult("inserted", median_ms, reason="new")
        previous = row.median_ms
        same_identity = (row.template_set_hash == template_set_hash
                         and row.toolchain_key == toolchain)
        if same_identity and row.candidate_id == candidate_id and row.median_ms == median_ms:
            return SetWinnerResult("kept", row.median_ms, previous, reason="same")
        if force:
            reason, replace = "forced", True
        elif same_identity:
            replace = median_ms < row.median_ms
            reason = "faster" if replace else "slower"
        elif other_identity == "replace":
            reason, replace = "stale", True
        elif current is not None and (
                ((template_set_hash, toolchain) == current)
                != ((row.template_set_hash, row.toolchain_key) == current)):
            replace = (template_set_hash, toolchain) == current
            reason = "current" if replace else "stale"
        else:
            replace = recorded_at > row.recorded_at
            reason = "newer" if replace else "older"
        if not replace:
            return SetWinnerResult("kept", row.median_ms, previous, reason=reason)
        row.candidate_id = candidate_id
        row.template_set_hash = template_set_hash
        row.toolchain_key = toolchain
        row.median_ms = median_ms
        row.recorded_at = recorded_at
        s.flush()
        return SetWinnerResult("replaced", median_ms, previous, reason=reason)

    # -- reads -------------------------------------------------------------------------

    @staticmethod
    def _workload(s: Session, spec_hash: str) -> Workload:
        row = s.scalar(select(Workload).where(Workload.spec_hash == spec_hash))
        if row is None:
            raise KeyError(f"no workload with spec hash {spec_hash!r} in the tuning DB")
        return row

    def lookup_winner(
        self,
        spec_hash: str,
        device_name: str,
        arch: str,
        template_set_hash: str,
        toolchain_key: str,
    ) -> WinnerLookup:
        """The winner for the spec on this device kind, checked against the current identity.

        "hit" when the stored template-set hash and toolchain key equal the given ones,
        "stale" when a winner exists under other ones, "miss" when there is none.
        """

        def run(s: Session) -> WinnerLookup:
            found = s.execute(
                select(Winner, Candidate)
                .join(Workload, Winner.workload_id == Workload.id)
                .join(Candidate, Winner.candidate_id == Candidate.id)
                .where(Workload.spec_hash == spec_hash, Winner.device_name == device_name,
                       Winner.arch == arch)
            ).first()
            base = {"spec_hash": spec_hash, "device_name": device_name, "arch": arch,
                    "current_template_set_hash": template_set_hash,
                    "current_toolchain_key": toolchain_key}
            if found is None:
                return WinnerLookup(status="miss", **base)
            win, cand = found
            fresh = (win.template_set_hash == template_set_hash
                     and win.toolchain_key == toolchain_key)
            return WinnerLookup(
                status="hit" if fresh else "stale",
                recorded_template_set_hash=win.template_set_hash,
                recorded_toolchain_key=win.toolchain_key,
                config_name=cand.config_name,
                config=json.loads(cand.config_json),
                source_sha256=cand.source_sha256,
                median_ms=win.median_ms,
                recorded_at=win.recorded_at,
                **base,
            )

        return self._retry(run, write=False)

    def list_workloads(self) -> list[WorkloadInfo]:
        """All workloads, sorted by spec hash, with counts of candidates, trials and winners."""
        return self._retry(lambda s: self._workload_infos(s, None), write=False)

    @staticmethod
    def _workload_infos(s: Session, spec_hash: str | None) -> list[WorkloadInfo]:
        def counts(stmt: Any) -> dict[int, int]:
            return {wid: n for wid, n in s.execute(stmt)}

        n_cand = counts(select(Candidate.workload_id, func.count()).group_by(
            Candidate.workload_id))
        n_trial = counts(select(Candidate.workload_id, func.count(Trial.id))
                         .join(Trial, Trial.candidate_id == Candidate.id)
                         .group_by(Candidate.workload_id))
        n_win = counts(select(Winner.workload_id, func.count()).group_by(Winner.workload_id))
        stmt = select(Workload).order_by(Workload.spec_hash)
        if spec_hash is not None:
            stmt = stmt.where(Workload.spec_hash == spec_hash)
        return [
            WorkloadInfo(w.spec_hash, json.loads(w.spec_json), w.created_at,
                         n_cand.get(w.id, 0), n_trial.get(w.id, 0), n_win.get(w.id, 0))
            for w in s.scalars(stmt)
        ]

    def show(self, spec_hash: str, *, best: int = 10) -> WorkloadDetail:
        """A workload, its winners, its ``best`` fastest passing trials and status counts.

        Raises ``KeyError`` for an unknown spec hash.
        """

        def run(s: Session) -> WorkloadDetail:
            infos = self._workload_infos(s, spec_hash)
            if not infos:
                raise KeyError(f"no workload with spec hash {spec_hash!r} in the tuning DB")
            winners = [
                WinnerInfo(spec_hash, w.device_name, w.arch, w.template_set_hash,
                           w.toolchain_key, c.config_name, json.loads(c.config_json),
                           c.source_sha256, w.median_ms, w.recorded_at)
                for w, c in s.execute(
                    select(Winner, Candidate)
                    .join(Candidate, Winner.candidate_id == Candidate.id)
                    .join(Workload, Winner.workload_id == Workload.id)
                    .where(Workload.spec_hash == spec_hash)
                    .order_by(Winner.device_name, Winner.arch)
                )
            ]
            trials = self._trial_query(s, spec_hash).where(Trial.status == "pass").order_by(
                Trial.median_ms, Trial.study, Trial.trial_number).limit(best)
            counts = s.execute(
                select(Trial.status, func.count())
                .join(Candidate, Trial.candidate_id == Candidate.id)
                .join(Workload, Candidate.workload_id == Workload.id)
                .where(Workload.spec_hash == spec_hash)
                .group_by(Trial.status)
            )
            return WorkloadDetail(
                workload=infos[0],
                winners=winners,
                best_trials=[self._trial_info(*row) for row in s.execute(trials)],
                status_counts={status: n for status, n in sorted(counts)},
            )

        return self._retry(run, write=False)

    @staticmethod
    def _trial_query(s: Session, spec_hash: str | None) -> Any:
        stmt = (select(Trial, Candidate, Environment, Workload.spec_hash)
                .join(Candidate, Trial.candidate_id == Candidate.id)
                .join(Environment, Trial.environment_id == Environment.id)
                .join(Workload, Candidate.workload_id == Workload.id))
        if spec_hash is not None:
            stmt = stmt.where(Workload.spec_hash == spec_hash)
        return stmt

    @staticmethod
    def _trial_info(t: Trial, c: Candidate, e: Environment, _spec_hash: str) -> TrialInfo:
        return TrialInfo(
            study=t.study, trial_number=t.trial_number, config_name=c.config_name,
            source_sha256=c.source_sha256, env_key=e.env_key, device_name=e.device_name,
            arch=e.arch, status=t.status, median_ms=t.median_ms, tflops=t.tflops,
            scores=None if t.scores_json is None else json.loads(t.scores_json),
            error_class=t.error_class, error_text=t.error_text, created_at=t.created_at,
        )

    # -- export / import ---------------------------------------------------------------

    def export_dict(
        self, *, spec_hash: str | None = None, include_trials: bool = False
    ) -> dict[str, Any]:
        """The export document as a dict (see ``export_json``)."""

        def run(s: Session) -> dict[str, Any]:
            wl_stmt = select(Workload).order_by(Workload.spec_hash)
            if spec_hash is not None:
                wl_stmt = wl_stmt.where(Workload.spec_hash == spec_hash)
            workloads = list(s.scalars(wl_stmt))
            if spec_hash is not None and not workloads:
                raise KeyError(f"no workload with spec hash {spec_hash!r} in the tuning DB")
            ids = {w.id: w.spec_hash for w in workloads}

            candidates = [c for c in s.scalars(select(Candidate)) if c.workload_id in ids]
            winners = [
                (w, c) for w, c in s.execute(
                    select(Winner, Candidate).join(Candidate, Winner.candidate_id == Candidate.id))
                if w.workload_id in ids
            ]
            hashes = set(ids.values())
            trial_rows = [r for r in s.execute(self._trial_query(s, None)) if r[3] in hashes]
            if spec_hash is None:
                envs = list(s.scalars(select(Environment)))
            else:  # the environments this workload's trials ran in
                seen = {r[2].id: r[2] for r in trial_rows}
                envs = list(seen.values())

            doc: dict[str, Any] = {
                "format": EXPORT_FORMAT,
                "schema_version": SCHEMA_VERSION,
                "workloads": [
                    {"spec_hash": w.spec_hash, "spec": json.loads(w.spec_json),
                     "created_at": _fmt_time(w.created_at)}
                    for w in workloads
                ],
                "environments": sorted(
                    ({"env_key": e.env_key, **{f: getattr(e, f) for f in ENV_FIELDS}}
                     for e in envs),
                    key=lambda d: d["env_key"],
                ),
                "candidates": sorted(
                    ({"spec_hash": ids[c.workload_id], "config_name": c.config_name,
                      "source_sha256": c.source_sha256, "config": json.loads(c.config_json)}
                     for c in candidates),
                    key=lambda d: (d["spec_hash"], d["config_name"], d["source_sha256"]),
                ),
                "winners": sorted(
                    ({"spec_hash": ids[w.workload_id], "device_name": w.device_name,
                      "arch": w.arch, "template_set_hash": w.template_set_hash,
                      "toolchain_key": w.toolchain_key, "config_name": c.config_name,
                      "source_sha256": c.source_sha256, "median_ms": w.median_ms,
                      "recorded_at": _fmt_time(w.recorded_at)}
                     for w, c in winners),
                    key=lambda d: (d["spec_hash"], d["device_name"], d["arch"]),
                ),
            }
            if include_trials:
                doc["trials"] = sorted(
                    ({"study": t.study, "trial_number": t.trial_number, "spec_hash": h,
                      "config_name": c.config_name, "source_sha256": c.source_sha256,
                      "env_key": e.env_key, "status": t.status, "median_ms": t.median_ms,
                      "tflops": t.tflops,
                      "scores": None if t.scores_json is None else json.loads(t.scores_json),
                      "error_class": t.error_class, "error_text": t.error_text,
                      "created_at": _fmt_time(t.created_at)}
                     for t, c, e, h in trial_rows),
                    key=lambda d: (d["study"], d["trial_number"]),
                )
            return doc

        return self._retry(run, write=False)

    def export_json(
        self,
        dest: str | os.PathLike[str] | IO[str] | None = None,
        *,
        spec_hash: str | None = None,
        include_trials: bool = False,
    ) -> str:
        """Export as deterministic JSON (sorted keys and rows, indent 2); return the text.

        ``dest`` is a path (written atomically), an open text file, or None (text only).
        ``spec_hash`` limits the export to one workload (and the environments of its trials).
        Trials are left out unless ``include_trials``. The format is in ``tuning_db/README.md``.
        """
        doc = self.export_dict(spec_hash=spec_hash, include_trials=include_trials)
        text = json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False,
                          allow_nan=False) + "\n"
        if dest is None:
            return text
        if not isinstance(dest, str | os.PathLike):
            dest.write(text)
            return text
        # Atomic: a reader (or a crash) never sees a half-written export.
        atomic_write(Path(dest), text)
        return text

    def import_json(
        self,
        src: str | os.PathLike[str] | IO[str] | Mapping[str, Any],
        *,
        force: bool = False,
        current: tuple[str, str] | None = None,
    ) -> ImportReport:
        """Merge an export into this DB, in one transaction. Re-importing is a no-op.

        Existing rows are kept (trials too: a local trial with the same (study, number) wins).
        A winner conflict (same spec, device name and arch) is settled by:

        - ``force``: the file's winner replaces the local one;
        - the same template set and toolchain: the faster one is kept;
        - another template set or toolchain: the times are not comparable. When ``current``
          (the caller's (template set hash, toolchain key), as `tilegen.load` would match) is
          given and only one of the two matches it, that one is kept; otherwise the one with
          the later ``recorded_at`` is kept, and a tie keeps the local one.

        Every conflict that is not the same winner again gets a line in the report's ``notes``.
        ``src`` is a path, an open text file, or an already parsed document.
        """
        if isinstance(src, Mapping):
            doc: Any = src
        elif isinstance(src, str | os.PathLike):
            doc = json.loads(Path(src).read_text(encoding="utf-8"))
        else:
            doc = json.loads(src.read())
        if not isinstance(doc, Mapping) or doc.get("format") != EXPORT_FORMAT:
            raise ValueError(f"not a tilegen tuning DB export (format must be {EXPORT_FORMAT!r})")
        version = doc.get("schema_version")
        if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
            raise ValueError(
                f"export has schema version {version!r}; this tilegen reads 1..{SCHEMA_VERSION}"
            )
        return self._retry(lambda s: self._import(s, doc, force, current), write=True)

    def _import(self, s: Session, doc: Mapping[str, Any], force: bool,
                current: tuple[str, str] | None = None) -> ImportReport:
        rep = ImportReport()
        wl: dict[str, int] = {}
        for w in doc.get("workloads", []):
            h = _nonempty(w["spec_hash"], "spec_hash")
            spec = canonical_json(_json_object(w["spec"], f"spec of {h}"))
            row, added = self._put_workload(s, h, spec, _parse_time(w.get("created_at")))
            wl[h] = row.id
            rep.workloads_added += added

        envs: dict[str, int] = {}
        for e in doc.get("environments", []):
            norm = normalize_env(e)
            row, added = self._put_environment(s, norm)
            # Map the file's key to ours (the same unless the key function ever changes).
            envs[e.get("env_key") or row.env_key] = row.id
            rep.environments_added += added

        def workload_id(h: str) -> int:
            if h not in wl:
                wl[h] = self._workload(s, h).id
            return wl[h]

        cands: dict[tuple[str, str, str], int] = {}
        for c in doc.get("candidates", []):
            key = (c["spec_hash"], c["config_name"], c["source_sha256"])
            cfg = canonical_json(_json_object(c["config"], f"config {key[1]}"))
            row, added = self._put_candidate(s, workload_id(key[0]), key[1], cfg, key[2])
            cands[key] = row.id
            rep.candidates_added += added

        def candidate_id(h: str, name: str, sha: str) -> int:
            key = (h, name, sha)
            if key not in cands:
                row = s.scalar(select(Candidate).where(
                    Candidate.workload_id == workload_id(h), Candidate.config_name == name,
                    Candidate.source_sha256 == sha))
                if row is None:
                    raise KeyError(f"export refers to unknown candidate {name} ({sha}) of {h}")
                cands[key] = row.id
            return cands[key]

        for t in doc.get("trials", []):
            exists = s.scalar(select(Trial.id).where(Trial.study == t["study"],
                                                     Trial.trial_number == t["trial_number"]))
            if exists is not None:
                rep.trials_skipped += 1
                continue
            if t["env_key"] not in envs:
                raise KeyError(f"trial {t['study']}#{t['trial_number']} refers to unknown "
                               f"environment {t['env_key']}")
            if t["status"] not in TRIAL_STATUSES:
                raise ValueError(f"trial status {t['status']!r} is not one of {TRIAL_STATUSES}")
            s.add(Trial(
                candidate_id=candidate_id(t["spec_hash"], t["config_name"], t["source_sha256"]),
                environment_id=envs[t["env_key"]], study=t["study"],
                trial_number=int(t["trial_number"]), status=t["status"],
                median_ms=_finite(t.get("median_ms"), "median_ms"),
                tflops=_finite(t.get("tflops"), "tflops"),
                scores_json=None if t.get("scores") is None
                else canonical_json(_plain(t["scores"])),
                error_class=t.get("error_class"), error_text=t.get("error_text"),
                created_at=_parse_time(t.get("created_at")),
            ))
            s.flush()
            rep.trials_added += 1

        for w in doc.get("winners", []):
            ms = _finite(w["median_ms"], "median_ms", required=True)
            assert ms is not None
            wid = workload_id(w["spec_hash"])
            when = _parse_time(w.get("recorded_at"))
            prev = self._winner_row(s, wid, w["device_name"], w["arch"])
            # Snapshot: _put_winner updates the row in place when it replaces it.
            before = None if prev is None else (
                prev.template_set_hash, prev.toolchain_key, prev.median_ms, prev.recorded_at)
            res = self._put_winner(
                s, wid, candidate_id(w["spec_hash"], w["config_name"], w["source_sha256"]),
                w["device_name"], w["arch"], w["template_set_hash"], w["toolchain_key"],
                ms, when, force=force, other_identity="newer", current=current)
            if res.action == "inserted":
                rep.winners_inserted += 1
            elif res.action == "replaced":
                rep.winners_replaced += 1
            else:
                rep.winners_kept += 1
            if before is not None and res.reason != "same":
                rep.notes.append(_winner_note(
                    w, res, before, (w["template_set_hash"], w["toolchain_key"], ms, when)))
        return rep


def merge_export_file(
    dest: str | os.PathLike[str], doc: Mapping[str, Any],
    current: tuple[str, str] | None = None,
) -> ImportReport | None:
    """Write the export ``doc`` to the file ``dest``, merged with the export already there.

    When ``dest`` does not exist, ``doc`` is written as is (the same bytes as ``export_json``)
    and None is returned. Otherwise the existing file and then ``doc`` are imported into a
    throwaway DB, and the union is exported over ``dest`` (atomically, sorted, deterministic):
    rows of both are kept, winner conflicts follow ``import_json``'s rules (``doc`` is the
    import), and trials are kept only when the existing file has them. Merging the same
    ``doc`` again gives the same bytes. Returns the report of importing ``doc``, whose
    ``notes`` explain winner conflicts. An existing file that is not an export raises
    ``ValueError`` naming it, and is left as it was.
    """
    out = Path(dest)
    if not out.exists():
        text = json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False,
                          allow_nan=False) + "\n"
        atomic_write(out, text)
        return None
    try:
        existing = json.loads(out.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"cannot merge into {out}: not JSON ({exc})") from exc
    with tempfile.TemporaryDirectory(prefix="tilegen-merge-") as tmp:
        with TuningDB.open(Path(tmp) / DB_FILENAME) as db:
            try:
                db.import_json(existing)
            except (KeyError, ValueError) as exc:
                detail = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
                raise ValueError(f"cannot merge into {out}: {detail}") from exc
            report = db.import_json(doc, current=current)
            include_trials = isinstance(existing, Mapping) and "trials" in existing
            db.export_json(out, include_trials=include_trials)
    return report


__all__ = [
    "DB_ENV_VAR",
    "ENV_FIELDS",
    "EXPORT_FORMAT",
    "TOOLCHAIN_FIELDS",
    "TRIAL_STATUSES",
    "ConflictError",
    "ImportReport",
    "SetWinnerResult",
    "TrialInfo",
    "TuningDB",
    "WinnerInfo",
    "WinnerLookup",
    "WorkloadDetail",
    "WorkloadInfo",
    "canonical_json",
    "default_db_path",
    "env_key",
    "merge_export_file",
    "normalize_env",
    "resolve_db_path",
    "toolchain_key",
]
