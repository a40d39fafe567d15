"""The `tilegen` command line: build, check, captures, bench (tune and db plug in here too)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from tilegen import pathcheck
from tilegen.backends import names as backend_names
from tilegen.compile import CompileError, ToolchainMissing, format_matrix_ops
from tilegen.config import KernelConfig
from tilegen.pathcheck import (
    PathError,
    blocking_file,
    readable_file,
    writable_dir,
    writable_file,
)
from tilegen.spec import ENCODINGS, Spec
from tilegen.targets import TARGET_NAMES, get_target

EPILOG = """examples:
  tilegen build --target sm_90 --out build/sm_90      # Triton, Gluon and CUDA cubins for H100/H200
  tilegen build --target gfx942 --spec my.toml        # MI300 code objects for a custom spec
  tilegen captures synthesize --out caps/ --seed 0    # Wan2.2-like capture files
  tilegen bench --captures caps/                      # score + time on the current GPU
  tilegen doctor                                      # does tilegen work here? (seconds)
  tilegen calibrate MODEL --inputs calls.pt --out plan.json   # per-layer plan for diffusers' Wan
"""


def _spec(args: argparse.Namespace) -> Spec:
    return Spec.from_file_or_default(getattr(args, "spec", None))


def _config_text(raw: str) -> tuple[str, str]:
    """(JSON text, what to call it in errors) of --config: inline JSON or a file's text."""
    if raw.lstrip().startswith("{"):
        return raw, "--config"
    path = Path(raw).expanduser()
    try:
        return readable_file(path, "--config").read_text(), f"--config {raw}"
    except PathError:
        if path.exists() or blocking_file(path) is not None:
            raise
    # neither a file nor a JSON object: say both, since either may have been meant
    raise PathError(f"--config {raw}: does not exist, and is not a JSON object of KernelConfig "
                    """fields either (e.g. '{"block_n": 32}')""", path=path)


def _config(args: argparse.Namespace) -> KernelConfig | None:
    raw = getattr(args, "config", None)
    if not raw:
        return None
    text, where = _config_text(raw)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: line {exc.lineno} column {exc.colno}: not JSON "
                         f"({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a KernelConfig is a JSON object, got "
                         f"{type(data).__name__}")
    return KernelConfig.from_dict(data)


def cmd_build(args: argparse.Namespace) -> int:
    from tilegen.build import build

    # every path first: a mistake costs nothing, not a compile
    pathcheck.check_spec_option(args)
    if args.config:
        _config_text(args.config)
    target = get_target(args.target)
    out = writable_dir(args.out or f"build/{target.name}", "--out", staging=True)
    spec = _spec(args)
    backends = tuple(args.backend) if args.backend else None
    t0 = time.perf_counter()
    with _build_progress() as progress:
        manifest = build(spec, target, out, _config(args), backends, progress=progress)
    print(f"built {len(manifest['artifacts'])} artifact(s) for {target.name} "
          f"(spec {spec.short_hash}) in {time.perf_counter() - t0:.1f}s -> {out}")
    for art in manifest["artifacts"]:
        print(f"  {art['backend']:7s} {art['path']:70s} regs={art['registers']} "
              f"shared={art['shared_bytes']} spills={art['spill_bytes']} "
              f"mma={format_matrix_ops(art.get('matrix_ops'))}")
    for why in manifest.get("skipped", []):
        print(f"  skipped {why}")
    if spec.kernel_spec != spec:
        print(f"  encoding {spec.encoding!r} runs the {spec.kernel_spec.encoding!r} kernel "
              "(tilegen.encodings converts its input on the device)")
    print(f"  manifest: {out / 'manifest.json'}")
    return 0


