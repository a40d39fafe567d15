"""``tilegen db {list,show,export,import}``: the parser that plugs into tilegen's command line.

`tilegen.cli` wires it in with ``add_db_parser(sub)``; the parser sets ``func`` to `cmd_db`,
which returns an exit code: 0 done, 1 nothing to show or a bad export file, 2 the DB file
itself cannot be used (not a DB, truncated, read-only for ``import``, under a regular file) or
a path option is wrong (``export --out`` a directory or an unwritable place, ``import FILE``
missing): one line naming the path and the cause, checked before the DB is opened, the file
left untouched.

``list``, ``show`` and ``export`` open the DB read-only (they work on a read-only mount and never
create a file); ``import`` and ``migrate`` open it read-write (``migrate`` only brings an older
file to the current schema version). ``--db`` may come before or after the action.

``list`` and ``show`` also show the shipped winners (``tuning_db/*.json``, which `tilegen.load`
reads with no import), marked "shipped"; they work with no DB file at all.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tilegen.db import policy

DB_EPILOG = """examples:
  tilegen db list
  tilegen db list --db /shared/tuning.sqlite
  tilegen db show 3f2a9c            # a spec hash or a unique prefix of one
  tilegen db export --out tuning_db/winners.json [--spec-hash H] [--include-fake]
  tilegen db export --spec-hash a19100 --out tuning_db/winners.json --merge   # after a re-tune
  tilegen db import tuning_db/winners.json [--force]
