"""``tilegen tune`` and ``tilegen db``: parsers that plug into tilegen's command line.

`tilegen.cli` wires them in with ``add_tune_parser(sub)`` and ``add_db_parser(sub)``; each
parser sets ``func`` to a handler that takes the parsed namespace and returns an exit code.
``python -m tilegen.tune.cli {tune,db} ...`` runs them on their own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TUNE_EPILOG = """examples:
  tilegen tune --trials 40                                  # default spec, this GPU
  tilegen tune --captures caps/ --export tuning_db/winners.json --plot history.png
  tilegen tune --workers 4                                  # one worker per local GPU, one study
  tilegen tune --storage postgresql://user@db/tilegen --study wan-h200   # same command on each host
  TRITON_INTERPRET=1 tilegen tune --target sm_90 --spec tiny.toml --timer fake-deterministic
                                                            # CPU smoke test (fake timer: test only)

Re-running the same command resumes the study: trials a killed run left RUNNING are marked
FAIL ("interrupted") and their configs queued again; only the remainder of --trials runs.
"""

DB_EPILOG = """examples:
  tilegen db list
  tilegen db show 3f2a9c            # a spec hash or a unique prefix of one
  tilegen db export --out tuning_db/winners.json [--spec-hash H] [--trials]
  tilegen db import tuning_db/winners.json [--force]
"""


def _spec(args: argparse.Namespace):
    from tilegen.spec import Spec

    return Spec.from_file_or_default(getattr(args, "spec", None))


def cmd_tune(args: argparse.Namespace) -> int:
    """Run or resume a tuning session; 0 when a passing config exists, 1 when none passed."""
    from tilegen.tune.session import SessionError, TuneOptions, run_session
    from tilegen.tune.space import parse_space_override

    space: dict[str, Any] = {}
    for text in args.space or []:
        name, values = parse_space_override(text)
        space[name] = values
    opts = TuneOptions(
        spec=_spec(args), target=args.target, captures=args.captures, seeds=args.seeds,
        trials=args.trials, storage=args.storage, study=args.study, workers=args.workers,
        timeout_s=args.timeout, setup_timeout_s=args.setup_timeout, timer=args.timer,
        db_path=args.db, sampler=args.sampler, sampler_seed=args.seed, space=space,
        export=args.export, summary=args.summary, plot=args.plot, top=args.top)
    if args.op_factory:
        opts.op_factory = args.op_factory
    try:
        result = run_session(opts)
    except SessionError as exc:
        print(f"tilegen tune: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tilegen tune: interrupted; re-run the same command to resume", file=sys.stderr)
        return 130
    return 0 if result.best is not None else 1


def add_tune_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``tune`` to `subparsers` (a ``parser.add_subparsers()`` result)."""
    from tilegen.targets import TARGET_NAMES
    from tilegen.tune.objective import TIMERS
    from tilegen.tune.session import SAMPLERS

    p = subparsers.add_parser(
        "tune", help="autotune the spec on this device (Optuna), record the winner",
        description="Search the spec's tunable space (targets/<target>/target.toml [tunable]) "
        "with Optuna. Every trial is gated by the contract's scoring rule on every capture "
        "(an outlier one included) and timed kernel-only with triton.testing.do_bench; "
        "infeasible configs are pruned before compiling; failures are recorded by class. The "
        "best passing config becomes the winner that tilegen.load uses on this kind of device.",
        epilog=TUNE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", help="spec file (.toml or .json); default: the Wan2.2 workload spec")
    p.add_argument("--target", choices=TARGET_NAMES,
                   help="target (default: the GPU's; required under the CPU interpreter)")
    p.add_argument("--captures", default="synthetic",
                   help="directory of capture .pt files, or 'synthetic' (default); a synthetic "
                   "outlier capture is added when none of the set has an outlier head")
    p.add_argument("--seeds", type=int, default=2,
                   help="synthetic captures to make (seeds 0..N-1, each with an outlier head)")
    p.add_argument("--trials", type=int, default=40,
                   help="trials in the study, counting earlier runs of it (default 40)")
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite:///<dir of the "
                   "tilegen DB>/optuna.sqlite); postgresql://... lets several hosts share a study")
    p.add_argument("--study", help="study name (default: tilegen-<spec>-<target>-<device>-"
                   "t<template hash>)")
    p.add_argument("--workers", type=int, default=1,
                   help="local workers, one per GPU (CUDA_VISIBLE_DEVICES), sharing one study")
    p.add_argument("--timeout", type=float, default=240.0,
                   help="seconds per trial (compile + gate + timing) before the worker is "
                   "killed and the trial recorded as 'timeout' (default 240)")
    p.add_argument("--setup-timeout", type=float, default=900.0,
                   help="seconds for a worker to start and prepare captures (default 900)")
    p.add_argument("--timer", choices=TIMERS, default="do_bench",
                   help="do_bench (default: CUDA events, warmed, kernel-only median). "
                   "fake-deterministic is TEST-ONLY: a latency derived from the config name, "
                   "for CPU runs under TRITON_INTERPRET=1; the correctness gate still runs")
    p.add_argument("--db", help="tilegen tuning DB file (default: $TILEGEN_DB, else "
                   "~/.cache/tilegen/tuning.sqlite)")
    p.add_argument("--sampler", choices=SAMPLERS, default="auto",
                   help="auto (default): every point when the space fits in --trials, else TPE")
    p.add_argument("--seed", type=int, default=0, help="sampler seed")
    p.add_argument("--space", action="append", metavar="NAME=V1,V2",
                   help="replace or add a tunable field's values (repeatable), e.g. "
                   "--space num_stages=2,3,4,5")
    p.add_argument("--export", metavar="JSON",
                   help="after the session, export this spec's winners and candidates "
                   "(tilegen db export format), e.g. tuning_db/winners.json; an existing "
                   "export there is merged with, not overwritten (same rules as db import)")
    p.add_argument("--summary", metavar="JSON",
                   help="write the session summary (wall time, counts, best, seeds, speedups)")
    p.add_argument("--plot", metavar="PNG", help="plot the tuning history (needs matplotlib)")
    p.add_argument("--top", type=int, default=10, help="rows of the final table (default 10)")
    # Test hook, hidden: 'module:function' building the op from (spec, config), e.g. an op
    # that returns a wrong result, sleeps or crashes, to exercise the failure classes.
    p.add_argument("--op-factory", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_tune)
    return p