class _build_progress:  # noqa: N801 - used as a context manager, reads like a function
    """Progress of `tilegen build`: a rich status line on a terminal, plain lines on stderr
    otherwise (logs, CI)."""

    def __enter__(self):
        self._status = None
        if sys.stderr.isatty():
            try:
                from rich.console import Console

                self._status = Console(stderr=True).status("building")
                self._status.__enter__()
            except ImportError:
                self._status = None
        return self

    def __call__(self, message: str) -> None:
        if self._status is not None:
            self._status.update(message)
            self._status.console.log(message)
        else:
            print(message, file=sys.stderr)

    def __exit__(self, *exc) -> None:
        if self._status is not None:
            self._status.__exit__(*exc)


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (argparse turns the error into usage + exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (files to write), got "
                                         f"{value}")
    return value


class _Progress:
    """Per-file progress for `tilegen captures`: a rich bar on a terminal when rich is
    installed, a carriage-return counter on a terminal without it, plain lines otherwise."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.tty = sys.stdout.isatty()
        self._decile = 0  # last tenth of the steps reported off a terminal
        self.bar = None
        if self.tty:
            try:  # rich is optional here: plain output without it
                import rich.progress as rp
            except ImportError:
                pass
            else:
                self.bar = rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(),
                                       rp.TaskProgressColumn(), rp.TimeElapsedColumn())
        self.task = None

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def _say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def start(self, i: int, path: Path, what: str) -> None:
        tag = f"[{i + 1}/{self.count}]"
        self._decile = 0
        if self.bar is not None:
            self.task = self.bar.add_task(f"{tag} {path.name}", total=None)
        else:
            self._say(f"{tag} synthesizing {path}: {what}")

    def step(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)
        elif self.tty:
            print(f"\r  step {done}/{total}", end="" if done < total else "\n", flush=True)
        elif done * 10 // total > self._decile or done == total:
            # off a terminal (logs, CI): a plain line at most every 10%, so a long default-size
            # synthesis is never silent
            self._decile = done * 10 // total
            print(f"  step {done}/{total} ({100 * done // total}%)", flush=True)

    def finish(self, i: int, path: Path, seconds: float) -> None:
        if self.bar is not None:
            self.bar.remove_task(self.task)
        self._say(f"[{i + 1}/{self.count}] wrote {path} ({seconds:.1f}s)")


def capture_bytes(spec: Spec) -> int:
    """About how many bytes one synthesized capture file of `spec` takes: q, k and v in the
    spec's dtype, the int32 top-k table and vbs (pickle framing and metadata are small)."""
    import torch

    elem = torch.empty((), dtype=spec.torch_dtype).element_size()
    qkv = 3 * spec.batch * spec.seq_len * spec.num_heads * spec.head_dim * elem
    return qkv + 4 * (spec.batch * spec.num_heads * spec.num_cubes * spec.topk + spec.num_cubes)


