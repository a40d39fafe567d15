"""The one name of a compiled kernel variant.

A variant is what one compiler turns one rendered source into for one target:

    (kernel-spec hash, backend, config name, sha256 of the rendered source, toolchain, target)

The source's sha256 covers what the compiler reads: the rendered text alone for the Triton and
Gluon families, and for the C++ families (`CxxSource`) the rendered file plus every header of
tilegen's C++ library it includes (`include_closure`, `source_sha256`), so a header edit
invalidates cached binaries and makes tuned winners stale.

The kernel cache, the tuning DB, the build manifest and winner staleness all use this key, so
a tuned winner goes stale exactly when the source it would compile, or the toolchain that
compiles it, changes — and never because of a template edit that leaves the source unchanged.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tilegen.render import Source


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


#: a quoted ``#include "..."`` line (the library's headers include each other this way)
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def include_closure(text: str, include_dir: Path) -> tuple[tuple[str, bytes], ...]:
    """Every file under `include_dir` that C++ `text` includes, directly or through another
    header, as sorted (path relative to `include_dir`, bytes) pairs. A quoted include inside a
    header is looked up beside that header first, then in `include_dir` (the preprocessor's
    order); one found in neither (a system header) is not part of the library and left out. An
    include inside ``#if`` counts too: the closure may hold more than one build reads, never
    less."""
    root = Path(include_dir).resolve()
    found: dict[str, bytes] = {}
    todo = [(name, None) for name in _INCLUDE.findall(text)]
    while todo:
        name, beside = todo.pop()
        for folder in ([beside] if beside else []) + [root]:
            path = (folder / name).resolve()
            if path.is_file() and path.is_relative_to(root):
                rel = path.relative_to(root).as_posix()
                if rel not in found:
                    found[rel] = path.read_bytes()
                    todo += [(n, path.parent) for n in _INCLUDE.findall(found[rel].decode())]
                break
    return tuple(sorted(found.items()))


def source_sha256(text: str, headers: tuple[tuple[str, bytes], ...] = ()) -> str:
    """sha256 of what a compiler reads: the text alone when it includes no library header (the
    Triton and Gluon sources: the sha256 of the rendered text, as always), else the text and
    each header's relative path and bytes, length-prefixed."""
    if not headers:
        return hashlib.sha256(text.encode()).hexdigest()
    h = hashlib.sha256(b"tilegen-cxx\0")
    for part in (text.encode(), *(x for rel, data in headers for x in (rel.encode(), data))):
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


@dataclass(frozen=True)
class CxxSource(Source):
    """A rendered C++ file (a kernel's traits and entry point) and the library headers it
    includes, read once when it was rendered: what is hashed is what is compiled."""

    headers: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)

    @classmethod
    def including(cls, source: Source, include_dir: Path) -> CxxSource:
        """`source` with the headers it includes from `include_dir` (`include_closure`)."""
        return cls(text=source.text, name=source.name, template=source.template,
                   backend=source.backend, headers=include_closure(source.text, include_dir))

    @property
    def sha256(self) -> str:
        return source_sha256(self.text, self.headers)

    def write_headers(self, include_dir: Path) -> Path:
        """Write the headers under `include_dir` (the folder a compile passes with -I)."""
        Path(include_dir).mkdir(parents=True, exist_ok=True)
        for rel, data in self.headers:
            path = Path(include_dir) / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return Path(include_dir)

    def expanded(self) -> str:
        """One self-contained text: each included header pasted in place of its first
        ``#include`` (later ones and ``#pragma once`` dropped), as the rendered files were
        before the library became headers. For reading and grepping; compiles alike."""
        headers = {rel: data.decode() for rel, data in self.headers}
        done: set[str] = set()

        def paste(text: str) -> str:
            out = []
            for line in text.splitlines(keepends=True):
                m = _INCLUDE.match(line)
                name = m.group(1) if m else None
                if name in headers:
                    if name not in done:
                        done.add(name)
                        out.append(paste(headers[name]))
                elif line.strip() != "#pragma once":
                    out.append(line)
            return "".join(out)

        return paste(self.text)


__all__ = ["CxxSource", "VariantKey", "include_closure", "source_sha256"]
