"""``TuningDB``: the tables' access (workloads, environments, candidates, studies, winners).

The DB knows little about the rest of tilegen: a spec is a hash string, a kernel hash and a
JSON object, a variant is a `tilegen.identity.VariantKey` as a dict, a device is a few strings.
Callers compute those. Which winner to keep is `tilegen.db.policy.decide`; opening the file
(read-only or read-write, checks) is `tilegen.db.engine`; export and import are
`tilegen.db.exchange`. Do not share a ``TuningDB`` across ``fork()``: open one per process.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, TypeVar

from sqlalchemy import Engine, func, select
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from tilegen.db import policy
from tilegen.db.engine import (
    DEFAULT_BUSY_TIMEOUT_MS,
    WRITE_OPTION,
    check_writable,
    inspect_file,
    is_locked,
    make_engine,
    resolve_db_path,
    translate,
)
from tilegen.db.errors import ConflictError, SchemaVersionError, TuningDBError
from tilegen.db.migrations import MIGRATIONS, Migration, check_version, read_version, upgrade
from tilegen.db.models import (
    ENV_FIELDS,
    SCHEMA_VERSION,
    Candidate,
    Environment,
    Study,
    Winner,
    Workload,
    utcnow,
)

T = TypeVar("T")

#: Fields of a variant key, in `tilegen.identity.VariantKey` order.
VARIANT_FIELDS: tuple[str, ...] = ("kernel_hash", "backend", "config", "source_sha256",
                                   "toolchain", "target")
_LOCK_RETRIES = 8

#: ``currency(variant, config, spec) -> True / False / None``: does this variant key (a dict)
#: equal what this checkout renders and compiles for that config and spec (dicts); None: cannot
#: tell. See `tilegen.winners.variant_currency`.
Currency = Callable[[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]], "bool | None"]


# --------------------------------------------------------------------------- helpers


def canonical_json(obj: Any) -> str:
    """Compact, key-sorted JSON: the form stored in the DB (strict, no NaN)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def plain(obj: Any) -> Any:
    """JSON-able copy of ``obj``: tuples to lists, non-finite floats to "nan"/"inf"/"-inf"."""
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
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


def json_object(value: str | Mapping[str, Any], what: str) -> dict[str, Any]:
    obj = json.loads(value) if isinstance(value, str) else plain(value)
    if not isinstance(obj, dict):
        raise TypeError(f"{what} must be a JSON object (dict), got {type(obj).__name__}")
    canonical_json(obj)  # fail here, naming nothing stored yet, if it is not JSON-able
    return obj


def nonempty(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    return value


def finite_ms(value: Any, what: str = "median_ms") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real | str):
        raise ValueError(f"{what} must be a number, got {value!r}")
    try:
        x = float(value)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return x


def fmt_time(dt: datetime) -> str:
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: Any, what: str = "time") -> datetime:
    if text is None or text == "":
        return utcnow()
    if not isinstance(text, str):
        raise ValueError(f"{what} must be an ISO 8601 string, got {text!r}")
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{what} is not an ISO 8601 time: {text!r}") from None
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


def aware(dt: datetime | None) -> datetime:
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
        nonempty(out[required], f"environment field {required!r}")
    return out


def env_key(env: Mapping[str, Any]) -> str:
    """Stable 16-hex-digit hash of an environment's fields (``ENV_FIELDS``)."""
    norm = normalize_env(env)
    return hashlib.sha256(canonical_json(norm).encode()).hexdigest()[:16]


def normalize_variant(variant: Mapping[str, Any]) -> dict[str, str]:
    """A variant key dict with exactly `VARIANT_FIELDS`, each a non-empty string."""
    missing = [f for f in VARIANT_FIELDS if f not in variant]
    if missing:
        raise ValueError(f"variant key lacks field(s) {missing}")
    unknown = sorted(set(variant) - set(VARIANT_FIELDS))
    if unknown:
        raise ValueError(f"unknown variant key field(s) {unknown}; known: {list(VARIANT_FIELDS)}")
    return {f: nonempty(variant[f], f) for f in VARIANT_FIELDS}


