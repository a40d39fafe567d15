"""Tuned winners for `tilegen.load`: which config won for a kernel on this kind of device.

A winner is recorded for (kernel hash, backend, device name, target) plus the workload it was
tuned on (the spec's workload fields: grid, heads, top-k, batch), and stores its variant key
(`tilegen.identity.VariantKey`: the sha256 of the source it compiled and the toolchain).

`lookup_config(spec, target)` looks in two places:

1. the tuning DB (``$TILEGEN_DB`` or the default path), opened **read-only** (it works on a
   read-only mount, and never creates a file), only when SQLAlchemy is importable and the file
   exists; a DB that cannot be read is reported in one warning and skipped;
2. the shipped exports ``tuning_db/*.json`` (the ``tilegen db export`` format), read with plain
   ``json``, so a machine with neither SQLAlchemy nor Optuna still uses shipped winners.

Among the winners of the same kernel on this device kind, the one of the spec's own workload
comes first, then the one of the *nearest* tuned workload (`Spec.workload_distance`); the DB
before the shipped files at equal distance. The first one that is usable wins:

- timed on a real device (`tilegen.db.policy.REAL_TIMERS`): a winner from the test-only timer
  is never used (one log line says so);
- *current*: re-rendering its config for its workload's spec with this checkout's templates
  gives its ``source_sha256``, and its toolchain is this process's
  (``backend.variant_key(spec, cfg, target) == stored key``). A template edit that leaves the
  rendered source byte-identical keeps a winner current; one that changes it makes it stale;
- valid for the target (`Backend.violations`).

A stale winner is not used (one log line says so); with no usable winner the op falls back to
the target's default config, and one log line says that. Each line is logged once per process.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tilegen.config import KernelConfig
from tilegen.db.policy import EXPORT_FORMAT, is_real_timer
from tilegen.paths import ROOT
from tilegen.spec import Spec
from tilegen.targets import Target

log = logging.getLogger("tilegen")

#: The shipped exports (reviewable JSON committed with tilegen). Tests point it elsewhere.
SHIPPED_DIR: Path = ROOT / "tuning_db"

Status = Literal["hit", "stale", "miss"]


@dataclass(frozen=True)
class WinnerResult:
    """What `find_winner` found.

    ``status`` is "hit" (``config`` is the winner to use), "stale" (a winner exists for this
    kernel and device kind, but its source or toolchain is not what this checkout builds:
    ``config`` is that old winner, a good tuning seed but not to be run as the tuned choice) or
    "miss". ``source`` says where it came from ("db:<path>" or "json:<path>", "" on a miss);
    ``tuned_spec_hash`` is the workload it was tuned on and ``distance`` how far that workload
    is from the asked one (0: its own); ``message`` is the one line `lookup_config` logs.
    """

    status: Status
    config: KernelConfig | None
    source: str
    message: str
    median_ms: float | None = None
    timer: str | None = None
    tuned_spec_hash: str | None = None
    distance: float | None = None

    @property
    def hit(self) -> bool:
        return self.status == "hit"

    @property
    def nearest(self) -> bool:
        """True when the winner was tuned on another workload of the same kernel."""
        return bool(self.distance)


@dataclass(frozen=True)
class _Match:
    where: str
    spec_hash: str
    spec: dict[str, Any]
    variant: dict[str, Any]
    config: dict[str, Any]
    median_ms: float | None
    timer: str


# --------------------------------------------------------------------------- identity


def current_device_name() -> str:
    """``torch.cuda.get_device_name()`` on a GPU (ROCm included), else ``"cpu"``."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def current_toolchain(backend: str = "triton", target: Target | None = None) -> str:
    """The toolchain this process compiles `backend` with, e.g. ``"triton=3.6.0"``."""
    from tilegen import backends

    return backends.get(backend).toolchain(target)  # type: ignore[arg-type]


def current_template_set_hash(backend: str = "triton") -> str:
    """The hash of ``templates/<backend>/`` (informational: recorded with an environment; it
    decides nothing, the variant key does)."""
    from tilegen import backends
    from tilegen.render import template_set_hash

    impl = backends.get(backend)
    return template_set_hash(impl.templates or impl.name, backward=impl.gradients)


def variant_currency(variant: Mapping[str, Any], config: Mapping[str, Any],
                     spec: Mapping[str, Any]) -> bool | None:
    """Whether the variant key `variant` is what this checkout builds for `config` and `spec`
    (all dicts, as stored): the re-rendered source's sha256 and the toolchain match. None when
    that cannot be computed (an unknown backend, target, config field or spec)."""
    from tilegen import backends
    from tilegen.targets import get_target

    try:
        backend = backends.get(str(variant["backend"]))
        target = get_target(str(variant["target"]))
        cfg = KernelConfig.from_dict(dict(config))
        key = backend.variant_key(Spec.from_dict(dict(spec)), cfg, target)
    except Exception:  # noqa: BLE001 - cannot tell
        return None
    return key.to_dict() == dict(variant)


