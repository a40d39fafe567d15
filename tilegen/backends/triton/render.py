"""Render the Triton kernel: one source per spec (its traits are module constants: BSHD, HAS_VBS)
and store_max_prob (which adds the kernel's two arguments). Launch parameters and the config's
other knobs are constexprs (BLOCK_M, BLOCK_N, STORE_LSE, INTERP_BF16) or launch arguments, with a
compile-time ``if`` in the kernel: one source serves all of them."""

from __future__ import annotations

from tilegen.config import KernelConfig
from tilegen.render import Source, render, spec_basename
from tilegen.spec import Spec
from tilegen.targets import Target

TRITON_LUT_TEMPLATE = "triton/lut_kernel.py.j2"
TRITON_KERNEL_NAME = "tilegen_block_sparse_attn"


def render_triton(spec: Spec, cfg: KernelConfig, target: Target | None) -> Source:
    """The Triton source for a spec and the config's store_max_prob. Launch parameters
    (block_m, block_n, num_warps, num_stages), store_lse and interp_bf16 are constexprs / launch
    arguments (`aot.forward_constexprs`, the op's launch), so one source serves them all; the
    file name still spells the config's render options (`KernelConfig.render_name`)."""
    name = f"{spec_basename(spec)}_{cfg.render_name}.py"
    return render(TRITON_LUT_TEMPLATE, "triton", spec, cfg.render_options(), name,
                  TRITON_KERNEL_NAME, target)
