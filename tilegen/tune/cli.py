"""``tilegen tune``: the parser that plugs into tilegen's command line.

`tilegen.cli` wires it in with ``add_tune_parser(sub)`` (and ``db`` with
`tilegen.db.cli.add_db_parser`); the parser sets ``func`` to a handler that takes the parsed
namespace and returns an exit code: 0 a passing config exists, 1 none passed, 2 the session
could not run (bad options, a path option that cannot be used, a DB file that is not a DB or is
read-only, a worker whose setup failed: one line on stderr; path and DB problems are found
before any worker starts, and no DB file is created for a session that is refused), 130
interrupted. ``python -m tilegen.tune.cli {tune,db} ...`` runs
them on their own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

TUNE_EPILOG = """examples:
  tilegen tune --trials 40                                  # default spec, this GPU
  tilegen tune --captures caps/ --export tuning_db/winners.json --plot history.png
  tilegen tune --workers 4                                  # one worker per local GPU, one study
  tilegen tune --storage postgresql://user@db/tilegen --study wan-h200   # same command on each host

CPU smoke session (no GPU; from the root of a checkout; about 10 s on 2 idle cores):
  TRITON_INTERPRET=1 tilegen tune --spec bench/specs/cpu_smoke.toml --target sm_90 \\
      --timer fake-deterministic --trials 4 --db /tmp/tilegen-smoke/tuning.sqlite
The Triton interpreter runs the kernels and the correctness gate is real, but the test-only
timer derives each latency from the config's name: its figures print as fake-ms and are never
used by tilegen.load nor exported. Optuna's storage goes beside --db.

Re-running the same command resumes the study: a trial whose session was killed stops sending
heartbeats; Optuna fails it and queues its config again; only the remainder of --trials runs.
Trials live in the Optuna storage (--storage); the tilegen DB keeps environments, candidates
and winners (tilegen db show reads both).
"""


def _spec(args: argparse.Namespace):
    from tilegen.spec import Spec

    return Spec.from_file_or_default(getattr(args, "spec", None))


def check_paths(args: argparse.Namespace) -> None:
    """Every path option of ``tune`` but the DB's, before any worker starts: `PathError` (one
    line naming the path; exit status 2). Creates nothing."""
    from tilegen import pathcheck

    pathcheck.check_spec_option(args)
    pathcheck.check_captures_option(args)
    if args.storage and (file := pathcheck.sqlite_url_file(args.storage)) is not None:
        pathcheck.writable_file(file, "--storage")
    for option, value in (("--export", args.export), ("--summary", args.summary),
                          ("--plot", args.plot)):
        if value:
            pathcheck.writable_file(value, option)
    if args.export and Path(args.export).exists():
        pathcheck.readable_file(args.export, "--export")  # merged with, so read first
    # the DB file itself is checked by the session, before any worker (run_session callers too)


def cmd_tune(args: argparse.Namespace) -> int:
    """Run or resume a tuning session; 0 when a passing config exists, 1 when none passed."""
    from tilegen.db.errors import TuningDBError
    from tilegen.pathcheck import PathError
    from tilegen.tune.session import SessionError, TuneOptions, run_session
    from tilegen.tune.space import parse_space_override

    try:
        check_paths(args)
    except (PathError, TuningDBError) as exc:
        print(f"tilegen tune: error: {exc}", file=sys.stderr)
        return 2
    space: dict[str, Any] = {}
    for text in args.space or []:
        name, values = parse_space_override(text)
        space[name] = values
    backend = args.backend
    if args.backward:
        from tilegen import backends

        backend = backends.get(args.backend).backward
        if backend is None:
            print(f"tilegen tune: error: the {args.backend} family has no backward kernels "
                  "(--backward tunes the triton family's)", file=sys.stderr)
            return 2
        if not _spec(args).encoding_info.takes_lut:
            print(f"tilegen tune: error: --backward tunes the LUT encoding's backward kernels; "
                  f"the spec's encoding is {_spec(args).encoding!r}", file=sys.stderr)
            return 2
    opts = TuneOptions(
        spec=_spec(args), target=args.target, backend=backend, captures=args.captures,
        seeds=args.seeds, heartbeat_s=args.heartbeat, oracle_check=args.oracle_check,
        trials=args.trials, storage=args.storage, study=args.study, workers=args.workers,
        timeout_s=args.timeout, setup_timeout_s=args.setup_timeout, timer=args.timer,
        db_path=args.db, sampler=args.sampler, sampler_seed=args.seed, space=space,
        export=args.export, summary=args.summary, plot=args.plot, top=args.top)
    if args.op_factory:
        opts.op_factory = args.op_factory
    if args.reference_factory:
        opts.reference_factory = args.reference_factory
    try:
        result = run_session(opts)
    except (SessionError, TuningDBError) as exc:
        print(f"tilegen tune: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tilegen tune: interrupted; re-run the same command to resume", file=sys.stderr)
        return 130
    return 0 if result.best is not None else 1


def _family(name: str) -> str:
    """argparse type of --backend: a kernel family; a tuned-only kernel set (the backward
    kernels, ``triton_bwd``) is reached through --backward, not named."""
    from tilegen.backends import TUNED_ONLY_MODULES

    if name in TUNED_ONLY_MODULES:
        raise argparse.ArgumentTypeError(f"{name!r} is a family's backward kernel set: tune it "
                                         "with --backward (e.g. --backend triton --backward)")
    return name


def add_tune_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``tune`` to `subparsers` (a ``parser.add_subparsers()`` result)."""
    from tilegen.backends import names as backend_names
    from tilegen.targets import TARGET_NAMES
    from tilegen.tune.objective import ORACLE_CHECKS, TIMERS
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
    p.add_argument("--backend", default="triton", type=_family, choices=backend_names(),
                   help="kernel family to tune (default triton)")
    p.add_argument("--backward", action="store_true",
                   help="tune the family's backward kernels (BackwardConfig, [tunable.triton_bwd]) "
                   "with its forward fixed; the gate scores dq/dk/dv with the gradient rule "
                   "against the fp32 reference; the winner is what the op's backward uses")
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
                   "s<digest of the rendered sources>)")
    p.add_argument("--heartbeat", type=int, default=15, metavar="SECONDS",
                   help="heartbeat of a running trial in the Optuna storage; a trial silent for "
                   "3x this long (its session or host was killed) is failed and its config "
                   "queued again (default 15)")
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
    p.add_argument("--oracle-check", choices=ORACLE_CHECKS, default="auto",
                   help="at worker setup the gate's reference (the reference variant) is scored "
                   "against the fp32 oracle on every capture: enforce (a failure stops the "
                   "session), report (a note), auto (default: enforce with do_bench, report with "
                   "the test-only timer, whose tiny CPU shapes cannot meet mean|d| <= 1e-4)")
    p.add_argument("--db", help="tilegen tuning DB file (default: $TILEGEN_DB, else "
                   "~/.cache/tilegen/tuning.sqlite); it must be writable")
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
    # Test hook, hidden: 'module:function' building the reference op from (spec, config).
    p.add_argument("--reference-factory", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_tune)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m tilegen.tune.cli {tune,db} ...`` (the same parsers as ``tilegen``)."""
    import logging

    from tilegen.db.cli import add_db_parser

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