def variant_digest(variant: Mapping[str, Any]) -> str:
    """sha256 of the key's canonical JSON (the same as `tilegen.identity.VariantKey.digest`)."""
    text = json.dumps(normalize_variant(variant), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def public_url(url: str) -> str:
    """A storage URL without its password (``postgresql://u:secret@h/db`` -> ``u@h/db``)."""
    from sqlalchemy.engine import make_url

    try:
        u = make_url(url)
    except Exception:  # noqa: BLE001 - not a SQLAlchemy URL: keep it as given
        return url
    return u.render_as_string(hide_password=True).replace(":***@", "@")


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class WinnerInfo:
    """A stored winner, with its workload's spec and its candidate's config and variant key."""

    spec_hash: str
    kernel_hash: str
    spec: dict[str, Any]
    backend: str
    device_name: str
    target: str
    config_name: str
    config: dict[str, Any]
    variant: dict[str, str]
    median_ms: float
    timer: str
    recorded_at: datetime
    env_key: str | None = None
    study: str = ""
    trial_number: int | None = None
    template_set_hash: str = ""

    @property
    def source_sha256(self) -> str:
        return self.variant["source_sha256"]

    @property
    def toolchain(self) -> str:
        return self.variant["toolchain"]

    def record(self, currency: Currency | None = None) -> policy.WinnerRecord:
        current = None if currency is None else currency(self.variant, self.config, self.spec)
        return policy.WinnerRecord(self.variant, self.median_ms, self.timer, self.recorded_at,
                                   current)


@dataclass(frozen=True)
class WorkloadInfo:
    """A workload and how much the DB holds about it."""

    spec_hash: str
    kernel_hash: str
    spec: dict[str, Any]
    created_at: datetime
    n_candidates: int  # of its kernel
    n_winners: int
    n_studies: int


@dataclass(frozen=True)
class StudyInfo:
    """Where a session's trials are (an Optuna study)."""

    storage: str
    name: str
    spec_hash: str
    backend: str
    device_name: str
    target: str
    timer: str
    created_at: datetime


@dataclass(frozen=True)
class WorkloadDetail:
    """``TuningDB.show``: a workload, its winners, its kernel's candidates, its studies."""

    workload: WorkloadInfo
    winners: list[WinnerInfo]
    candidates: list[dict[str, Any]]
    studies: list[StudyInfo]


@dataclass(frozen=True)
class SetWinnerResult:
    """What ``set_winner`` did: "inserted", "replaced" or "kept", and why
    (`tilegen.db.policy.decide`'s reason)."""

    action: policy.Action
    median_ms: float
    previous_ms: float | None = None
    reason: str = ""
    previous: WinnerInfo | None = None


@dataclass
class ImportReport:
    """Counts of what ``import_json`` added; all zero (winners kept) on a re-import."""

    workloads_added: int = 0
    environments_added: int = 0
    candidates_added: int = 0
    winners_inserted: int = 0
    winners_replaced: int = 0
    winners_kept: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """True when the import wrote anything."""
        return bool(self.workloads_added or self.environments_added or self.candidates_added
                    or self.winners_inserted or self.winners_replaced)


# --------------------------------------------------------------------------- the DB


class TuningDB:
    """The tuning DB. Open with ``TuningDB.open(path)``; use as a context manager or ``close()``.

    Methods take and return plain values (str, int, float, dict, dataclasses); each runs in its
    own transaction. ``session()`` gives a raw ORM session for anything else.
    """

    def __init__(self, path: Path, engine: Engine, *, readonly: bool = False) -> None:
        """Use ``TuningDB.open``; this only wires an already prepared engine."""
        self._path = path
        self._engine = engine
        self._readonly = readonly
        self._read = sessionmaker(bind=engine, expire_on_commit=False)
        self._write = sessionmaker(
            bind=engine.execution_options(**{WRITE_OPTION: True}), expire_on_commit=False
        )

    # -- lifecycle ---------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        readonly: bool = False,
        busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
        migrations: Sequence[tuple[int, Migration]] | None = None,
    ) -> TuningDB:
        """Open the DB at ``resolve_db_path(path)``.

        Read-write (default): creates the file on first use and applies pending migrations in
        one transaction. ``readonly=True``: never creates nor writes anything (SQLite
        ``mode=ro``, falling back to ``immutable=1`` on a read-only mount); the file must exist
        and be at the current schema version.

        Raises `TuningDBError` (one line: path and cause) for a file that is not a SQLite DB,
        is truncated or damaged, `DBReadOnlyError` for a write open of a read-only file, and
        `SchemaVersionError` for a file newer than ``SCHEMA_VERSION``. A bad file is left
        untouched: it is checked (`tilegen.db.engine.inspect_file`) before SQLite opens it.
        """
        db_path = resolve_db_path(path)
        if db_path.exists():
            inspect_file(db_path)
        elif readonly:
            raise TuningDBError(db_path, "does not exist")
        if readonly:
            return cls._open_readonly(db_path, busy_timeout_ms)
        check_writable(db_path)
        db_path.parent.mkdir(parents=True, exist_ok=True)
        db = cls(db_path, make_engine(db_path, readonly=False, busy_timeout_ms=busy_timeout_ms))
        try:
            db._ensure_schema(MIGRATIONS if migrations is None else migrations)
        except BaseException:
            db.close()
            raise
        return db

    @classmethod
    def _open_readonly(cls, path: Path, busy_timeout_ms: int) -> TuningDB:
        last: BaseException | None = None
        for immutable in (False, True):
            engine = make_engine(path, readonly=True, immutable=immutable,
                                 busy_timeout_ms=busy_timeout_ms)
            db = cls(path, engine, readonly=True)
            try:
                with db.session() as s:
                    version = read_version(s.connection())
            except DBAPIError as exc:
                db.close()
                last = exc
                continue  # e.g. a WAL file on a read-only mount: no -shm; try immutable
            if version is None:
                db.close()
                raise TuningDBError(path, "is a SQLite file without tilegen's tables "
                                          "(not a tuning DB)")
            try:
                check_version(version, path)
            except SchemaVersionError:
                db.close()
                raise
            if version != SCHEMA_VERSION:
                db.close()
                raise SchemaVersionError(
                    path, f"has schema version {version}, older than this tilegen's "
                    f"{SCHEMA_VERSION}; run `tilegen db migrate --db {path}` once (it is opened "
                    "read-only here)")
            return db
        assert last is not None
        raise translate(last, path) or TuningDBError(path, f"cannot be read ({last})") from None

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
    def readonly(self) -> bool:
        return self._readonly

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
        return f"TuningDB({str(self._path)!r}{', readonly' if self._readonly else ''})"

    @contextmanager
    def session(self, *, write: bool = False) -> Iterator[Session]:
        """An ORM session in one transaction: committed on success, rolled back on error.

        ``write=True`` starts the transaction with ``BEGIN IMMEDIATE`` (takes the write lock
        now, waiting up to ``busy_timeout``). No automatic retry: prefer the methods.
        """
        if write and self._readonly:
            raise TuningDBError(self._path, "was opened read-only; cannot write")
        maker = self._write if write else self._read
        with maker.begin() as session:
            yield session

    def _retry(self, fn: Callable[[Session], T], *, write: bool) -> T:
        """Run ``fn`` in a transaction; retry the whole transaction on "database is locked".
        Errors about the file itself become `TuningDBError` / `DBReadOnlyError`."""
        for attempt in range(_LOCK_RETRIES + 1):
            try:
                with self.session(write=write) as session:
                    return fn(session)
            except OperationalError as exc:
                if is_locked(exc) and attempt < _LOCK_RETRIES:
                    time.sleep(min(1.0, 0.05 * 2**attempt) * (0.5 + random.random()))
                    continue
                mapped = translate(exc, self._path)
                if mapped is not None:
                    raise mapped from exc
                raise
            except DBAPIError as exc:
                mapped = translate(exc, self._path)
                if mapped is not None:
                    raise mapped from exc
                raise
        raise AssertionError("unreachable")

    def schema_version(self) -> int | None:
        """The version stored in the file."""
        return self._retry(lambda s: read_version(s.connection()), write=False)

    # -- writes ------------------------------------------------------------------------

    def upsert_workload(self, spec_hash: str, kernel_hash: str,
                        spec_json: str | Mapping[str, Any], *,
                        created_at: datetime | None = None) -> int:
        """Insert the workload if new; return its id.

        ``spec_json`` (a JSON string or dict) is stored in canonical form. An existing
        ``spec_hash`` with a different spec or kernel hash raises ``ConflictError``.
        """
        nonempty(spec_hash, "spec_hash")
        nonempty(kernel_hash, "kernel_hash")
        spec = canonical_json(json_object(spec_json, "spec_json"))
        when = aware(created_at)
        return self._retry(
            lambda s: put_workload(s, spec_hash, kernel_hash, spec, when)[0].id, write=True)

    def upsert_environment(self, env: Mapping[str, Any]) -> int:
        """Insert the environment if new; return its id. Fields: ``ENV_FIELDS``."""
        norm = normalize_env(env)
        return self._retry(lambda s: put_environment(s, norm)[0].id, write=True)

    def add_candidate(self, variant: Mapping[str, Any], config: str | Mapping[str, Any]) -> int:
        """Insert the candidate (variant key + config) if new; return its id. On a repeat the
        first config JSON is kept."""
        key = normalize_variant(variant)
        cfg = canonical_json(json_object(config, "config"))
        return self._retry(lambda s: put_candidate(s, key, cfg)[0].id, write=True)

    def record_study(self, storage: str, name: str, spec_hash: str, *, backend: str,
                     device_name: str, target: str, timer: str) -> None:
        """Remember that the Optuna study ``name`` in ``storage`` tuned this workload."""
        url = public_url(storage)

        def run(s: Session) -> None:
            wl = workload_row(s, spec_hash)
            row = s.scalar(select(Study).where(Study.storage == url, Study.name == name))
            if row is None:
                s.add(Study(storage=url, name=name, workload_id=wl.id, backend=backend,
                            device_name=device_name, target=target, timer=timer,
                            created_at=utcnow()))

        self._retry(run, write=True)

    def set_winner(
        self,
        spec_hash: str,
        candidate_id: int,
        *,
        device_name: str,
        median_ms: float,
        timer: str,
        environment_id: int | None = None,
        study: str = "",
        trial_number: int | None = None,
        template_set_hash: str = "",
        force: bool = False,
        recorded_at: datetime | None = None,
        currency: Currency | None = None,
    ) -> SetWinnerResult:
        """Make ``candidate_id`` the winner of the spec on ``device_name`` (for the candidate's
        backend and target) if `tilegen.db.policy.decide` says so.

        ``currency`` tells the policy whether a variant key is current in this checkout
        (`tilegen.winners.variant_currency`); without it, the new winner is taken as current
        and the old one's currency as unknown.
        """
        nonempty(device_name, "device_name")
        nonempty(timer, "timer")
        ms = finite_ms(median_ms)
        when = aware(recorded_at)

        def run(s: Session) -> SetWinnerResult:
            wl = workload_row(s, spec_hash)
            cand = s.get(Candidate, int(candidate_id))
            if cand is None:
                raise KeyError(f"no candidate with id {candidate_id}")
            if cand.kernel_hash != wl.kernel_hash:
                raise ValueError(f"candidate {cand.config_name} is a variant of kernel "
                                 f"{cand.kernel_hash[:12]}, not of spec {spec_hash[:12]}'s "
                                 f"kernel {wl.kernel_hash[:12]}")
            new = Winner(workload_id=wl.id, backend=cand.backend, device_name=device_name,
                         target=cand.target, candidate_id=cand.id, median_ms=ms, timer=timer,
                         environment_id=environment_id, study=study,
                         trial_number=trial_number, template_set_hash=template_set_hash,
                         recorded_at=when)
            new_current = True if currency is None else currency(
                cand.variant(), json.loads(cand.config_json), json.loads(wl.spec_json))
            return put_winner(s, new, cand, force=force, currency=currency,
                              new_current=new_current)

        return self._retry(run, write=True)

    # -- reads -------------------------------------------------------------------------

    def winners_for_kernel(self, kernel_hash: str, backend: str, device_name: str,
                           target: str) -> list[WinnerInfo]:
        """Every winner recorded for this kernel on (backend, device name, target), one per
        tuned workload, sorted by spec hash."""

        def run(s: Session) -> list[WinnerInfo]:
            stmt = (winner_query()
                    .where(Workload.kernel_hash == kernel_hash, Winner.backend == backend,
                           Winner.device_name == device_name, Winner.target == target)
                    .order_by(Workload.spec_hash))
            return [winner_info(*row) for row in s.execute(stmt)]

        return self._retry(run, write=False)

    def winners(self, spec_hash: str | None = None) -> list[WinnerInfo]:
        """All winners (of one spec), sorted by (spec hash, backend, device, target)."""

        def run(s: Session) -> list[WinnerInfo]:
            stmt = winner_query().order_by(Workload.spec_hash, Winner.backend,
                                           Winner.device_name, Winner.target)
            if spec_hash is not None:
                stmt = stmt.where(Workload.spec_hash == spec_hash)
            return [winner_info(*row) for row in s.execute(stmt)]

        return self._retry(run, write=False)

    def list_workloads(self) -> list[WorkloadInfo]:
        """All workloads, sorted by spec hash, with counts."""
        return self._retry(lambda s: workload_infos(s, None), write=False)

    def show(self, spec_hash: str) -> WorkloadDetail:
        """A workload, its winners, its kernel's candidates and its studies.

        Raises ``KeyError`` for an unknown spec hash.
        """

        def run(s: Session) -> WorkloadDetail:
            infos = workload_infos(s, spec_hash)
            if not infos:
                raise KeyError(f"no workload with spec hash {spec_hash!r} in the tuning DB")
            info = infos[0]
            winners = [winner_info(*row) for row in s.execute(
                winner_query().where(Workload.spec_hash == spec_hash)
                .order_by(Winner.backend, Winner.device_name, Winner.target))]
            cands = [{"variant": c.variant(), "config": json.loads(c.config_json)}
                     for c in s.scalars(select(Candidate)
                                        .where(Candidate.kernel_hash == info.kernel_hash)
                                        .order_by(Candidate.backend, Candidate.target,
                                                  Candidate.config_name))]
            studies = [StudyInfo(st.storage, st.name, spec_hash, st.backend, st.device_name,
                                 st.target, st.timer, st.created_at)
                       for st in s.scalars(select(Study).join(Workload)
                                           .where(Workload.spec_hash == spec_hash)
                                           .order_by(Study.created_at))]
            return WorkloadDetail(info, winners, cands, studies)

        return self._retry(run, write=False)

    # -- export / import (tilegen.db.exchange) -----------------------------------------

    def export_dict(self, *, spec_hash: str | None = None,
                    include_fake: bool = False) -> dict[str, Any]:
        from tilegen.db.exchange import export_dict

        return self._retry(lambda s: export_dict(s, spec_hash=spec_hash,
                                                 include_fake=include_fake), write=False)

    def export_json(self, dest: str | os.PathLike[str] | IO[str] | None = None, *,
                    spec_hash: str | None = None, include_fake: bool = False) -> str:
        """Export as deterministic JSON (see `tilegen.db.exchange.export_json`)."""
        from tilegen.db.exchange import write_export

        return write_export(self.export_dict(spec_hash=spec_hash, include_fake=include_fake),
                            dest)

    def import_json(self, src: str | os.PathLike[str] | IO[str] | Mapping[str, Any], *,
                    force: bool = False, currency: Currency | None = None) -> ImportReport:
        """Merge an export into this DB, in one transaction (`tilegen.db.exchange`)."""
        from tilegen.db.exchange import import_doc, read_export

        doc = read_export(src)
        return self._retry(lambda s: import_doc(s, doc, force=force, currency=currency),
                           write=True)