# --------------------------------------------------------------------------- sources


def _from_db(spec: Spec, backend: str, device: str, target: str,
             db_path: str | Path | None) -> list[_Match]:
    try:
        from tilegen.db.engine import resolve_db_path
        from tilegen.db.records import TuningDB
    except ImportError:
        return []  # no SQLAlchemy here (a GPU box with only torch and triton): JSON only
    path = resolve_db_path(db_path)
    if not path.exists():
        return []
    try:
        with TuningDB.open(path, readonly=True) as db:
            found = db.winners_for_kernel(spec.kernel_hash, backend, device, target)
    except Exception as exc:  # noqa: BLE001 - a broken DB must not break tilegen.load
        _log_once(f"db-error:{path}", logging.WARNING,
                  f"cannot read the tuning DB {path}: {exc}; using shipped winners only")
        return []
    return [_Match(f"db:{path}", w.spec_hash, w.spec, w.variant, w.config, w.median_ms,
                   w.timer) for w in found]


def export_files(folder: Path, on_error: Callable[[Path, Exception], None]
                 ) -> Iterator[tuple[Path, dict[str, Any]]]:
    """(path, parsed JSON) of each tuning export in `folder` (the shipped winners): another JSON
    file there (notes, plots' data) is skipped; one that cannot be read goes to `on_error`."""
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            on_error(path, exc)
            continue
        if isinstance(doc, dict) and doc.get("format") == EXPORT_FORMAT:
            yield path, doc


def _from_exports(spec: Spec, backend: str, device: str, target: str,
                  folder: Path) -> list[_Match]:
    from tilegen.identity import VariantKey

    def unreadable(path: Path, exc: Exception) -> None:
        _log_once(f"json-error:{path}", logging.WARNING, f"cannot read tuning export {path}: {exc}")

    out: list[_Match] = []
    for path, doc in export_files(folder, unreadable):
        if doc.get("schema_version") != 2:
            _log_once(f"json-version:{path}", logging.WARNING,
                      f"tuning export {path} has schema version {doc.get('schema_version')!r}; "
                      "this tilegen reads version 2 here (convert it: tilegen db import FILE, "
                      "then tilegen db export)")
            continue
        try:
            specs = {w["spec_hash"]: w["spec"] for w in doc.get("workloads", [])}
            configs = {VariantKey.from_dict(c["variant"]).digest: c["config"]
                       for c in doc.get("candidates", [])}
            for w in doc.get("winners", []):
                v = w["variant"]
                if (v["kernel_hash"], v["backend"], w["device_name"], v["target"]) != (
                        spec.kernel_hash, backend, device, target):
                    continue
                cfg = configs.get(VariantKey.from_dict(v).digest)
                if not isinstance(cfg, dict) or w["spec_hash"] not in specs:
                    _log_once(f"json-nocfg:{path}", logging.WARNING,
                              f"tuning export {path} names winner {v.get('config')} without "
                              "its candidate config or workload; ignoring it")
                    continue
                out.append(_Match(f"json:{path}", w["spec_hash"], specs[w["spec_hash"]],
                                  dict(v), cfg, w.get("median_ms"), str(w.get("timer", ""))))
        except (KeyError, TypeError, ValueError) as exc:
            _log_once(f"json-bad:{path}", logging.WARNING,
                      f"tuning export {path} is malformed ({type(exc).__name__}: {exc}); "
                      "ignoring it")
    return out


def _describe(spec: Mapping[str, Any] | Spec) -> str:
    d = spec.to_dict() if isinstance(spec, Spec) else spec
    grid = "x".join(str(g) for g in d.get("grid", ()))
    return (f"grid {grid}, {d.get('num_heads')} heads, topk {d.get('topk')}, "
            f"batch {d.get('batch')}")


