"""SQLAlchemy 2.x ORM models of the tuning DB (one SQLite file, see ``tuning_db/README.md``).

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
SCHEMA_VERSION = 1

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
    """A spec: its content hash (hex) and canonical JSON."""

    __tablename__ = "workloads"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    spec_hash: Mapped[str] = mapped_column(String(128), unique=True)
    spec_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    candidates: Mapped[list[Candidate]] = relationship(
        back_populates="workload", cascade="all, delete-orphan"
    )
    winners: Mapped[list[Winner]] = relationship(
        back_populates="workload", cascade="all, delete-orphan"
    )


class Environment(Base):
    """Where a trial ran: device, driver and toolchain versions, template-set hash.

    ``env_key`` is a stable hash of the other fields (``tilegen.db.store.env_key``).
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
    """One kernel config of a workload, and the hash of the source it rendered to."""

    __tablename__ = "candidates"
    __table_args__ = (UniqueConstraint("workload_id", "config_name", "source_sha256"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workload_id: Mapped[int] = mapped_column(ForeignKey("workloads.id", ondelete="CASCADE"))
    config_name: Mapped[str] = mapped_column(String(512))
    config_json: Mapped[str] = mapped_column(Text)
    source_sha256: Mapped[str] = mapped_column(String(128))

    workload: Mapped[Workload] = relationship(back_populates="candidates")
    trials: Mapped[list[Trial]] = relationship(
        back_populates="candidate", cascade="all, delete-orphan"
    )


class Trial(Base):
    """One Optuna trial: which candidate ran where, how it ended, how fast it was.

    ``status`` is checked in Python (``TRIAL_STATUSES``), not by a CHECK constraint, so that a
    new status does not need SQLite's copy-the-table migration.
    """

    __tablename__ = "trials"
    __table_args__ = (
        UniqueConstraint("study", "trial_number"),
        Index(None, "candidate_id"),
        Index(None, "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    candidate_id: Mapped[int] = mapped_column(ForeignKey("candidates.id", ondelete="CASCADE"))
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id"))
    study: Mapped[str] = mapped_column(String(256))
    trial_number: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(32))
    median_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    tflops: Mapped[float | None] = mapped_column(Float, nullable=True)
    scores_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    error_class: Mapped[str | None] = mapped_column(String(256), nullable=True)
    error_text: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    candidate: Mapped[Candidate] = relationship(back_populates="trials")
    environment: Mapped[Environment] = relationship()


class Winner(Base):
    """The fastest passing candidate of a workload on one device kind (device name + arch).

    ``template_set_hash`` and ``toolchain_key`` record what it was measured under; a lookup
    under other values reports the winner as stale rather than using it.
    """

    __tablename__ = "winners"
    __table_args__ = (UniqueConstraint("workload_id", "device_name", "arch"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workload_id: Mapped[int] = mapped_column(ForeignKey("workloads.id", ondelete="CASCADE"))
    device_name: Mapped[str] = mapped_column(String(256))
    arch: Mapped[str] = mapped_column(String(64))
    template_set_hash: Mapped[str] = mapped_column(String(128))
    toolchain_key: Mapped[str] = mapped_column(String(512))
    candidate_id: Mapped[int] = mapped_column(ForeignKey("candidates.id", ondelete="CASCADE"))
    median_ms: Mapped[float] = mapped_column(Float)
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    workload: Mapped[Workload] = relationship(back_populates="winners")
    candidate: Mapped[Candidate] = relationship()


__all__ = [
    "SCHEMA_VERSION",
    "Base",
    "Candidate",
    "Environment",
    "SchemaVersion",
    "Trial",
    "UTCDateTime",
    "Winner",
    "Workload",
    "utcnow",
]