def _human_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def cmd_captures(args: argparse.Namespace) -> int:
    pathcheck.check_spec_option(args)
    out = writable_dir(args.out, "--out")
    spec = _spec(args)
    from tilegen import captures

    out.mkdir(parents=True, exist_ok=True)
    dtype = spec.torch_dtype
    size = capture_bytes(spec)
    total = f", {_human_bytes(size * args.count)} in all" if args.count > 1 else ""
    what = (f"q, k, v ({spec.batch}, {spec.seq_len}, {spec.num_heads}, {spec.head_dim}) "
            f"{spec.dtype}, topk {spec.topk}; about {_human_bytes(size)}{total}")
    with _Progress(args.count) as progress:
        for i in range(args.count):
            seed = args.seed + i
            path = out / f"synthetic_seed{seed}.pt"
            progress.start(i, path, what)
            t0 = time.perf_counter()
            # files are BSHD whatever the spec's layout (contract.md); dtype, cube, batch: the
            # spec's
            cap = captures.synthesize(seed=seed, grid=spec.grid, heads=spec.num_heads,
                                      head_dim=spec.head_dim, topk=spec.topk, batch=spec.batch,
                                      dtype=dtype, cube=spec.cube,
                                      outlier=not args.no_outlier, progress=progress.step)
            captures.save(cap, path)
            progress.finish(i, path, time.perf_counter() - t0)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from tilegen import generated

    targets = tuple(args.target) if args.target else TARGET_NAMES
    if args.update:
        fixed = generated.update(targets)
        if not fixed:
            print(f"tilegen check --update: all {len(generated.expected(targets))} generated "
                  f"source(s) up to date; nothing written")
            return 0
        written = [d for d in fixed if d.kind != "stale"]
        removed = [d for d in fixed if d.kind == "stale"]
        extra = f", removed {len(removed)} stale one(s)" if removed else ""
        print(f"tilegen check --update: regenerated {len(written)} generated source(s){extra} "
              f"under targets/*/generated/:")
        for drift in fixed:
            print(f"  {drift.describe()}")
        return 0
    drifts = generated.check(targets)
    if not drifts:
        print(f"tilegen check: {len(generated.expected(targets))} generated source(s) up to date")
        return 0
    for drift in drifts:
        sys.stdout.write(drift.diff)
    lines = "".join(f"  {d.describe()}\n" for d in drifts)
    print(f"\ntilegen check: {len(drifts)} generated source(s) drifted from the templates:\n"
          f"{lines}Regenerate with: {generated.REGENERATE}", file=sys.stderr)
    return 1


def _quant_modes(text: str) -> str | list[str]:
    """--quant: "auto", "none" (no 8-bit rows) or a comma-separated list of modes."""
    if text in ("auto", "none"):
        return "auto" if text == "auto" else []
    return [m for m in text.split(",") if m]


def cmd_bench(args: argparse.Namespace) -> int:
    from tilegen import bench

    pathcheck.check_spec_option(args)
    pathcheck.check_captures_option(args)
    if args.config:
        _config_text(args.config)
    writable_file(args.json, "--json")
    writable_file(args.plot or bench.default_plot_path(args.json),
                  "--plot" if args.plot else "plot file (beside --json)")
    plan = bench.make_plan(
        _spec(args), args.captures, seeds=args.seeds, config=_config(args), topk=args.topk,
        sweep=args.sweep, grid=args.grid, heads=args.heads, backends=args.backends or (),
        flex=not args.no_flex, dense=not args.no_dense, json_path=args.json,
        plot_path=args.plot, warmup_ms=args.warmup, rep_ms=args.rep, backward=args.backward,
        encoding=args.encoding, window=args.window, quant=_quant_modes(args.quant))
    if args.dry_run:
        print(plan.describe())
        return 0
    return bench.run_bench(plan, command=" ".join(["tilegen", *sys.argv[1:]]))


def cmd_doctor(args: argparse.Namespace) -> int:
    from tilegen import doctor

    pathcheck.check_spec_option(args)
    if args.json:
        pathcheck.writable_file(args.json, "--json")
    return doctor.main(_spec(args), args.json)


def _bench_type(name: str):
    """An argparse type from tilegen.bench, imported when used (it imports torch)."""
    def parse(text: str):
        from tilegen import bench

        return getattr(bench, name)(text)

    parse.__name__ = name.removeprefix("parse_")
    return parse


#: tilegen.bench.SWEEP_TOPK, spelled out so `tilegen --help` does not import torch
BENCH_SWEEP = "31,78,125,187,312"

