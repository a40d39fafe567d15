"""Ahead-of-time compilation of the Gluon kernel with no GPU (Triton's bundled ptxas)."""

from __future__ import annotations

import os
from pathlib import Path

from tilegen import cache
from tilegen.backends.gluon.launch import compile_offline
from tilegen.backends.gluon.render import options_of
from tilegen.backends.triton.aot import _require_compiled_mode
from tilegen.compile import Artifact, CompileError
from tilegen.config import KernelConfig
from tilegen.cubin import cubin_matrix_ops, cubin_resources, ptxas_version
from tilegen.render import Source
from tilegen.spec import Spec
from tilegen.targets import Target


def _artifact(compiled, path: Path, source: Source, target: Target, config: str) -> Artifact:
    import triton

    res = cubin_resources(path)
    meta = compiled.metadata
    return Artifact(
        path=path, kind="cubin", backend="gluon", target=target.name, arch=target.arch,
        kernel_name=meta.name, source_sha256=source.sha256, config=config,
        registers=res.get("registers"), shared_bytes=meta.shared,
        spill_bytes=res.get("spill_bytes"), stack_bytes=res.get("stack_bytes"),
        threads=meta.num_warps * target.warp_size,
        compiler={"triton": triton.__version__, "ptxas": ptxas_version()},
        matrix_ops=cubin_matrix_ops(path),
    )


def compile_gluon_backward(spec: Spec, target: Target, source: Source, out_dir: Path
                           ) -> list[Artifact]:
    """Compile the Gluon backward module (dK/dV and dQ) for `target`, with the options of the
    target's default backward for `spec` (`BackwardConfig.default_for`: what the op runs)."""
    from tilegen.backends.gluon.backward import compile_offline, options_for
    from tilegen.backends.triton.backward import BackwardConfig

    _require_compiled_mode()
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        bwd = BackwardConfig.default_for(target, spec)
        if not bwd.gluon:  # the target's default is the Triton backward: build the Gluon one
            bwd = BackwardConfig(gluon=True, ds_store=True,
                                 dkdv_pack=bool(spec.variable_block_sizes))
        compiled = compile_offline(spec, target, options_for(bwd, spec))
    except Exception as exc:  # triton raises several exception types for bad kernels
        raise CompileError(f"Gluon backward compile failed for {target.name}: "
                           f"{type(exc).__name__}: {exc}") from exc
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    out_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for kernel, ck in compiled.items():
        stem = f"gluon_{source.name.removesuffix('.py')}_{kernel}"
        path = cache.atomic_write(out_dir / f"{stem}.cubin", ck.asm["cubin"])
        cache.atomic_write(out_dir / f"{stem}.ptx", ck.asm["ptx"])
        out.append(_artifact(ck, path, source, target, "backward"))
    return out


def _compile_forward(build, what: str, cfg: KernelConfig, target: Target, source: Source,
                     out_dir: Path) -> Artifact:
    """Run ``build()`` (a forward kernel's offline compile) outside interpreter mode, write its
    cubin and ptx into `out_dir`, return its Artifact."""
    _require_compiled_mode()
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        compiled = build()
    except Exception as exc:  # triton raises several exception types for bad kernels
        raise CompileError(f"{what} compile failed for {target.name} {cfg.name}: "
                           f"{type(exc).__name__}: {exc}") from exc
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"gluon_{source.name.removesuffix('.py')}"
    path = cache.atomic_write(out_dir / f"{stem}.cubin", compiled.asm["cubin"])
    cache.atomic_write(out_dir / f"{stem}.ptx", compiled.asm["ptx"])
    return _artifact(compiled, path, source, target, cfg.name)


def compile_gluon(spec: Spec, cfg: KernelConfig, target: Target, source: Source,
                  out_dir: Path) -> Artifact:
    """Compile the Gluon source for `target` into `out_dir`; return its Artifact (registers,
    shared memory, spills, and the HGMMA count in the SASS)."""
    return _compile_forward(
        lambda: compile_offline(source, options_of(cfg), spec.head_dim, spec.dtype, target,
                                separate_kv=cfg.separate_kv),
        "Gluon", cfg, target, source, out_dir)


def compile_gluon_quant(spec: Spec, cfg: KernelConfig, target: Target, source: Source,
                        out_dir: Path) -> Artifact:
    """Compile the 8-bit Gluon kernel (`tilegen.backends.gluon.quant`) for `target`: its
    Artifact counts IGMMA and QGMMA in the SASS."""
    from tilegen.backends.gluon import quant

    return _compile_forward(
        lambda: quant.compile_offline(source, quant.options_of(cfg), spec.head_dim, spec.dtype,
                                      target),
        "8-bit Gluon", cfg, target, source, out_dir)
