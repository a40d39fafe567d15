"""``TuningDB``: the tables' access (workloads, environments, candidates, studies, winners).

The DB knows little about the rest of tilegen: a spec is a hash string, a kernel hash and a
JSON object, a variant is a `tilegen.identity.VariantKey` as a dict, a device is a few strings.
Callers compute those. Which winner to keep is `tilegen.db.policy.decide`; opening the file
(read-only or read-write, checks) is `tilegen.db.engine`; export and import are
`tilegen.db.exchange`. Do not share a ``TuningDB`` across ``fork()``: open one per process.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, Any, TypeVar

from sqlalchemy import Engine, select
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

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
from tilegen.db.errors import SchemaVersionError, TuningDBError
from tilegen.db.migrations import MIGRATIONS, Migration, check_version, read_version, upgrade
from tilegen.db.models import (
    SCHEMA_VERSION,
    Candidate,
    Study,
    Winner,
    Workload,
    utcnow,
)
from tilegen.db.rows import (  # noqa: F401 - the row types are also this module's API
    _LOCK_RETRIES,
    VARIANT_FIELDS,
    Currency,
    ImportReport,
    SetWinnerResult,
    StudyInfo,
    WinnerInfo,
    WorkloadDetail,
    WorkloadInfo,
    aware,
    canonical_json,
    env_key,
    finite_ms,
    json_object,
    nonempty,
    normalize_env,
    normalize_variant,
    public_url,
    put_candidate,
    put_environment,
    put_winner,
    put_workload,
    variant_digest,
    winner_info,
    winner_query,
    workload_infos,
    workload_row,
)

T = TypeVar("T")


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


def merge_export_file(dest: str | os.PathLike[str], doc: Mapping[str, Any], *,
                      currency: Currency | None = None) -> ImportReport | None:
    """Write the export ``doc`` to the file ``dest``, merged with the export already there.

    When ``dest`` does not exist, ``doc`` is written as is and None is returned. Otherwise the
    existing file and then ``doc`` are imported into a throwaway DB and the union is exported
    over ``dest`` (atomically, sorted, deterministic): winner conflicts follow ``import``'s
    rules (``doc`` is the import). Merging the same ``doc`` again gives the same bytes.
    Test-only-timer winners already in the file stay. An existing file that is not an export
    raises ``ExportFormatError`` naming it, and is left as it was.
    """
    from tilegen.db.engine import DB_FILENAME
    from tilegen.db.exchange import read_export, write_export

    out = Path(dest)
    if not out.exists():
        write_export(doc, out)
        return None
    existing = read_export(out)
    with tempfile.TemporaryDirectory(prefix="tilegen-merge-") as tmp:
        with TuningDB.open(Path(tmp) / DB_FILENAME) as db:
            db.import_json(existing)
            report = db.import_json(read_export(doc, "the new export"), currency=currency)
            db.export_json(out, include_fake=True)
    return report


__all__ = [
    "merge_export_file",
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