# Commands that compile for a GPU must import triton in compiled mode (see
# tilegen.backends.triton.aot._require_compiled_mode): the interpreter has no say in them.
_AOT_COMMANDS = ("build",)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tilegen",
        description="Generate, build and tune block-sparse attention kernels for video DiTs.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("build", help="render and compile every backend of a target (no GPU needed)",
                       description="Render the spec's kernels for TARGET and compile them ahead "
                       "of time, every family of the target (Triton cubin/hsaco, the Gluon "
                       "cubin on sm_90/sm_100a, the CUDA or HIP C++). Writes sources, binaries "
                       "and manifest.json (hashes, compiler versions, registers, shared memory, "
                       "spills, and the matrix instructions in each binary: mma=) under --out. "
                       "A family that cannot build the spec is left out, naming why.")
    p.add_argument("--target", required=True, choices=TARGET_NAMES)
    p.add_argument("--spec", help="spec file (.toml or .json); default: the Wan2.2 workload spec")
    p.add_argument("--out", help="output directory (default: build/TARGET)")
    p.add_argument("--config", help="KernelConfig as JSON text or a JSON file "
                   "(default: the target's default config from targets/TARGET/target.toml)")
    p.add_argument("--backend", action="append", choices=backend_names(),
                   help="only this backend (repeatable; default: every backend of the target)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("check", help="CI regeneration check of the committed generated sources",
                       description="Re-render every committed source under targets/*/generated/ "
                       "(default spec, each target x backend) and compare. Exit 1 with a "
                       "unified diff on drift; --update rewrites them.")
    p.add_argument("--target", action="append", choices=TARGET_NAMES,
                   help="only this target (repeatable)")
    p.add_argument("--update", action="store_true", help="regenerate the committed sources")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("captures", help="synthesize Wan2.2-like capture files",
                       description="Write seeded synthetic captures in the real capture format "
                       "(q, k, v, topk_idx, vbs) for the spec's workload shape.")
    p.add_argument("action", choices=["synthesize"])
    p.add_argument("--out", required=True, help="directory for the .pt files")
    p.add_argument("--spec", help="spec file for the workload shape")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=_positive_int, default=1,
                   help="files to write, seeds SEED, SEED+1, ... (default 1)")
    p.add_argument("--no-outlier", action="store_true", help="omit the overflow outlier head")
    p.set_defaults(func=cmd_captures)

    p = sub.add_parser(
        "bench", help="every variant and peer side by side on the same inputs (GPU)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="In one process, on the same captures: the tuned default (also through "
        "block_sparse_attention), the reference variant, the kernel families of --backends, "
        "FlexAttention with a BlockMask from the LUT, and dense SDPA (cuDNN, flash). Each is "
        "timed as users call it (median, triton.testing.do_bench) with the bare kernel "
        "beside it, scored against the reference variant with the contract's rule, and "
        "reported with TFLOP/s on real keys and the speedup over the reference variant. "
        "Writes a JSON file and a PNG plot (latency and TFLOP/s against sparsity).",
        epilog="examples:\n"
        "  tilegen bench                           # the spec's TOPK, synthetic capture\n"
        "  tilegen bench --sweep --backends gluon  # TOPK 31,78,125,187,312, + the Gluon family\n"
        "  tilegen bench --grid 21,30,52 --heads 12 --topk 78\n"
        "  tilegen bench --captures caps/ --no-flex\n"
        "  tilegen bench --backward                # + the backward rows (issue #10)\n"
        "  tilegen bench --encoding sliding_tile --window 3,3,3   # STA beside FlexAttention\n"
        "  tilegen bench --encoding mask           # block mask beside the LUT, same cubes\n"
        "  tilegen bench --sweep --dry-run         # print the plan, touch no GPU")
    p.add_argument("--spec", help="spec file (.toml or .json); default: the Wan2.2 workload spec")
    p.add_argument("--captures", default="synthetic",
                   help="directory of capture .pt files, or 'synthetic' (default)")
    p.add_argument("--seeds", type=int, default=1, help="synthetic captures per TOPK (default 1)")
    p.add_argument("--config", help="KernelConfig JSON to bench instead of the loaded default")
    p.add_argument("--topk", type=_bench_type("parse_int_list"), metavar="K[,K...]",
                   help="TOPK values to sweep, e.g. 31,78,125 (default: the spec's topk)")
    p.add_argument("--sweep", action="store_true",
                   help=f"sweep TOPK {BENCH_SWEEP} (95%% to 50%% sparsity on the "
                   "default grid's 624 cubes)")
    p.add_argument("--grid", type=_bench_type("parse_grid"), metavar="T,H,W",
                   help="latent grid of another model (overrides the spec's grid)")
    p.add_argument("--heads", type=int, metavar="N", help="number of heads (overrides the spec)")
    p.add_argument("--encoding", choices=ENCODINGS,
                   help="bench this encoding (overrides the spec's): mask runs on the capture's "
                   "LUT as a block mask, sliding_tile on its window; both beside a 'lut' row and "
                   "FlexAttention on the same pattern")
    p.add_argument("--window", type=_bench_type("parse_grid"), metavar="T,H,W",
                   help="sliding_tile window in cubes, odd sizes (implies --encoding "
                   "sliding_tile; default: the spec's, else 3,3,3)")
    p.add_argument("--backends", type=_bench_type("parse_backends"), metavar="NAME[,NAME...]",
                   help="also bench these kernel families' defaults, e.g. triton,gluon,cuda")
    p.add_argument("--backward", action="store_true",
                   help="also time and check the training step: fwd+bwd through "
                   "block_sparse_attention, its forward alone, the reference step (Triton "
                   "forward and backward), the backward kernels, the inverse map, FlexAttention "
                   "fwd+bwd; gradients scored against the fp32 reference")
    p.add_argument("--quant", default="auto", metavar="MODE[,MODE...]",
                   help="8-bit rows beside the bf16 ones (quant-<mode>: tilegen.load(spec with "
                   "quant=mode), scored by the quantized rule with its margins): auto (every "
                   "mode a kernel family computes; default), none, or modes such as int8_fp8")
    p.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peer")
    p.add_argument("--no-dense", action="store_true", help="skip the dense SDPA peers")
    p.add_argument("--json", default="bench_results.json",
                   help="results file (default: bench_results.json)")
    p.add_argument("--plot", help="plot file (default: the --json path with .png)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup in ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms "
                   "(default 100)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (variants x captures) and exit without touching a GPU")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "doctor", help="check that tilegen works on this machine, as users call it (seconds)",
        description="On a small synthesized workload with an outlier head and the spec's kernel "
        "fields: which kernel tilegen.load picks, its output against the fp32 oracle and the "
        "reference variant, block_sparse_attention, the gradients, and on a GPU: no host sync, "
        "CUDA graph capture and replay, the bad-index path (NaN rows, op.check() raises) and "
        "the op's time beside the bare kernel. Prints a pass/fail table; exit status 1 when "
        "a check failed. On a CPU the GPU-only checks are skipped.")
    p.add_argument("--spec", help="spec file whose kernel fields to check (default: the "
                   "Wan2.2 workload spec)")
    p.add_argument("--json", help="also write the checks as JSON here")
    p.set_defaults(func=cmd_doctor)

    from tilegen.db.cli import add_db_parser
    from tilegen.integrations.calibrate_cli import add_calibrate_parser
    from tilegen.tune.cli import add_tune_parser

    add_tune_parser(sub)
    add_db_parser(sub)
    add_calibrate_parser(sub)

    args = parser.parse_args(argv)
    # an AOT command compiles for real; the caller's setting comes back afterwards (an
    # in-process caller, a test, keeps defining interpreted kernels after it)
    interpret = os.environ.get("TRITON_INTERPRET")
    if args.command in _AOT_COMMANDS:
        os.environ.pop("TRITON_INTERPRET", None)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="tilegen: %(message)s")
    if not args.command:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except PathError as exc:  # a path option that cannot be used: one line, before any work
        print(f"tilegen: error: {exc}", file=sys.stderr)
        return 2
    except ToolchainMissing as exc:
        print(f"tilegen: missing toolchain: {exc}", file=sys.stderr)
        return 3
    except (CompileError, ValueError, FileNotFoundError) as exc:
        print(f"tilegen: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret


if __name__ == "__main__":
    sys.exit(main())
