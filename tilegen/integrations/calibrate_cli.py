"""``tilegen calibrate``: `tilegen.integrations.diffusers.calibrate` for a saved transformer, with
a progress bar and a table of the layers at the end."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EPILOG = """example:
  # record a few denoising steps' transformer calls in your pipeline, once (with CFG a step is
  # two calls; Wan2.2-A14B: pipe.transformer_2 runs the low-noise steps, record it apart):
  #   with record_inputs(pipe.transformer, max_calls=12) as calls:
  #       pipe(prompt, num_inference_steps=6)
  #   torch.save(calls, "calls.pt")
  tilegen calibrate ./Wan2.2-T2V-A14B-Diffusers --subfolder transformer --inputs calls.pt \\
      --sparsity 0.875 --sparsity 0.75 --out plan.json
  # then: enable_block_sparse(pipe.transformer, plan="plan.json")
"""

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``calibrate`` to `subparsers` (a ``parser.add_subparsers()`` result)."""
    p = subparsers.add_parser(
        "calibrate", help="per-layer sparsity plan for a saved diffusers Wan transformer",
        description="Run a saved WanTransformer3DModel on recorded calls with every "
        "self-attention layer computed dense and block-sparse, gate each layer on its relative "
        "L1 (seed 003's calibration), and write the plan as JSON: which layers run sparse at "
        "which sparsity, which stay dense. Needs diffusers (pip install 'tilegen[diffusers]').",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="directory of a saved transformer (save_pretrained), or of a "
                   "pipeline with --subfolder transformer")
    p.add_argument("--subfolder", default=None, help="the transformer's folder in MODEL")
    p.add_argument("--inputs", required=True,
                   help="torch.save'd list of the transformer's call kwargs "
                   "(tilegen.integrations.diffusers.record_inputs makes one)")
    p.add_argument("--out", required=True, help="where to write the plan (JSON)")
    p.add_argument("--rel-l1", type=float, default=0.09,
                   help="gate: a layer runs sparse when its worst relative L1 over the calls "
                   "is at most this (default 0.09, seed 003's)")
    p.add_argument("--sparsity", type=float, action="append",
                   help="candidate fraction of KV cubes dropped; repeat for several, the "
                   "sparsest passing one is taken per layer (default 0.875)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16",
                   help="the transformer's dtype (default bf16)")
    p.add_argument("--device", default=None, help="default: cuda when there is a GPU, else cpu")
    p.add_argument("--max-calls", type=_positive, default=None,
                   help="calibrate on the first N recorded calls only")
    p.set_defaults(func=cmd_calibrate)
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _load_calls(path: Path, device, dtype) -> list[dict]:
    import torch

    try:
        calls = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # a file torch cannot read: one line naming it
        raise ValueError(f"--inputs {path}: not a torch.save'd list of call kwargs ({exc})"
                         ) from exc
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls) or not calls:
        raise ValueError(f"--inputs {path}: expected a non-empty list of dicts of the "
                         "transformer's forward kwargs (hidden_states, timestep, "
                         "encoder_hidden_states, ...)")
    # activations in the model's dtype; timesteps keep theirs
    return [{k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                 and k != "timestep" else v) for k, v in c.items()} for c in calls]


def cmd_calibrate(args: argparse.Namespace) -> int:
    from tilegen import pathcheck

    inputs = pathcheck.readable_file(Path(args.inputs).expanduser(), "--inputs")
    out = pathcheck.writable_file(Path(args.out).expanduser(), "--out")
    import torch

    from tilegen.db.tables import print_table
    from tilegen.integrations import diffusers as tgd

    try:
        diffusers = tgd._require_diffusers()
    except ImportError as exc:
        print(f"tilegen: error: {exc}", file=sys.stderr)
        return 1
    dtype = getattr(torch, _DTYPES[args.dtype])
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as exc:
        raise ValueError(f"--device {args.device!r}: {exc}") from exc
    t0 = time.perf_counter()
    try:
        model = diffusers.WanTransformer3DModel.from_pretrained(
            args.model, subfolder=args.subfolder, torch_dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{args.model}: cannot load a WanTransformer3DModel "
                         f"(subfolder={args.subfolder!r}): {str(exc).splitlines()[0]}") from exc
    model = model.to(device).eval()
    calls = _load_calls(inputs, device, dtype)
    if args.max_calls is not None:
        calls = calls[:args.max_calls]
    print(f"calibrating {len(model.blocks)} layers of {args.model} on {len(calls)} call(s), "
          f"{args.dtype} on {device} (loaded in {time.perf_counter() - t0:.1f}s)",
          file=sys.stderr)
    progress = _CallProgress(len(calls))
    with progress:
        plan = tgd.calibrate(model, calls, rel_l1=args.rel_l1,
                             sparsity=args.sparsity or tgd.DEFAULT_SPARSITY,
                             on_call=progress.update)
    plan.save(out)
    rows = [(layer.index, "dense" if layer.dense else "sparse",
             "-" if layer.dense else f"{layer.sparsity:.3f}", layer.topk,
             f"{layer.rel_l1:.4f}", f"{layer.cosine:.5f}") for layer in plan.layers]
    print_table(("layer", "mode", "sparsity", "topk", "rel-L1 (worst)", "cosine (lowest)"), rows,
                title=f"plan for grid {plan.grid}, gate rel-L1 <= {plan.rel_l1_gate}",
                right=("layer", "sparsity", "topk", "rel-L1 (worst)", "cosine (lowest)"))
    n_sparse = sum(not layer.dense for layer in plan.layers)
    print(f"{n_sparse}/{len(plan.layers)} layers sparse; plan written to {out}")
    return 0


class _CallProgress:
    """A rich bar on a terminal, one plain line per call otherwise (logs, CI)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.bar = self.task = None
        if sys.stderr.isatty():
            import rich.progress as rp
            from rich.console import Console

            self.bar = rp.Progress(rp.TextColumn("calls"), rp.BarColumn(), rp.MofNCompleteColumn(),
                                   rp.TimeElapsedColumn(), transient=True,
                                   console=Console(stderr=True))
        self.t0 = time.perf_counter()

    def __enter__(self) -> _CallProgress:
        if self.bar is not None:
            self.bar.__enter__()
            self.task = self.bar.add_task("calls", total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done)
        else:
            print(f"  call {done}/{total} ({time.perf_counter() - self.t0:.1f}s)",
                  file=sys.stderr, flush=True)