# --------------------------------------------------------------------------- row helpers
# (module functions on a Session: the import and the v1 -> v2 migration use them too)


def workload_row(s: Session, spec_hash: str) -> Workload:
    row = s.scalar(select(Workload).where(Workload.spec_hash == spec_hash))
    if row is None:
        raise KeyError(f"no workload with spec hash {spec_hash!r} in the tuning DB")
    return row


def put_workload(s: Session, spec_hash: str, kernel_hash: str, spec: str,
                 created_at: datetime) -> tuple[Workload, bool]:
    row = s.scalar(select(Workload).where(Workload.spec_hash == spec_hash))
    if row is not None:
        if row.spec_json != spec or row.kernel_hash != kernel_hash:
            raise ConflictError(
                f"workload {spec_hash} is stored with another spec:\n  stored {row.spec_json} "
                f"(kernel {row.kernel_hash})\n  given  {spec} (kernel {kernel_hash})")
        return row, False
    row = Workload(spec_hash=spec_hash, kernel_hash=kernel_hash, spec_json=spec,
                   created_at=created_at)
    s.add(row)
    s.flush()
    return row, True


def put_environment(s: Session, norm: dict[str, str]) -> tuple[Environment, bool]:
    key = env_key(norm)
    row = s.scalar(select(Environment).where(Environment.env_key == key))
    if row is not None:
        return row, False
    row = Environment(env_key=key, **norm)
    s.add(row)
    s.flush()
    return row, True