def _usable(m: _Match, spec: Spec, target: Target, backend: Any) -> KernelConfig | None:
    """The match's config if this tilegen can run it on `target` (else None, logged once)."""
    try:
        cfg = KernelConfig.from_dict(dict(m.config))
    except (TypeError, ValueError) as exc:
        _log_once(f"bad-config:{m.where}", logging.WARNING,
                  f"ignoring the tuned winner in {m.where}: {exc}")
        return None
    problems = backend.violations(spec, target, cfg)
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
    backend: str = "triton",
    device_name: str | None = None,
    db_path: str | Path | None = None,
    shipped_dir: str | Path | None = None,
) -> WinnerResult:
    """The winner for `spec`'s kernel on this device kind: its own workload first, then the
    nearest tuned workload; DB before the shipped exports (see the module docstring).

    Returns the first usable current winner ("hit"); else the first stale one ("stale"); else
    a "miss". The keyword arguments override the device and the places looked in (for tests
    and for ``tilegen tune``'s seeding).
    """
    from tilegen import backends
    from tilegen.identity import VariantKey

    be = backends.get(backend)
    device = device_name if device_name is not None else current_device_name()
    folder = Path(shipped_dir) if shipped_dir is not None else SHIPPED_DIR
    matches = _from_db(spec, backend, device, target.name, db_path)
    matches += _from_exports(spec, backend, device, target.name, folder)
    ranked: list[tuple[float, int, _Match, Spec]] = []
    for i, m in enumerate(matches):
        try:
            tuned = Spec.from_dict(dict(m.spec))
        except (TypeError, ValueError) as exc:
            _log_once(f"bad-spec:{m.where}:{m.spec_hash}", logging.WARNING,
                      f"ignoring the tuned winner of spec {m.spec_hash[:12]} in {m.where}: {exc}")
            continue
        distance = 0.0 if m.spec_hash == spec.hash else spec.workload_distance(tuned)
        ranked.append((distance, i, m, tuned))
    ranked.sort(key=lambda r: (r[0], r[1]))
    where = f"{device} ({target.name}, {backend})"
    default = be.default_config(spec, target).name
    stale: tuple[float, _Match, KernelConfig, VariantKey] | None = None
    for distance, _i, m, tuned in ranked:
        if not is_real_timer(m.timer):
            _log_once(f"fake:{m.where}:{m.spec_hash}:{device}", logging.INFO,
                      f"ignoring the tuned winner {m.variant.get('config')} of spec "
                      f"{m.spec_hash[:12]} in {m.where}: timed by the test-only timer "
                      f"{m.timer!r}, not on a real device")
            continue
        cfg = _usable(m, spec, target, be)
        if cfg is None:
            continue
        try:
            stored = VariantKey.from_dict(m.variant)
            key = be.variant_key(tuned, cfg, target)
        except (TypeError, ValueError) as exc:
            _log_once(f"bad-key:{m.where}", logging.WARNING,
                      f"ignoring the tuned winner in {m.where}: {exc}")
            continue
        if key == stored:
            ms = f"{m.median_ms:.4g} ms, " if m.median_ms is not None else ""
            if distance == 0:
                msg = (f"using tuned winner {cfg.name} ({ms}{m.timer}) for spec "
                       f"{spec.short_hash} on {where} from {m.where}")
            else:
                msg = (f"using tuned winner {cfg.name} ({ms}{m.timer}) of the nearest tuned "
                       f"workload (spec {m.spec_hash[:12]}: {_describe(m.spec)}) for spec "
                       f"{spec.short_hash} ({_describe(spec)}) on {where} from {m.where}: "
                       "this workload has no winner of its own (tilegen tune --spec ... tunes "
                       "it)")
            return WinnerResult("hit", cfg, m.where, msg, m.median_ms, m.timer, m.spec_hash,
                                distance)
        if stale is None:
            stale = (distance, m, cfg, key)
    if stale is not None:
        distance, m, cfg, key = stale
        stored = m.variant
        parts = []
        if stored.get("source_sha256") != key.source_sha256:
            parts.append(f"its source {str(stored.get('source_sha256'))[:12]} is not what this "
                         f"checkout renders ({key.source_sha256[:12]})")
        if stored.get("toolchain") != key.toolchain:
            parts.append(f"its toolchain {stored.get('toolchain')!r} is not this process's "
                         f"{key.toolchain!r}")
        return WinnerResult(
            "stale", cfg, m.where,
            f"stale tuned winner {cfg.name} for spec {spec.short_hash} on {where} in "
            f"{m.where} (tuned on spec {m.spec_hash[:12]}): {' and '.join(parts) or 'key'}; "
            f"not using it (re-run `tilegen tune`), using target default {default}",
            m.median_ms, m.timer, m.spec_hash, distance)
    return WinnerResult(
        "miss", None, "",
        f"no tuned winner for spec {spec.short_hash} (kernel {spec.kernel_hash[:12]}) on "
        f"{where}; using target default {default} (run `tilegen tune` to tune it)")


# --------------------------------------------------------------------------- the op's entry

_logged: set[str] = set()


def _log_once(key: str, level: int, message: str) -> None:
    if key not in _logged:
        _logged.add(key)
        log.log(level, message)


def lookup_config(spec: Spec, target: Target, *, backend: str = "triton"
                  ) -> KernelConfig | None:
    """The tuned winner's config for `spec` on this device, or None (use the target default).

    Never raises for a missing, unreadable or stale winner: it logs one line (once per spec,
    device and outcome) and returns None. A hit is logged at INFO (saying which workload's
    winner it is when it is the nearest one's), a stale winner and a miss at WARNING, so the
    fallback to an untuned default is visible.
    """
    res = find_winner(spec, target, backend=backend)
    key = f"{res.status}:{spec.hash}:{target.name}:{backend}:{res.source}:{res.tuned_spec_hash}"
    _log_once(key, logging.INFO if res.hit else logging.WARNING, res.message)
    return res.config if res.hit else None


__all__ = [
    "EXPORT_FORMAT",
    "SHIPPED_DIR",
    "export_files",
    "WinnerResult",
    "current_device_name",
    "current_template_set_hash",
    "current_toolchain",
    "find_winner",
    "lookup_config",
    "variant_currency",
]