# ============================================================================ db


#: Actions that only read the DB: they never create it (or its folder).
_READ_ONLY = ("list", "show", "export")


def _open_db(args: argparse.Namespace):
    from tilegen.db import TuningDB

    return TuningDB.open(args.db)


def _missing_db(args: argparse.Namespace) -> int | None:
    """For a read-only action on a DB file that does not exist: say so and return the exit
    code (0 for list: an empty listing; 1 for show and export: nothing to show). Else None."""
    from tilegen.db import resolve_db_path

    if args.action not in _READ_ONLY:
        return None
    path = resolve_db_path(args.db)
    if path.exists():
        return None
    line = f"no tuning DB at {path} (nothing tuned yet; run tilegen tune)"
    if args.action == "list":
        print(line)
        return 0
    print(f"tilegen db: error: {line}", file=sys.stderr)
    return 1


def _resolve_hash(db: Any, prefix: str) -> str:
    hashes = [w.spec_hash for w in db.list_workloads()]
    found = [h for h in hashes if h.startswith(prefix)]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise KeyError(f"{what} workload(s) in {db.path} match spec hash {prefix!r}")
    return found[0]


def cmd_db(args: argparse.Namespace) -> int:
    code = _missing_db(args)
    if code is not None:
        return code
    try:
        with _open_db(args) as db:
            return _DB_ACTIONS[args.action](db, args)
    except (KeyError, ValueError, OSError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"tilegen db: error: {message}", file=sys.stderr)
        return 1


def _db_list(db: Any, args: argparse.Namespace) -> int:
    rows = db.list_workloads()
    print(f"tuning DB {db.path}: {len(rows)} workload(s)")
    if rows:
        print(f"  {'spec hash':14s} {'cands':>5s} {'trials':>6s} {'winners':>7s}  spec")
    for w in rows:
        s = w.spec
        brief = (f"{s.get('encoding')} d{s.get('head_dim')} {s.get('dtype')} "
                 f"grid={s.get('grid')} heads={s.get('num_heads')} topk={s.get('topk')}")
        print(f"  {w.spec_hash[:12]:14s} {w.n_candidates:5d} {w.n_trials:6d} {w.n_winners:7d}"
              f"  {brief}")
    return 0