def put_candidate(s: Session, variant: dict[str, str], cfg: str,
                  created_at: datetime | None = None) -> tuple[Candidate, bool]:
    digest = variant_digest(variant)
    row = s.scalar(select(Candidate).where(Candidate.variant_digest == digest))
    if row is not None:
        return row, False
    row = Candidate(variant_digest=digest, kernel_hash=variant["kernel_hash"],
                    backend=variant["backend"], config_name=variant["config"],
                    source_sha256=variant["source_sha256"], toolchain=variant["toolchain"],
                    target=variant["target"], config_json=cfg,
                    created_at=created_at or utcnow())
    s.add(row)
    s.flush()
    return row, True


def winner_query() -> Any:
    return (select(Winner, Candidate, Workload, Environment)
            .join(Candidate, Winner.candidate_id == Candidate.id)
            .join(Workload, Winner.workload_id == Workload.id)
            .outerjoin(Environment, Winner.environment_id == Environment.id))


def winner_info(w: Winner, c: Candidate, wl: Workload, e: Environment | None) -> WinnerInfo:
    return WinnerInfo(
        spec_hash=wl.spec_hash, kernel_hash=wl.kernel_hash, spec=json.loads(wl.spec_json),
        backend=w.backend, device_name=w.device_name, target=w.target,
        config_name=c.config_name, config=json.loads(c.config_json), variant=c.variant(),
        median_ms=w.median_ms, timer=w.timer, recorded_at=w.recorded_at,
        env_key=None if e is None else e.env_key, study=w.study, trial_number=w.trial_number,
        template_set_hash=w.template_set_hash)