"""

#: Actions that only read the DB: opened read-only, never created.
READ_ONLY = ("list", "show", "export")


def _db_path(args: argparse.Namespace) -> Path:
    from tilegen.db.engine import resolve_db_path

    return resolve_db_path(getattr(args, "db", None))


def _no_db_line(path: Path) -> str:
    return f"no tuning DB at {path} (nothing tuned yet; run tilegen tune)"


def _missing_db(args: argparse.Namespace, path: Path) -> int | None:
    """For ``export`` from a DB file that does not exist: say so and return 1 (nothing to
    export). Else None (``list`` and ``show`` go on with the shipped winners alone)."""
    if args.action != "export" or path.exists():
        return None
    print(f"tilegen db: error: {_no_db_line(path)}", file=sys.stderr)
    return 1


@dataclass(frozen=True)
class _Shipped:
    """One shipped export (``tuning_db/*.json``), checked (`tilegen.db.exchange.check_doc`)."""

    path: Path
    doc: dict[str, Any]

    def workload(self, spec_hash: str) -> dict[str, Any] | None:
        return next((w for w in self.doc["workloads"] if w["spec_hash"] == spec_hash), None)

    def winners(self, spec_hash: str) -> list[Any]:
        """The file's winners of `spec_hash`, as `tilegen.db.rows.WinnerInfo`."""
        from tilegen.db.rows import WinnerInfo, variant_digest

        wl = self.workload(spec_hash)
        if wl is None:
            return []
        configs = {variant_digest(c["variant"]): c["config"] for c in self.doc["candidates"]}
        return [WinnerInfo(
            spec_hash=spec_hash, kernel_hash=wl["kernel_hash"], spec=wl["spec"],
            backend=w["variant"]["backend"], device_name=w["device_name"],
            target=w["variant"]["target"], config_name=w["variant"]["config"],
            config=configs.get(variant_digest(w["variant"]), {}), variant=w["variant"],
            median_ms=w["median_ms"], timer=w["timer"], recorded_at=w["recorded_at"],
            env_key=w["env_key"], study=w["study"], trial_number=w["trial_number"])
            for w in self.doc["winners"] if w["spec_hash"] == spec_hash]

    def n_candidates(self, kernel_hash: str) -> int:
        return sum(c["variant"]["kernel_hash"] == kernel_hash for c in self.doc["candidates"])


def _shipped() -> list[_Shipped]:
    """The shipped exports `tilegen.load` reads with no import (`tilegen.winners.SHIPPED_DIR`);
    another JSON file there is skipped, a broken export is named on stderr and skipped."""
    from tilegen import winners
    from tilegen.db.exchange import read_export

    def unreadable(path: Path, exc: Exception) -> None:
        print(f"tilegen db: note: shipped winners {path} cannot be read ({exc}); left out",
              file=sys.stderr)

    out = []
    for path, doc in winners.export_files(Path(winners.SHIPPED_DIR), unreadable):
        try:
            out.append(_Shipped(path, read_export(doc, name=str(path))))
        except ValueError as exc:
            unreadable(path, exc)
    return out


def _resolve_hash(db: Any, prefix: str, shipped: Sequence[_Shipped] = (),
                  path: Path | None = None) -> str:
    hashes = {w.spec_hash for w in db.list_workloads()} if db is not None else set()
    hashes |= {w["spec_hash"] for s in shipped for w in s.doc["workloads"]}
    found = sorted(h for h in hashes if h.startswith(prefix))
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        where = db.path if db is not None else path
        extra = " or the shipped winners" if shipped else ""
        raise KeyError(f"{what} workload(s) in {where}{extra} match spec hash {prefix!r}")
    return found[0]


def _check_paths(args: argparse.Namespace, path: Path) -> None:
    """The action's path options and the DB's place, before the DB is opened: `PathError` or
    `TuningDBError`, one line naming the path (exit status 2)."""
    from tilegen import pathcheck
    from tilegen.db.engine import check_location, check_writable, db_setting

    setting = db_setting(getattr(args, "db", None))
    check_location(path, setting)
    if args.action == "export" and args.out:
        pathcheck.writable_file(args.out, "--out")
        if args.merge and Path(args.out).exists():
            pathcheck.readable_file(args.out, "--out")  # merged with, so read first
    if args.action == "import":
        pathcheck.readable_file(args.file, "import file")
    if args.action not in READ_ONLY and (args.action != "migrate" or path.exists()):
        check_writable(path, setting)


def cmd_db(args: argparse.Namespace) -> int:
    from tilegen.db.errors import ConflictError, ExportFormatError, TuningDBError
    from tilegen.db.records import TuningDB
    from tilegen.pathcheck import PathError

    path = _db_path(args)
    args.db_file = path  # for list and show without a DB file
    try:
        _check_paths(args, path)
    except (PathError, TuningDBError) as exc:
        print(f"tilegen db: error: {exc}", file=sys.stderr)
        return 2
    code = _missing_db(args, path)
    if code is not None:
        return code
    if args.action == "migrate" and not path.exists():
        print(f"tilegen db: error: no tuning DB at {path}", file=sys.stderr)
        return 1
    try:
        if args.action in ("list", "show") and not path.exists():
            return _ACTIONS[args.action](None, args)  # the shipped winners alone
        with TuningDB.open(path, readonly=args.action in READ_ONLY) as db:
            return _ACTIONS[args.action](db, args)
    except (TuningDBError, PathError) as exc:
        print(f"tilegen db: error: {exc}", file=sys.stderr)
        return 2
    except (ExportFormatError, ConflictError) as exc:
        print(f"tilegen db: error: {exc}", file=sys.stderr)
        return 1
    except (KeyError, ValueError, OSError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"tilegen db: error: {message}", file=sys.stderr)
        return 1


def _grid(spec: dict[str, Any]) -> str:
    return "x".join(str(g) for g in spec.get("grid", ()))


def _fields(spec: dict[str, Any]) -> str:
    return (f"{spec.get('encoding')} d{spec.get('head_dim')} {spec.get('dtype')} "
            f"q{spec.get('block_q')} {spec.get('layout')}")


_WORKLOAD_COLUMNS = ["spec", "kernel", "kernel fields", "grid", "heads", "topk", "batch",
                     "candidates", "winners"]


def _list(db: Any, args: argparse.Namespace) -> int:
    from tilegen.db.tables import print_table

    right = ("heads", "topk", "batch", "candidates", "winners", "studies")
    if db is None:
        print(_no_db_line(args.db_file))
    else:
        rows = db.list_workloads()
        print(f"tuning DB {db.path}{' (read-only)' if db.readonly else ''}: "
              f"{len(rows)} workload(s)")
        if rows:
            print_table(
                [*_WORKLOAD_COLUMNS, "studies"],
                [[w.spec_hash[:12], w.kernel_hash[:12], _fields(w.spec), _grid(w.spec),
                  w.spec.get("num_heads"), w.spec.get("topk"), w.spec.get("batch"),
                  w.n_candidates, w.n_winners, w.n_studies] for w in rows], right=right)
    # tilegen.load uses these too, with no import: show them beside the DB's
    for shipped in _shipped():
        docs = shipped.doc["workloads"]
        n_win = len(shipped.doc["winners"])
        print(f"shipped winners {shipped.path} (used by tilegen.load without an import): "
              f"{len(docs)} workload(s), {n_win} winner(s)")
        if docs:
            print_table(
                [*_WORKLOAD_COLUMNS, "from"],
                [[w["spec_hash"][:12], w["kernel_hash"][:12], _fields(w["spec"]),
                  _grid(w["spec"]), w["spec"].get("num_heads"), w["spec"].get("topk"),
                  w["spec"].get("batch"), shipped.n_candidates(w["kernel_hash"]),
                  len(shipped.winners(w["spec_hash"])), "shipped"] for w in docs],
                right=right)
    return 0


def _study_trials(storage: str, name: str, best: int) -> list[list[Any]] | str:
    """The fastest passing trials of an Optuna study, or why they cannot be read."""
    try:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)
        rdb = optuna.storages.RDBStorage(storage, skip_table_creation=True,
                                         skip_compatibility_check=True)
        study = optuna.load_study(study_name=name, storage=rdb)
        done = study.get_trials(deepcopy=False,
                                states=(optuna.trial.TrialState.COMPLETE,))
    except Exception as exc:  # noqa: BLE001 - another host's storage, a moved file, ...
        return f"not readable here ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    done = [t for t in done if t.user_attrs.get("duplicate_of") is None]
    done.sort(key=lambda t: (t.value, t.number))
    return [[t.number, t.user_attrs.get("config", "?"),
             policy.timed_figure(t.value, t.user_attrs.get("timer")),
             policy.timed_figure(t.user_attrs.get("tflops"), t.user_attrs.get("timer"), ".1f"),
             t.user_attrs.get("timer"), t.user_attrs.get("host")] for t in done[:best]]


def _show(db: Any, args: argparse.Namespace) -> int:
    from tilegen.db.tables import print_table
    from tilegen.winners import variant_currency

    shipped = _shipped()
    if db is None and not any(w["spec_hash"].startswith(args.spec_hash)
                              for s in shipped for w in s.doc["workloads"]):
        print(f"tilegen db: error: {_no_db_line(args.db_file)}", file=sys.stderr)
        return 1
    spec_hash = _resolve_hash(db, args.spec_hash, shipped, args.db_file)
    in_db = db is not None and spec_hash in {w.spec_hash for w in db.list_workloads()}
    d = db.show(spec_hash) if in_db else None
    mine = [(s, wl) for s in shipped if (wl := s.workload(spec_hash)) is not None]
    if d is not None:
        kernel, spec = d.workload.kernel_hash, d.workload.spec
    else:
        kernel, spec = mine[0][1]["kernel_hash"], mine[0][1]["spec"]
    print(f"spec {spec_hash}  (kernel {kernel})")
    print(f"  {json.dumps(spec, sort_keys=True)}")
    if d is not None:
        print(f"  {d.workload.n_candidates} candidate(s) of this kernel; {len(d.studies)} "
              "study(ies)")
    else:
        print(f"  not in the tuning DB {args.db_file if db is None else db.path}")
    for s, _wl in mine:
        print(f"  shipped in {s.path}: {s.n_candidates(kernel)} candidate(s) of this kernel "
              "(used by tilegen.load without an import)")
    found = [("db", x) for x in (d.winners if d is not None else [])]
    found += [("shipped", x) for s, _wl in mine for x in s.winners(spec_hash)]
    if not found:
        print("winners: none")
    else:
        rows = []
        for where, x in found:
            cur = variant_currency(x.variant, x.config, x.spec)
            rows.append([where, x.device_name, x.backend, x.target, x.config_name,
                         policy.timed_figure(x.median_ms, x.timer), x.timer, x.toolchain,
                         x.source_sha256[:12],
                         {True: "yes", False: "STALE", None: "?"}[cur],
                         "-" if x.recorded_at is None else f"{x.recorded_at:%Y-%m-%d %H:%M}"])
        print_table(["from", "device", "backend", "target", "config", "ms", "timer",
                     "toolchain", "source", "current", "recorded"], rows, title="winners:",
                    right=("ms",))
        if any(not policy.is_real_timer(x.timer) for _, x in found):
            print(f"  (fake): {policy.FAKE_NOTE}")
    for st in (d.studies if d is not None else []):
        print(f"study {st.name} in {st.storage} ({st.device_name}, {st.target}, timer "
              f"{st.timer})")
        trials = _study_trials(st.storage, st.name, args.best)
        if isinstance(trials, str):
            print(f"  trials: {trials}")
        elif trials:
            print_table(["trial", "config", "ms", "TFLOP/s", "timer", "host"], trials,
                        title=f"  fastest passing trials (up to {args.best}):",
                        right=("trial", "ms", "TFLOP/s"))
            if any(not policy.is_real_timer(row[4]) for row in trials):
                print(f"  (fake): {policy.FAKE_NOTE}")
        else:
            print("  trials: none passed")
    return 0


def _export(db: Any, args: argparse.Namespace) -> int:
    from tilegen.db.exchange import write_export

    spec_hash = _resolve_hash(db, args.spec_hash) if args.spec_hash else None
    doc = db.export_dict(spec_hash=spec_hash, include_fake=args.include_fake)
    left = doc.get("_left_out_fake", 0)
    note = (f"; left out {left} winner(s) timed by a test-only timer (--include-fake exports "
            "them)") if left else ""
    if args.out and args.merge and Path(args.out).exists():
        from tilegen.db.records import merge_export_file
        from tilegen.winners import variant_currency

        rep = merge_export_file(args.out, doc, currency=variant_currency)
        assert rep is not None
        print(f"merged {len(doc['workloads'])} workload(s), {len(doc['winners'])} winner(s) "
              f"into {args.out}" + ("" if rep.changed else " (no change)") + note)
        for line in rep.notes:
            print(f"  {line}")
    elif args.out:
        write_export(doc, args.out)
        print(f"exported {len(doc['workloads'])} workload(s), {len(doc['winners'])} winner(s) "
              f"to {args.out}{note}")
    else:
        sys.stdout.write(write_export(doc))
        if note:
            print(f"tilegen db: {note[2:]}", file=sys.stderr)
    return 0


def _migrate(db: Any, args: argparse.Namespace) -> int:
    print(f"tuning DB {db.path} is at schema version {db.schema_version()}")
    return 0


def _import(db: Any, args: argparse.Namespace) -> int:
    from tilegen.winners import variant_currency

    rep = db.import_json(Path(args.file), force=args.force, currency=variant_currency)
    print(f"imported {args.file} into {db.path}: workloads +{rep.workloads_added}, "
          f"environments +{rep.environments_added}, candidates +{rep.candidates_added}, "
          f"winners +{rep.winners_inserted} new, {rep.winners_replaced} replaced, "
          f"{rep.winners_kept} kept" + ("" if rep.changed else " (nothing changed)"))
    for note in rep.notes:
        print(f"  {note}")
    return 0


_ACTIONS = {"list": _list, "show": _show, "export": _export, "import": _import,
            "migrate": _migrate}


def add_db_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``db {list,show,export,import}`` to `subparsers`."""
    p = subparsers.add_parser(
        "db", help="inspect, export and import the tuning DB",
        description="The tuning DB (SQLite): workloads, environments, candidates (variant "
        "keys), studies and winners. Export writes reviewable JSON (the format of "
        "tuning_db/*.json); import merges an export into this DB (to seed another machine). "
        "Trials live in the Optuna study of each session (db show reads them).",
        epilog=DB_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    db_help = "DB file (default: $TILEGEN_DB, else ~/.cache/tilegen/tuning.sqlite)"
    p.add_argument("--db", help=db_help)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(name: str, **kw: Any) -> argparse.ArgumentParser:
        a = actions.add_parser(name, **kw)
        # --db after the action too; SUPPRESS keeps a --db given before it
        a.add_argument("--db", default=argparse.SUPPRESS, help=db_help)
        return a

    action("list", help="workloads with counts of candidates, winners and studies")
    a = action("show", help="one workload: winners (current or stale), studies, fastest trials")
    a.add_argument("spec_hash", help="spec hash or a unique prefix")
    a.add_argument("--best", type=int, default=10, help="fastest passing trials to list")
    a = action("export", help="write JSON (stdout without --out)")
    a.add_argument("--out", help="file to write (atomically)")
    a.add_argument("--spec-hash", help="only this workload (hash or unique prefix)")
    a.add_argument("--include-fake", action="store_true",
                   help="also export winners timed by a test-only timer (never ship those)")
    a.add_argument("--merge", action="store_true",
                   help="merge into an existing export at --out instead of replacing it (the "
                   "rules of db import: a current winner replaces a stale one), e.g. after a "
                   "re-tune: db export --spec-hash H --out tuning_db/winners.json --merge")
    action("migrate", help="bring an older DB file to this tilegen's schema version (read-only "
           "commands never migrate)")
    a = action("import", help="merge an export into this DB")
    a.add_argument("file")
    a.add_argument("--force", action="store_true",
                   help="take the file's winners even where the local ones are faster")
    p.set_defaults(func=cmd_db)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m tilegen.db.cli db ...`` (the same parser as ``tilegen db``)."""
    parser = argparse.ArgumentParser(prog="tilegen")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_db_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
