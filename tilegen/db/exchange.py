"""Export and import: the reviewable JSON of ``tilegen db export`` and ``tuning_db/*.json``.

Format (schema version 2; ``tuning_db/README.md`` has an example)::

    {"format": "tilegen-tuning-db", "schema_version": 2,
     "workloads":    [{"spec_hash", "kernel_hash", "spec": {...}, "created_at"}],
     "environments": [{"env_key", "device_name", "arch", "driver", "torch", "triton", "nvcc",
                       "clang", "tilegen_version", "template_set_hash"}],
     "candidates":   [{"variant": {VARIANT KEY}, "config": {...}}],
     "winners":      [{"spec_hash", "device_name", "variant": {VARIANT KEY}, "median_ms",
                       "timer", "recorded_at", "env_key", "study", "trial_number",
                       "template_set_hash"}]}

where a VARIANT KEY is ``{"kernel_hash", "backend", "config", "source_sha256", "toolchain",
"target"}`` (`tilegen.identity.VariantKey`). Rows are sorted by their natural keys and the text
is indented with sorted keys, so an export diffs well and the same DB always gives the same
bytes. Winners timed by a test-only timer are left out unless ``include_fake``.

Reading (`read_export`) checks every record before anything is written: an error names the
file, the record (``winners[2] (bm64_bn64_w4_s5_lse)``) and the field; a JSON syntax error
names the file, line and column (`ExportFormatError`). Version 1 exports (winners keyed by the
whole spec and a template-set hash) are converted on read (`upgrade_doc`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from tilegen.cache import atomic_write
from tilegen.db import policy
from tilegen.db.errors import ConflictError, ExportFormatError
from tilegen.db.models import (
    ENV_FIELDS,
    SCHEMA_VERSION,
    Candidate,
    Environment,
    Winner,
    Workload,
)
from tilegen.db.rows import (
    VARIANT_FIELDS,
    Currency,
    ImportReport,
    canonical_json,
    env_key,
    finite_ms,
    fmt_time,
    json_object,
    nonempty,
    normalize_env,
    normalize_variant,
    parse_time,
    put_candidate,
    put_environment,
    put_winner,
    put_workload,
    variant_digest,
    winner_info,
    winner_query,
)

EXPORT_FORMAT = policy.EXPORT_FORMAT


# --------------------------------------------------------------------------- export


def export_dict(s: Session, *, spec_hash: str | None = None,
                include_fake: bool = False) -> dict[str, Any]:
    """The export document of the DB behind `s` (one workload with ``spec_hash``)."""
    wl_stmt = select(Workload).order_by(Workload.spec_hash)
    if spec_hash is not None:
        wl_stmt = wl_stmt.where(Workload.spec_hash == spec_hash)
    workloads = list(s.scalars(wl_stmt))
    if spec_hash is not None and not workloads:
        raise KeyError(f"no workload with spec hash {spec_hash!r} in the tuning DB")
    kernels = {w.kernel_hash for w in workloads}
    ids = {w.id for w in workloads}
    winners = [winner_info(*row) for row in s.execute(winner_query())
               if row[0].workload_id in ids]
    fake = [w for w in winners if not policy.is_real_timer(w.timer)]
    if not include_fake:
        winners = [w for w in winners if policy.is_real_timer(w.timer)]
    envs = {w.env_key for w in winners if w.env_key}
    candidates = [c for c in s.scalars(select(Candidate)) if c.kernel_hash in kernels]
    return {
        "format": EXPORT_FORMAT,
        "schema_version": SCHEMA_VERSION,
        "workloads": [
            {"spec_hash": w.spec_hash, "kernel_hash": w.kernel_hash,
             "spec": json.loads(w.spec_json), "created_at": fmt_time(w.created_at)}
            for w in workloads],
        "environments": sorted(
            ({"env_key": e.env_key, **{f: getattr(e, f) for f in ENV_FIELDS}}
             for e in s.scalars(select(Environment)) if e.env_key in envs),
            key=lambda d: d["env_key"]),
        "candidates": sorted(
            ({"variant": c.variant(), "config": json.loads(c.config_json)} for c in candidates),
            key=lambda d: tuple(d["variant"][f] for f in (
                "kernel_hash", "backend", "target", "config", "toolchain", "source_sha256"))),
        "winners": sorted(
            ({"spec_hash": w.spec_hash, "device_name": w.device_name, "variant": w.variant,
              "median_ms": w.median_ms, "timer": w.timer, "recorded_at": fmt_time(w.recorded_at),
              "env_key": w.env_key, "study": w.study, "trial_number": w.trial_number,
              "template_set_hash": w.template_set_hash} for w in winners),
            key=lambda d: (d["spec_hash"], d["variant"]["backend"], d["device_name"],
                           d["variant"]["target"])),
        # not part of the format: read by the CLI to say what was left out, then dropped
        "_left_out_fake": 0 if include_fake else len(fake),
    }


def dumps(doc: Mapping[str, Any]) -> str:
    """The export text: sorted keys, indent 2, strict JSON, trailing newline."""
    body = {k: v for k, v in doc.items() if not k.startswith("_")}
    return json.dumps(body, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def write_export(doc: Mapping[str, Any],
                 dest: str | os.PathLike[str] | IO[str] | None = None) -> str:
    """Write ``doc`` to ``dest`` (a path, atomically; an open text file; or None) and return
    the text."""
    text = dumps(doc)
    if dest is None:
        return text
    if not isinstance(dest, str | os.PathLike):
        dest.write(text)
        return text
    # Atomic: a reader (or a crash) never sees a half-written export.
    atomic_write(Path(dest), text)
    return text


# --------------------------------------------------------------------------- reading


def _name(src: Any) -> str:
    if isinstance(src, str | os.PathLike):
        return str(src)
    return str(getattr(src, "name", "<export>"))


def read_export(src: str | os.PathLike[str] | IO[str] | Mapping[str, Any],
                name: str | None = None) -> dict[str, Any]:
    """Read, check and (from version 1) convert an export; raise `ExportFormatError` naming
    the file, the record and the field. ``src``: a path, an open text file or a parsed doc."""
    label = name or _name(src)
    if isinstance(src, Mapping):
        doc: Any = src
    else:
        try:
            text = (Path(src).read_text(encoding="utf-8") if isinstance(src, str | os.PathLike)
                    else src.read())
        except UnicodeDecodeError:
            raise ExportFormatError(f"{label}: not a text file (not UTF-8), not a tilegen "
                                    "tuning DB export") from None
        except OSError as exc:
            raise ExportFormatError(f"{label}: cannot read it ({exc.strerror or exc})") from None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ExportFormatError(f"{label}: line {exc.lineno} column {exc.colno}: not JSON "
                                    f"({exc.msg})") from None
    if not isinstance(doc, Mapping) or doc.get("format") != EXPORT_FORMAT:
        raise ExportFormatError(f"{label}: not a tilegen tuning DB export (\"format\" must be "
                                f"{EXPORT_FORMAT!r})")
    version = doc.get("schema_version")
    if version == 1:
        doc = upgrade_doc(doc, label)
    elif version != SCHEMA_VERSION:
        raise ExportFormatError(f"{label}: schema_version: {version!r}; this tilegen reads "
                                f"1..{SCHEMA_VERSION}")
    return check_doc(doc, label)


class _Where:
    """Builds `ExportFormatError`s for one record: ``file: winners[3] (cfg): field: problem``."""

    def __init__(self, file: str, section: str, index: int, rec: Any) -> None:
        self.file, self.section, self.index = file, section, index
        self.rec = rec if isinstance(rec, Mapping) else {}
        self.label = ""
        if not isinstance(rec, Mapping):
            raise self.error(None, f"must be a JSON object, got {type(rec).__name__}")

    def error(self, key: str | None, problem: str) -> ExportFormatError:
        where = f"{self.file}: {self.section}[{self.index}]{self.label}"
        return ExportFormatError(f"{where}: {key}: {problem}" if key else f"{where}: {problem}")

    def get(self, key: str, conv: Callable[[Any], Any], *, default: Any = ...) -> Any:
        if key not in self.rec:
            if default is not ...:
                return default
            raise self.error(key, "missing")
        try:
            return conv(self.rec[key])
        except (TypeError, ValueError, KeyError) as exc:
            msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            raise self.error(key, str(msg)) from None


def _section(doc: Mapping[str, Any], key: str, file: str) -> list[Any]:
    rows = doc.get(key, [])
    if not isinstance(rows, list):
        raise ExportFormatError(f"{file}: {key}: must be a list, got {type(rows).__name__}")
    return rows


def _str(x: Any) -> str:
    if not isinstance(x, str):
        raise TypeError(f"must be a string, got {x!r}")
    return x


def _opt_str(x: Any) -> str | None:
    return None if x is None else _str(x)


def _opt_int(x: Any) -> int | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"must be an integer or null, got {x!r}")
    return x


def check_doc(doc: Mapping[str, Any], file: str) -> dict[str, Any]:
    """Every record of a version 2 doc checked and normalized (see `read_export`)."""
    if doc.get("_checked"):
        return dict(doc)
    out: dict[str, Any] = {"format": EXPORT_FORMAT, "schema_version": SCHEMA_VERSION,
                           "workloads": [], "environments": [], "candidates": [], "winners": [],
                           "_checked": True, "_file": file}
    kernels: dict[str, str] = {}
    for i, rec in enumerate(_section(doc, "workloads", file)):
        w = _Where(file, "workloads", i, rec)
        h = w.get("spec_hash", lambda x: nonempty(x, "spec_hash"))
        w.label = f" ({h[:12]})"
        k = w.get("kernel_hash", lambda x: nonempty(x, "kernel_hash"))
        out["workloads"].append({
            "spec_hash": h, "kernel_hash": k,
            "spec": w.get("spec", lambda x: json_object(x, "spec")),
            "created_at": w.get("created_at", lambda x: parse_time(x, "created_at"),
                                default=None)})
        kernels[h] = k
    envs: dict[str, str] = {}  # the file's env_key -> ours (the same unless the hash changes)
    for i, rec in enumerate(_section(doc, "environments", file)):
        w = _Where(file, "environments", i, rec)
        try:
            norm = normalize_env(rec)
        except ValueError as exc:
            raise w.error(None, str(exc)) from None
        out["environments"].append(norm)
        envs[rec.get("env_key") or env_key(norm)] = env_key(norm)
    for i, rec in enumerate(_section(doc, "candidates", file)):
        w = _Where(file, "candidates", i, rec)
        variant = w.get("variant", normalize_variant)
        w.label = f" ({variant['config']})"
        out["candidates"].append({"variant": variant,
                                  "config": w.get("config", lambda x: json_object(x, "config"))})
    for i, rec in enumerate(_section(doc, "winners", file)):
        w = _Where(file, "winners", i, rec)
        if isinstance(rec.get("variant"), Mapping) and isinstance(
                rec["variant"].get("config"), str):
            w.label = f" ({rec['variant']['config']})"
        h = w.get("spec_hash", lambda x: nonempty(x, "spec_hash"))
        variant = w.get("variant", normalize_variant)
        if h in kernels and variant["kernel_hash"] != kernels[h]:
            raise w.error("variant", f"kernel_hash {variant['kernel_hash'][:12]} is not the "
                          f"kernel of workload {h[:12]} ({kernels[h][:12]})")
        ek = w.get("env_key", _opt_str, default=None)
        if ek is not None and ek not in envs:
            raise w.error("env_key", f"{ek!r} names no environment of the file")
        out["winners"].append({
            "spec_hash": h,
            "device_name": w.get("device_name", lambda x: nonempty(x, "device_name")),
            "variant": variant,
            "median_ms": w.get("median_ms", finite_ms),
            "timer": w.get("timer", lambda x: nonempty(x, "timer")),
            "recorded_at": w.get("recorded_at", lambda x: parse_time(x, "recorded_at"),
                                 default=None),
            "env_key": None if ek is None else envs[ek],
            "study": w.get("study", lambda x: _opt_str(x) or "", default=""),
            "trial_number": w.get("trial_number", _opt_int, default=None),
            "template_set_hash": w.get("template_set_hash", lambda x: _opt_str(x) or "",
                                       default=""),
            "_where": (w.section, w.index, w.label),
        })
    return out


# --------------------------------------------------------------------------- version 1


def _kernel_hash(spec: Mapping[str, Any], spec_hash: str) -> str:
    """The kernel hash of a version 1 workload's spec (its spec hash when it is not a spec
    this tilegen can read: the workload then only matches itself)."""
    try:
        from tilegen.spec import Spec

        return Spec.from_dict(dict(spec)).kernel_hash
    except Exception:  # noqa: BLE001 - an old or foreign spec: keep it, unmatched
        return spec_hash


def upgrade_doc(doc: Mapping[str, Any], file: str | Path) -> dict[str, Any]:
    """A version 1 export (or DB dump) as a version 2 document.

    - workloads get their kernel hash (computed from the spec);
    - a winner's variant key is (kernel hash, "triton" — version 1 only tuned the Triton op,
      config name, its candidate's source sha256, its ``toolchain_key``, its ``arch``); its
      timer is "fake-deterministic" on device "cpu" (version 1 recorded a winner only for the
      real timer on a GPU, or for the test-only timer on the CPU) and "do_bench" otherwise; its
      environment is the one of the same device, arch and template set when there is exactly
      one; ``template_set_hash`` is kept as information;
    - a candidate gets the toolchain and target of the winner or trials that name it, else of
      the file's environments when they all agree; otherwise it is dropped (nothing says what
      it was compiled with);
    - trials are dropped: Optuna's study is their record.
    """
    file = str(file)
    out: dict[str, Any] = {"format": EXPORT_FORMAT, "schema_version": SCHEMA_VERSION,
                           "workloads": [], "environments": [], "candidates": [],
                           "winners": []}
    kernel: dict[str, str] = {}
    for i, rec in enumerate(_section(doc, "workloads", file)):
        w = _Where(file, "workloads", i, rec)
        h = w.get("spec_hash", lambda x: nonempty(x, "spec_hash"))
        spec = w.get("spec", lambda x: json_object(x, "spec"))
        kernel[h] = _kernel_hash(spec, h)
        out["workloads"].append({"spec_hash": h, "kernel_hash": kernel[h], "spec": spec,
                                 "created_at": rec.get("created_at")})
    envs = []
    for i, rec in enumerate(_section(doc, "environments", file)):
        w = _Where(file, "environments", i, rec)
        try:
            norm = normalize_env(rec)
        except ValueError as exc:
            raise w.error(None, str(exc)) from None
        envs.append({"env_key": env_key(norm), **norm})
    env_by_key = {e["env_key"]: e for e in envs}
    for rec in _section(doc, "environments", file):
        if isinstance(rec, Mapping) and rec.get("env_key"):
            env_by_key.setdefault(rec["env_key"], env_by_key[env_key(normalize_env(rec))])
    # where each candidate ran: (toolchain, target) from winners, then trials
    ran: dict[tuple[str, str, str], tuple[str, str]] = {}
    winners_v1 = _section(doc, "winners", file)
    for i, rec in enumerate(winners_v1):
        w = _Where(file, "winners", i, rec)
        w.label = f" ({rec.get('config_name')})"
        key = (w.get("spec_hash", _str), w.get("config_name", _str),
               w.get("source_sha256", _str))
        ran.setdefault(key, (w.get("toolchain_key", _str), w.get("arch", _str)))
    for t in doc.get("trials", []) or []:
        e = env_by_key.get(t.get("env_key")) if isinstance(t, Mapping) else None
        if e is not None and e["triton"]:
            key = (t.get("spec_hash"), t.get("config_name"), t.get("source_sha256"))
            ran.setdefault(key, (f"triton={e['triton']}", e["arch"]))  # type: ignore[index]
    same = {(f"triton={e['triton']}", e["arch"]) for e in envs if e["triton"]}
    fallback = same.pop() if len(same) == 1 else None
    for i, rec in enumerate(_section(doc, "candidates", file)):
        w = _Where(file, "candidates", i, rec)
        w.label = f" ({rec.get('config_name')})"
        h = w.get("spec_hash", _str)
        name = w.get("config_name", lambda x: nonempty(x, "config_name"))
        sha = w.get("source_sha256", lambda x: nonempty(x, "source_sha256"))
        where = ran.get((h, name, sha), fallback)
        if where is None or h not in kernel:
            continue
        out["candidates"].append({
            "variant": {"kernel_hash": kernel[h], "backend": "triton", "config": name,
                        "source_sha256": sha, "toolchain": where[0], "target": where[1]},
            "config": w.get("config", lambda x: json_object(x, "config"))})
    for i, rec in enumerate(winners_v1):
        w = _Where(file, "winners", i, rec)
        w.label = f" ({rec.get('config_name')})"
        h = w.get("spec_hash", _str)
        if h not in kernel:
            raise w.error("spec_hash", f"{h[:12]} names no workload of the file")
        device = w.get("device_name", lambda x: nonempty(x, "device_name"))
        arch = w.get("arch", lambda x: nonempty(x, "arch"))
        tpl = w.get("template_set_hash", _str, default="")
        match = [e for e in envs if (e["device_name"], e["arch"], e["template_set_hash"])
                 == (device, arch, tpl)]
        out["winners"].append({
            "spec_hash": h, "device_name": device,
            "variant": {"kernel_hash": kernel[h], "backend": "triton",
                        "config": w.get("config_name", _str),
                        "source_sha256": w.get("source_sha256", _str),
                        "toolchain": w.get("toolchain_key", _str), "target": arch},
            "median_ms": w.get("median_ms", finite_ms),
            "timer": "fake-deterministic" if device == "cpu" else "do_bench",
            "recorded_at": rec.get("recorded_at"),
            "env_key": match[0]["env_key"] if len(match) == 1 else None,
            "study": "", "trial_number": None, "template_set_hash": tpl})
    used = {w["env_key"] for w in out["winners"] if w["env_key"]}
    out["environments"] = [e for e in envs if e["env_key"] in used]
    return out


# --------------------------------------------------------------------------- import


def import_doc(s: Session, doc: Mapping[str, Any], *, force: bool = False,
               currency: Currency | None = None) -> ImportReport:
    """Merge a checked document (`read_export`) into the DB behind `s`.

    Existing rows are kept. A winner conflict (same spec, backend, device and target) is
    settled by `tilegen.db.policy.decide` with ``currency`` (whether a variant is current in
    this checkout; None: unknown) and ``force``; every conflict that is not the same winner
    again gets a line in the report's ``notes``.
    """
    rep = ImportReport()
    doc = check_doc(doc, str(doc.get("_file", "export")))
    file = doc["_file"]
    for i, w in enumerate(doc["workloads"]):
        try:
            _row, added = put_workload(s, w["spec_hash"], w["kernel_hash"],
                                       canonical_json(w["spec"]),
                                       w["created_at"] or parse_time(None))
        except ConflictError as exc:
            raise ConflictError(f"{file}: workloads[{i}] ({w['spec_hash'][:12]}): spec: "
                                f"{exc}") from None
        rep.workloads_added += added
    envs: dict[str, int] = {}
    for e in doc["environments"]:
        row, added = put_environment(s, normalize_env(e))
        envs[env_key(e)] = row.id
        rep.environments_added += added
    for c in doc["candidates"]:
        _row, added = put_candidate(s, c["variant"], canonical_json(c["config"]))
        rep.candidates_added += added
    for w in doc["winners"]:
        section, index, label = w.get("_where", ("winners", 0, ""))
        where = f"{file}: {section}[{index}]{label}"
        wl = s.scalar(select(Workload).where(Workload.spec_hash == w["spec_hash"]))
        if wl is None:
            raise ExportFormatError(f"{where}: spec_hash: {w['spec_hash'][:12]} names no "
                                    "workload of the file or the DB")
        if wl.kernel_hash != w["variant"]["kernel_hash"]:
            raise ExportFormatError(f"{where}: variant: kernel_hash is not the kernel of "
                                    f"workload {w['spec_hash'][:12]}")
        cand = s.scalar(select(Candidate).where(
            Candidate.variant_digest == variant_digest(w["variant"])))
        if cand is None:
            raise ExportFormatError(f"{where}: variant: no candidate (config) with this variant "
                                    "key in the file or the DB")
        ek = w["env_key"]
        env_id = None
        if ek is not None:
            env_id = envs.get(ek) or s.scalar(
                select(Environment.id).where(Environment.env_key == ek))
        new = Winner(workload_id=wl.id, backend=cand.backend, device_name=w["device_name"],
                     target=cand.target, candidate_id=cand.id, median_ms=w["median_ms"],
                     timer=w["timer"], environment_id=env_id, study=w["study"],
                     trial_number=w["trial_number"],
                     template_set_hash=w["template_set_hash"],
                     recorded_at=w["recorded_at"] or parse_time(None))
        new_current = None if currency is None else currency(
            cand.variant(), json.loads(cand.config_json), json.loads(wl.spec_json))
        res = put_winner(s, new, cand, force=force, currency=currency,
                         new_current=new_current)
        if res.action == "inserted":
            rep.winners_inserted += 1
        elif res.action == "replaced":
            rep.winners_replaced += 1
        else:
            rep.winners_kept += 1
        if res.previous is not None and res.reason != "same":
            what = (f"winner of {w['spec_hash'][:12]} on {w['device_name']} "
                    f"({cand.backend}, {cand.target})")
            old = res.previous.record(currency)
            newrec = policy.WinnerRecord(cand.variant(), new.median_ms, new.timer,
                                         new.recorded_at, new_current)
            rep.notes.append(policy.explain(policy.Decision(res.action == "replaced",
                                                            res.reason), what, old, newrec))
    return rep


def load_doc(conn: Connection, doc: Mapping[str, Any]) -> None:
    """Write a converted document into fresh tables on `conn` (the v1 -> v2 migration)."""
    with Session(bind=conn) as s:
        import_doc(s, check_doc(doc, str(conn.engine.url.database or "<memory>")))
        s.flush()


__all__ = [
    "EXPORT_FORMAT",
    "VARIANT_FIELDS",
    "check_doc",
    "dumps",
    "export_dict",
    "import_doc",
    "load_doc",
    "read_export",
    "upgrade_doc",
    "write_export",
]