def put_winner(s: Session, new: Winner, cand: Candidate, *, force: bool,
               currency: Currency | None, new_current: bool | None) -> SetWinnerResult:
    """Insert, replace or keep the winner of (workload, backend, device, target), as
    `tilegen.db.policy.decide` rules."""
    found = s.execute(winner_query().where(
        Winner.workload_id == new.workload_id, Winner.backend == new.backend,
        Winner.device_name == new.device_name, Winner.target == new.target)).first()
    old_info = None if found is None else winner_info(*found)
    old = None if old_info is None else old_info.record(currency)
    decision = policy.decide(
        old, policy.WinnerRecord(cand.variant(), new.median_ms, new.timer, new.recorded_at,
                                 new_current), force=force)
    previous = None if old_info is None else old_info.median_ms
    if decision.inserted:
        s.add(new)
        s.flush()
    elif decision.replace:
        row = found[0]
        for attr in ("candidate_id", "median_ms", "timer", "environment_id", "study",
                     "trial_number", "template_set_hash", "recorded_at"):
            setattr(row, attr, getattr(new, attr))
        s.flush()
    kept_ms = new.median_ms if decision.replace else (previous or new.median_ms)
    return SetWinnerResult(decision.action, kept_ms, previous, decision.reason, old_info)


def workload_infos(s: Session, spec_hash: str | None) -> list[WorkloadInfo]:
    def counts(stmt: Any) -> dict[Any, int]:
        return {key: n for key, n in s.execute(stmt)}

    n_cand = counts(select(Candidate.kernel_hash, func.count()).group_by(Candidate.kernel_hash))
    n_win = counts(select(Winner.workload_id, func.count()).group_by(Winner.workload_id))
    n_study = counts(select(Study.workload_id, func.count()).group_by(Study.workload_id))
    stmt = select(Workload).order_by(Workload.spec_hash)
    if spec_hash is not None:
        stmt = stmt.where(Workload.spec_hash == spec_hash)
    return [
        WorkloadInfo(w.spec_hash, w.kernel_hash, json.loads(w.spec_json), w.created_at,
                     n_cand.get(w.kernel_hash, 0), n_win.get(w.id, 0), n_study.get(w.id, 0))
        for w in s.scalars(stmt)
    ]


__all__ = [
    "VARIANT_FIELDS",
    "Currency",
    "ImportReport",
    "SetWinnerResult",
    "StudyInfo",
    "TuningDB",
    "WinnerInfo",
    "WorkloadDetail",
    "WorkloadInfo",
    "canonical_json",
    "env_key",
    "normalize_env",
    "normalize_variant",
    "public_url",
    "variant_digest",
]
