"""The one name of a compiled kernel variant.

A variant is what one compiler turns one rendered source into for one target:

    (kernel-spec hash, backend, config name, sha256 of the rendered source, toolchain, target)

The kernel cache, the tuning DB, the build manifest and winner staleness all use this key, so
a tuned winner goes stale exactly when the source it would compile, or the toolchain that
compiles it, changes — and never because of a template edit that leaves the source unchanged.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class VariantKey:
    kernel_hash: str
    backend: str
    config: str
    source_sha256: str
    toolchain: str
    target: str

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"VariantKey.{f.name} must be a non-empty string, got {value!r}")

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VariantKey:
        known = {f.name for f in fields(cls)}
        missing = sorted(known - set(data))
        if missing:
            raise ValueError(f"variant key lacks field(s) {missing}")
        return cls(**{k: data[k] for k in known})

    @property
    def digest(self) -> str:
        """sha256 of the key's canonical JSON: a stable id for file names and DB rows."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def short(self) -> str:
        return self.digest[:16]

    @property
    def name(self) -> str:
        """Readable: backend, target, config and the first 12 hex digits of the source."""
        return f"{self.backend}-{self.target}-{self.config}-{self.source_sha256[:12]}"

    def same_build(self, other: VariantKey) -> bool:
        """Whether `other` names the very same machine code: equal source and toolchain for the
        same kernel, backend, config and target (the staleness test for tuned winners)."""
        return self == other


__all__ = ["VariantKey"]