def _db_show(db: Any, args: argparse.Namespace) -> int:
    d = db.show(_resolve_hash(db, args.spec_hash), best=args.best)
    w = d.workload
    print(f"spec {w.spec_hash}")
    print(f"  {json.dumps(w.spec, sort_keys=True)}")
    print("  trials by status: " + (", ".join(f"{k} {v}" for k, v in d.status_counts.items())
                                     or "none"))
    print("winners:" if d.winners else "winners: none")
    for x in d.winners:
        print(f"  {x.device_name} ({x.arch}): {x.config_name} {x.median_ms:.4f} ms  "
              f"templates {x.template_set_hash[:12]}  {x.toolchain_key}  "
              f"recorded {x.recorded_at:%Y-%m-%d %H:%M}")
    if d.best_trials:
        print(f"fastest passing trials (up to {args.best}):")
        for t in d.best_trials:
            tf = f"{t.tflops:7.1f} TFLOP/s" if t.tflops is not None else ""
            print(f"  {t.study}#{t.trial_number:<4d} {t.config_name:28s} {t.median_ms:9.4f} ms "
                  f"{tf}  {t.device_name}")
    return 0


def _db_export(db: Any, args: argparse.Namespace) -> int:
    spec_hash = _resolve_hash(db, args.spec_hash) if args.spec_hash else None
    text = db.export_json(args.out, spec_hash=spec_hash, include_trials=args.trials)
    if args.out:
        doc = json.loads(text)
        print(f"exported {len(doc['workloads'])} workload(s), {len(doc['winners'])} winner(s) "
              f"to {args.out}")
    else:
        sys.stdout.write(text)
    return 0


def _db_import(db: Any, args: argparse.Namespace) -> int:
    from tilegen.tune.session import _current_identity

    rep = db.import_json(Path(args.file), force=args.force, current=_current_identity())
    print(f"imported {args.file} into {db.path}: workloads +{rep.workloads_added}, "
          f"environments +{rep.environments_added}, candidates +{rep.candidates_added}, "
          f"trials +{rep.trials_added} ({rep.trials_skipped} already there), winners "
          f"+{rep.winners_inserted} new, {rep.winners_replaced} replaced, "
          f"{rep.winners_kept} kept" + ("" if rep.changed else " (nothing changed)"))
    for note in rep.notes:
        print(f"  {note}")
    return 0


_DB_ACTIONS = {"list": _db_list, "show": _db_show, "export": _db_export, "import": _db_import}


def add_db_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``db {list,show,export,import}`` to `subparsers`."""
    p = subparsers.add_parser(
        "db", help="inspect, export and import the tuning DB",
        description="The tuning DB (SQLite): workloads, environments, candidates, trials and "
        "winners. Export writes reviewable JSON (the format of tuning_db/*.json); import merges "
        "an export into this DB (to seed another machine).",
        epilog=DB_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", help="DB file (default: $TILEGEN_DB, else "
                   "~/.cache/tilegen/tuning.sqlite)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    a = actions.add_parser("list", help="workloads with counts of candidates, trials, winners")
    a = actions.add_parser("show", help="one workload: winners, fastest trials, status counts")
    a.add_argument("spec_hash", help="spec hash or a unique prefix")
    a.add_argument("--best", type=int, default=10, help="fastest passing trials to list")
    a = actions.add_parser("export", help="write JSON (stdout without --out)")
    a.add_argument("--out", help="file to write (atomically)")
    a.add_argument("--spec-hash", help="only this workload (hash or unique prefix)")
    a.add_argument("--trials", action="store_true", help="include every trial")
    a = actions.add_parser("import", help="merge an export into this DB")
    a.add_argument("file")
    a.add_argument("--force", action="store_true",
                   help="take the file's winners even where the local ones are faster")
    p.set_defaults(func=cmd_db)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m tilegen.tune.cli {tune,db} ...`` (the same parsers as ``tilegen``)."""
    import logging

    parser = argparse.ArgumentParser(prog="tilegen")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_tune_parser(sub)
    add_db_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="tilegen: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tilegen: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
