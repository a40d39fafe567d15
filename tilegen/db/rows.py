"""Row-level pieces of the tuning DB that every other part shares: value checks and
normalisation (specs, environments, variant keys, times), the dataclasses callers get back, and
the functions that read and write single rows inside a session. `tilegen.db.records`
(``TuningDB``) and `tilegen.db.exchange` (export / import) both build on it, and it imports
neither, so the package has no import cycle.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tilegen.db import policy
from tilegen.db.errors import ConflictError
from tilegen.db.models import (
    ENV_FIELDS,
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
