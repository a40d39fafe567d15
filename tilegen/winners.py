"""Tuned winners for `tilegen.load`: which config won for a spec on this kind of device.

`lookup_config(spec, target)` looks in two places; the first current winner wins:

1. the tuning DB (`tilegen.db`: ``$TILEGEN_DB`` or the default path), only when SQLAlchemy is
   importable and the file already exists (a lookup never creates a DB);
2. the shipped exports ``tuning_db/*.json`` (the ``tilegen db export`` format), read with plain
   ``json``, so a machine with neither SQLAlchemy nor Optuna still uses shipped winners.

A winner matches on spec hash + device name (``torch.cuda.get_device_name()``) + arch (the
target name, e.g. ``sm_90``). It is *current* when its template-set hash
(`tilegen.render.template_set_hash`) and toolchain key (`current_toolchain_key`) equal this
process's. A matching winner recorded under another template set or toolchain is *stale*: it
is not used, and one log line says so. With no current winner the op falls back to the target's
default config, and one log line says that. Each line is logged once per process.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tilegen.config import KernelConfig, default_config, violations
from tilegen.paths import ROOT
from tilegen.spec import Spec
from tilegen.targets import Target

log = logging.getLogger("tilegen")

#: The shipped exports (reviewable JSON committed with tilegen). Tests point it elsewhere.
SHIPPED_DIR: Path = ROOT / "tuning_db"
#: `tilegen.db.EXPORT_FORMAT`, repeated so that reading an export needs no SQLAlchemy.
EXPORT_FORMAT = "tilegen-tuning-db"

Status = Literal["hit", "stale", "miss"]


@dataclass(frozen=True)
class WinnerResult:
    """What `find_winner` found.

    ``status`` is "hit" (``config`` is the winner to use), "stale" (a winner exists for this
    spec and device kind under another template set or toolchain: ``config`` is that old
    winner, a good tuning seed but not to be run as the tuned choice) or "miss".
    ``source`` says where it came from ("db:<path>" or "json:<path>", "" on a miss), and
    ``message`` is the one line `lookup_config` logs.
    """

    status: Status
    config: KernelConfig | None
    source: str
    message: str
    median_ms: float | None = None

    @property
    def hit(self) -> bool:
        return self.status == "hit"


@dataclass(frozen=True)
class _Match:
    where: str
    config: dict[str, Any]
    template_set_hash: str
    toolchain_key: str
    median_ms: float | None


# --------------------------------------------------------------------------- identity


def current_toolchain_key() -> str:
    """The toolchain key of the Triton JIT path in this process, e.g. ``"triton=3.6.0"``
    (one definition: `tilegen.tune.toolchain`, which needs no SQLAlchemy)."""
    from tilegen.tune.toolchain import current_toolchain_key as _key

    return _key()


def current_device_name() -> str:
    """``torch.cuda.get_device_name()`` on a GPU (ROCm included), else ``"cpu"``."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def current_template_set_hash() -> str:
    from tilegen.render import template_set_hash

    return template_set_hash("triton")


# --------------------------------------------------------------------------- sources


def _from_db(spec: Spec, device: str, arch: str, tpl: str, tool: str,
             db_path: str | Path | None) -> list[_Match]:
    try:
        from tilegen.db import TuningDB, resolve_db_path
    except ImportError:
        return []  # no SQLAlchemy here (a GPU box with only torch and triton): JSON only
    path = resolve_db_path(db_path)
    if not path.exists():
        return []
    try:
        with TuningDB.open(path) as db:
            found = db.lookup_winner(spec.hash, device, arch, tpl, tool)
    except Exception as exc:  # noqa: BLE001 - a broken DB must not break tilegen.load
        _log_once(f"db-error:{path}", logging.WARNING,
                  f"cannot read the tuning DB {path}: {exc}")
        return []
    if found.status == "miss" or found.config is None:
        return []
    return [_Match(f"db:{path}", found.config, found.recorded_template_set_hash or "",
                   found.recorded_toolchain_key or "", found.median_ms)]


def _from_exports(spec: Spec, device: str, arch: str, folder: Path) -> list[_Match]:
    if not folder.is_dir():
        return []
    out: list[_Match] = []
    for path in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            _log_once(f"json-error:{path}", logging.WARNING,
                      f"cannot read tuning export {path}: {exc}")
            continue
        if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
            continue  # another JSON file in the folder (notes, plots' data): not an export
        configs = {(c.get("spec_hash"), c.get("config_name"), c.get("source_sha256")):
                   c.get("config") for c in doc.get("candidates", []) if isinstance(c, dict)}
        for w in doc.get("winners", []):
            if not isinstance(w, dict) or (w.get("spec_hash"), w.get("device_name"),
                                           w.get("arch")) != (spec.hash, device, arch):
                continue
            cfg = configs.get((w.get("spec_hash"), w.get("config_name"),
                               w.get("source_sha256")))
            if not isinstance(cfg, dict):
                _log_once(f"json-nocfg:{path}", logging.WARNING,
                          f"tuning export {path} names winner {w.get('config_name')} "
                          "without its candidate config; ignoring it")
                continue
            out.append(_Match(f"json:{path}", cfg, str(w.get("template_set_hash", "")),
                              str(w.get("toolchain_key", "")), w.get("median_ms")))
    return out


