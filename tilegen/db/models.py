"""SQLAlchemy 2.x ORM models of the tuning DB (one SQLite file, see ``tuning_db/README.md``).

Schema version 2: workloads (specs, with their kernel hash), environments, candidates (variant
keys and configs), studies (where the Optuna trial log of a session lives) and winners. There
is no trials table: Optuna's storage is the one record of each trial.

Each table has a surrogate integer ``id`` for foreign keys and a *natural* unique key that the
JSON export uses instead, so that an export does not depend on the ids of the DB it came from.

Columns that name a tool version (``nvcc``, ``clang``, ...) are ``NOT NULL`` and hold ``""`` when
the tool is absent: SQLite treats NULLs as distinct in a UNIQUE constraint, so a NULL there would
let the same environment be inserted twice.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

#: Version of the schema this code writes. Bump it together with a new entry appended to
#: ``tilegen.db.migrations.MIGRATIONS``.
SCHEMA_VERSION = 2

# Named constraints, so that a future migration can drop or alter them by name
# (SQLite's batch "move and copy" needs names to find them).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (the only kind of datetime the DB stores)."""
    return datetime.now(UTC)


#: Fields of an environment, in ``env_key`` order. ``device_name`` and ``arch`` are required
#: (the others may be ""). All nine together are the environment's identity: the unique key
#: ``uq_environments_identity`` covers every one of them, and ``env_key`` is a hash of them.
ENV_FIELDS: tuple[str, ...] = (
    "device_name",
    "arch",
    "driver",
    "torch",
    "triton",
    "nvcc",
    "clang",
    "tilegen_version",
    "template_set_hash",
)


class UTCDateTime(TypeDecorator[datetime]):
    """A datetime stored as naive UTC (SQLite has no time zones) and read back as aware UTC.

    Naive datetimes are refused on write: guessing their zone would make timestamps from two
    machines incomparable.
    """

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime) or value.tzinfo is None:
            raise ValueError(f"expected a timezone-aware datetime, got {value!r}")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    """Declarative base with a naming convention for constraints."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class SchemaVersion(Base):
    """The single row (id = 1) holding the schema version of this DB file."""

    __tablename__ = "schema_version"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Workload(Base):
    """A spec: its content hash, its kernel hash (the kernel fields only) and canonical JSON.

    Winners are recorded per workload; `tilegen.winners` falls back to the winner of the
    nearest workload with the same ``kernel_hash`` when a spec has none of its own.
    """

    __tablename__ = "workloads"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    spec_hash: Mapped[str] = mapped_column(String(128), unique=True)
    kernel_hash: Mapped[str] = mapped_column(String(128), index=True)
    spec_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    winners: Mapped[list[Winner]] = relationship(
        back_populates="workload", cascade="all, delete-orphan"
    )


class Environment(Base):
    """Where a winner was measured: device, driver and tool versions.

    ``env_key`` is a stable hash of the other fields (``tilegen.db.records.env_key``).
    ``template_set_hash`` is informational only: staleness is decided by the variant key.
    """

    __tablename__ = "environments"
    __table_args__ = (
        UniqueConstraint(*ENV_FIELDS, name="uq_environments_identity"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    env_key: Mapped[str] = mapped_column(String(64), unique=True)
    device_name: Mapped[str] = mapped_column(String(256))
    arch: Mapped[str] = mapped_column(String(64))
    driver: Mapped[str] = mapped_column(String(128), default="")
    torch: Mapped[str] = mapped_column(String(128), default="")
    triton: Mapped[str] = mapped_column(String(128), default="")
    nvcc: Mapped[str] = mapped_column(String(128), default="")
    clang: Mapped[str] = mapped_column(String(128), default="")
    tilegen_version: Mapped[str] = mapped_column(String(128), default="")
    template_set_hash: Mapped[str] = mapped_column(String(128), default="")


class Candidate(Base):
    """One compiled variant: its variant key (`tilegen.identity.VariantKey`) and its config.

    ``variant_digest`` (the key's sha256) is the natural key. A candidate belongs to a kernel
    (``kernel_hash``), not to a workload: the same source runs every workload shape.
    """

    __tablename__ = "candidates"
    __table_args__ = (Index(None, "kernel_hash", "backend", "target"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    variant_digest: Mapped[str] = mapped_column(String(64), unique=True)
    kernel_hash: Mapped[str] = mapped_column(String(128))
    backend: Mapped[str] = mapped_column(String(64))
    config_name: Mapped[str] = mapped_column(String(512))
    source_sha256: Mapped[str] = mapped_column(String(128))
    toolchain: Mapped[str] = mapped_column(String(256))
    target: Mapped[str] = mapped_column(String(64))
    config_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    def variant(self) -> dict[str, str]:
        """The variant key as a dict (`tilegen.identity.VariantKey.to_dict`)."""
        return {"kernel_hash": self.kernel_hash, "backend": self.backend,
                "config": self.config_name, "source_sha256": self.source_sha256,
                "toolchain": self.toolchain, "target": self.target}


class Study(Base):
    """Where the trials of a tuning session live: an Optuna study (storage URL, password left
    out, and name). Optuna's storage is the one record of every trial; this row only says which
    study tuned which workload, so `tilegen db show` can point at (and read) it."""

    __tablename__ = "studies"
    __table_args__ = (UniqueConstraint("storage", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    storage: Mapped[str] = mapped_column(String(1024))
    name: Mapped[str] = mapped_column(String(256))
    workload_id: Mapped[int] = mapped_column(ForeignKey("workloads.id", ondelete="CASCADE"))
    backend: Mapped[str] = mapped_column(String(64))
    device_name: Mapped[str] = mapped_column(String(256))
    target: Mapped[str] = mapped_column(String(64))
    timer: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    workload: Mapped[Workload] = relationship()


class Winner(Base):
    """The fastest passing variant of a workload on one kind of device, per backend and target.

    It is *current* when re-rendering its config gives its ``source_sha256`` and the toolchain
    matches (the variant key, checked by `tilegen.winners`); ``timer`` says how it was timed
    (only `tilegen.db.policy.REAL_TIMERS` winners are ever used by `tilegen.load`).
    ``environment_id``, ``study``, ``trial_number`` and ``template_set_hash`` are provenance.
    """

    __tablename__ = "winners"
    __table_args__ = (UniqueConstraint("workload_id", "backend", "device_name", "target"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workload_id: Mapped[int] = mapped_column(ForeignKey("workloads.id", ondelete="CASCADE"))
    backend: Mapped[str] = mapped_column(String(64))
    device_name: Mapped[str] = mapped_column(String(256))
    target: Mapped[str] = mapped_column(String(64))
    candidate_id: Mapped[int] = mapped_column(ForeignKey("candidates.id", ondelete="CASCADE"))
    median_ms: Mapped[float] = mapped_column(Float)
    timer: Mapped[str] = mapped_column(String(64))
    environment_id: Mapped[int | None] = mapped_column(ForeignKey("environments.id"),
                                                       nullable=True)
    study: Mapped[str] = mapped_column(String(256), default="")
    trial_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    template_set_hash: Mapped[str] = mapped_column(String(128), default="")
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    workload: Mapped[Workload] = relationship(back_populates="winners")
    candidate: Mapped[Candidate] = relationship()
    environment: Mapped[Environment | None] = relationship()


__all__ = [
    "SCHEMA_VERSION",
    "Base",
    "Candidate",
    "Environment",
    "SchemaVersion",
    "Study",
    "UTCDateTime",
    "Winner",
    "Workload",
    "utcnow",
]
