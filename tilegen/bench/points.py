"""The captures a run walks (points) and the helpers every runner shares: device sync,
layouts, timers, new rows."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tilegen import captures
from tilegen.bench.plan import Plan
from tilegen.bench.report import Row
from tilegen.spec import Spec

# ============================================================================ the run


@dataclass
class Point:
    """One capture of the run: a synthetic (TOPK, seed), or a file (its workload read on load)."""

    name: str
    spec: Spec
    seed: int | None = None
    path: Path | None = None

    def load(self, device: str) -> tuple[dict, Spec]:
        """The capture on `device`, in the spec's layout, and the spec of its workload."""
        if self.path is None:
            return captures.synthesize_for(self.spec, self.seed or 0, device), self.spec
        cap = captures.load(self.path, device=device)
        spec = spec_for_capture(self.spec, cap)
        return captures.for_spec(cap, spec), spec


def spec_for_capture(spec: Spec, cap: dict) -> Spec:
    """The spec with a capture file's workload (batch, heads, TOPK; grid when the file names
    it). Capture files are BSHD."""
    B, _, H, _ = cap["q"].shape
    changes: dict[str, Any] = {"batch": B, "num_heads": H, "topk": cap["topk_idx"].shape[-1]}
    if cap.get("grid") is not None:
        changes["grid"] = tuple(cap["grid"])
    return spec.replace(**changes)


def iter_points(plan: Plan) -> list[Point]:
    if plan.synthetic:
        if plan.spec.encoding_info.needs_window:
            w = plan.spec.window
            label = ("window" + "x".join(map(str, w))) if isinstance(w[0], int) else "windows"
            return [Point(f"synthetic_seed{seed}_{label}", plan.spec, seed=seed)
                    for seed in range(plan.seeds)]
        return [Point(f"synthetic_seed{seed}_topk{topk}", plan.spec.replace(topk=topk), seed=seed)
                for topk in plan.topks for seed in range(plan.seeds)]
    paths = sorted(Path(plan.captures).glob("*.pt"))
    if not paths:
        raise FileNotFoundError(f"no capture .pt files in {plan.captures}")
    return [Point(path.name, plan.spec, path=path) for path in paths]


def oracle_heads(heads: int, outlier_heads: Sequence[int] = ()) -> list[int]:
    """Heads the fp32 oracle checks: the outlier head(s), the first, the middle and the last."""
    return sorted({*(h for h in outlier_heads if 0 <= h < heads), 0, heads // 2, heads - 1})


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def do_bench_timer(warmup_ms: int, rep_ms: int) -> Callable[[Callable[[], Any]], float]:
    import triton

    def timer(fn: Callable[[], Any]) -> float:
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                             return_mode="median"))

    return timer


def heads_of(t: torch.Tensor, layout: str, heads: list[int]) -> torch.Tensor:
    return t[:, :, heads] if layout == "bshd" else t[:, heads]


def to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2).contiguous() if layout == "bshd" else t


def from_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2) if layout == "bshd" else t


def new_row(point: Point, spec: Spec, env: dict[str, str], variant: str, kind: str,
             backend: str, config: str = "") -> Row:
    return Row(capture=point.name, variant=variant, kind=kind, backend=backend, config=config,
               topk=round(spec.kv_per_query), num_kv_blocks=spec.num_cubes,
               sparsity=1.0 - spec.kv_per_query / spec.num_cubes, grid=list(spec.grid),
               heads=spec.num_heads, batch=spec.batch, seq_len=spec.seq_len,
               head_dim=spec.head_dim, seed=point.seed, device=env.get("device"),
               torch=env.get("torch"), triton=env.get("triton"), date=env.get("date"))


def first_call(fn: Callable, row: Row, device: str) -> Any:
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    row.first_call_s = time.perf_counter() - t0
    return out