def _usable(m: _Match, spec: Spec, target: Target) -> KernelConfig | None:
    """The match's config if this tilegen can run it on `target` (else None, logged once)."""
    try:
        cfg = KernelConfig.from_dict(dict(m.config))
    except (TypeError, ValueError) as exc:
        _log_once(f"bad-config:{m.where}", logging.WARNING,
                  f"ignoring the tuned winner in {m.where}: {exc}")
        return None
    problems = violations(spec, target, cfg)
    if problems:
        _log_once(f"invalid:{m.where}:{cfg.name}", logging.WARNING,
                  f"ignoring the tuned winner {cfg.name} in {m.where}: invalid for "
                  f"{target.name}: {'; '.join(problems)}")
        return None
    return cfg


def find_winner(
    spec: Spec,
    target: Target,
    *,
    device_name: str | None = None,
    template_set_hash: str | None = None,
    toolchain_key: str | None = None,
    db_path: str | Path | None = None,
    shipped_dir: str | Path | None = None,
) -> WinnerResult:
    """The winner of `spec` on this device kind: DB first, then the shipped exports.

    Returns the first *current* winner ("hit"); else the first stale one ("stale"); else a
    "miss". The keyword arguments override this process's identity and the places looked in
    (for tests and for ``tilegen tune``'s seeding); by default they are the current device,
    template set, toolchain, ``$TILEGEN_DB`` and `SHIPPED_DIR`.
    """
    device = device_name if device_name is not None else current_device_name()
    arch = target.name
    tpl = template_set_hash if template_set_hash is not None else current_template_set_hash()
    tool = toolchain_key if toolchain_key is not None else current_toolchain_key()
    folder = Path(shipped_dir) if shipped_dir is not None else SHIPPED_DIR
    matches = _from_db(spec, device, arch, tpl, tool, db_path)
    matches += _from_exports(spec, device, arch, folder)
    stale: tuple[_Match, KernelConfig] | None = None
    for m in matches:
        cfg = _usable(m, spec, target)
        if cfg is None:
            continue
        if m.template_set_hash == tpl and m.toolchain_key == tool:
            return WinnerResult("hit", cfg, m.where,
                                f"using tuned winner {cfg.name} for spec "
                                f"{spec.short_hash} on {device} ({arch}) from {m.where}",
                                m.median_ms)
        if stale is None:
            stale = (m, cfg)
    if stale is not None:
        m, cfg = stale
        parts = []
        if m.template_set_hash != tpl:
            parts.append(f"template set {m.template_set_hash[:12]} (current {tpl[:12]})")
        if m.toolchain_key != tool:
            parts.append(f"toolchain '{m.toolchain_key}' (current '{tool}')")
        return WinnerResult(
            "stale", cfg, m.where,
            f"stale tuned winner {cfg.name} for spec {spec.short_hash} on {device} "
            f"({arch}) in {m.where}: recorded under {' and '.join(parts)}; not using it "
            f"(re-run `tilegen tune`), using target default {default_config(target, spec).name}",
            m.median_ms)
    return WinnerResult(
        "miss", None, "",
        f"no tuned winner for spec {spec.short_hash} on {device} ({arch}); using "
        f"target default {default_config(target, spec).name} (run `tilegen tune` to tune it)")


# --------------------------------------------------------------------------- the op's entry

_logged: set[str] = set()


def _log_once(key: str, level: int, message: str) -> None:
    if key not in _logged:
        _logged.add(key)
        log.log(level, message)


def lookup_config(spec: Spec, target: Target) -> KernelConfig | None:
    """The tuned winner's config for `spec` on this device, or None (use the target default).

    Never raises for a missing, unreadable or stale winner: it logs one line (once per spec,
    device and outcome) and returns None. A hit is logged at INFO, a stale winner and a miss at
    WARNING, so the fallback to an untuned default is visible.
    """
    res = find_winner(spec, target)
    key = f"{res.status}:{spec.hash}:{target.name}:{res.source}"
    _log_once(key, logging.INFO if res.hit else logging.WARNING, res.message)
    return res.config if res.hit else None


__all__ = [
    "EXPORT_FORMAT",
    "SHIPPED_DIR",
    "WinnerResult",
    "current_device_name",
    "current_template_set_hash",
    "current_toolchain_key",
    "find_winner",
    "lookup_config",
]
