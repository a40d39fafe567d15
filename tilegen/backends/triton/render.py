"""Render the Triton kernel: one source per spec and render-time options (launch parameters stay
constexpr / launch arguments, so one source serves every launch configuration)."""

from __future__ import annotations

from tilegen.config import KernelConfig
from tilegen.render import Source, render, spec_basename
from tilegen.spec import Spec
from tilegen.targets import Target

TRITON_LUT_TEMPLATE = "triton/lut_kernel.py.j2"
TRITON_KERNEL_NAME = "tilegen_block_sparse_attn"


def render_triton(spec: Spec, cfg: KernelConfig, target: Target | None) -> Source:
    """The Triton source for a spec and the config's render-time options. Launch parameters
    (block_m, block_n, num_warps, num_stages) stay constexpr / launch arguments, so one source
    serves every launch configuration."""
    name = f"{spec_basename(spec)}_{cfg.render_name}.py"
    return render(TRITON_LUT_TEMPLATE, "triton", spec, cfg.render_options(), name,
                  TRITON_KERNEL_NAME, target)
