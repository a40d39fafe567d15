"""Ahead-of-time compilation of the generated Triton kernel, with no GPU.

`triton.compile(ASTSource(...), target=GPUTarget(...))` runs the whole Triton pipeline on the
CPU: ptxas (bundled in the wheel) for NVIDIA cubins, and Triton's in-process LLVM + lld for AMD
code objects. `triton/tools/compile.py` is not used: it asks a driver for the current target.
The resource report comes from the compiled kernel's metadata and, for cubins, from the
bundled cuobjdump (`tilegen.cubin`).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from tilegen import cache
from tilegen.backends.triton.backward import (
    BACKWARD_KERNELS,
    BACKWARD_PACKED,
    BackwardConfig,
    render_triton_backward,
)
from tilegen.backends.triton.jit import load_triton, triton_imported_interpreted
from tilegen.backends.triton.render import TRITON_KERNEL_NAME, render_triton
from tilegen.compile import Artifact, CompileError, matrix_ops
from tilegen.config import KernelConfig
from tilegen.cubin import cubin_matrix_ops, cubin_resources, ptxas_version
from tilegen.render import Source
from tilegen.spec import Spec
from tilegen.targets import Target


def cursor_signature(spec: Spec) -> tuple[dict[str, str], dict[str, str], dict[str, bool]]:
    """The encoding cursor's arguments (attention_macros.j2 `cursor_params`, `cursor_scalars`,
    `cursor_constexprs`): pointers, scalars, and the constexprs with their AOT values."""
    if spec.kernel_spec.encoding == "sliding_tile":
        return {"WINDOWS": "*i32"}, {"grid_t": "i32", "grid_h": "i32", "grid_w": "i32"}, {}
    return {"LUT": "*i32", "COUNTS": "*i32"}, {"topk": "i32"}, {"HAS_COUNTS": False}


def signature(spec: Spec, cfg: KernelConfig | None = None) -> dict[str, str]:
    """Triton signature of the generated kernel for this spec (runtime arguments, then the
    constexprs; pointers first, see lut_kernel.py.j2). A config that stores the max_prob signal
    adds its two fp32 pointers after ERR; one of separate K/V adds Q_VBS, kv_seq_len and
    num_kv_heads (attention_macros.j2 `kv_layout`)."""
    elem = {"bf16": "*bf16", "fp16": "*fp16"}[spec.dtype]
    ptrs, scalars, flags = cursor_signature(spec)
    sep = cfg is not None and cfg.separate_kv
    sig = {"Q": elem, "K": elem, "V": elem, **ptrs, "VBS": "*i32",
           **({"Q_VBS": "*i32"} if sep else {}), "O": elem, "LSE": "*fp32", "ERR": "*i32"}
    if cfg is not None and cfg.store_max_prob:
        sig.update(MAX_PROB="*fp32", MAX_PROB_CUBE="*fp32")
    sig.update(seq_len="i32", **_separate(sep, "kv_seq_len"), num_heads="i32",
               **_separate(sep, "num_kv_heads"), num_q_blocks="i32", num_kv_blocks="i32",
               **scalars, qk_scale="fp32")
    sig.update({name: "constexpr" for name in flags}, BLOCK_M="constexpr", BLOCK_N="constexpr",
               STORE_LSE="constexpr", INTERP_BF16="constexpr")
    return sig


def _separate(on: bool, name: str, kind: str = "i32") -> dict[str, str]:
    """One argument of separate K/V, or none."""
    return {name: kind} if on else {}


def forward_constexprs(spec: Spec, cfg: KernelConfig) -> dict[str, bool | int]:
    """The forward kernel's constexprs for an AOT compile: the cursor's flags at their AOT
    values, the tile (BLOCK_M, BLOCK_N) and the config's knobs (STORE_LSE, INTERP_BF16)."""
    return {**cursor_signature(spec)[2], "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
            "STORE_LSE": cfg.store_lse, "INTERP_BF16": cfg.interp_bf16}


def triton_version() -> str:
    import triton

    return triton.__version__


def _require_compiled_mode() -> None:
    """Triton fixes interpreter mode for its own library when `triton.language` is first
    imported; a process that imported it under TRITON_INTERPRET=1 cannot compile for a GPU
    (the AMD backend then fails inside Triton with a bare AssertionError). Say so instead."""
    if triton_imported_interpreted():
        raise CompileError(
            "ahead-of-time compilation needs a process that imported triton without "
            "TRITON_INTERPRET=1; unset it (the `tilegen build` command does this itself)")


def compile_triton(spec: Spec, cfg: KernelConfig, target: Target, out_dir: Path,
                   source: Source | None = None) -> Artifact:
    """Compile the generated Triton kernel for `target` into `out_dir`; return its Artifact."""
    source = source or render_triton(spec, cfg, target)
    constexprs = forward_constexprs(spec, cfg)
    stem = f"triton_{source.name.removesuffix('.py')}_{cfg.launch_name}"
    return _compile_kernel(source, TRITON_KERNEL_NAME, signature(spec, cfg), constexprs,
                           cfg.launch, target, out_dir, stem, cfg.name)


def backward_signatures(spec: Spec, bwd: BackwardConfig | None = None,
                        separate_kv: bool = False) -> dict[str, dict[str, str]]:
    """Triton signatures (runtime arguments, then constexprs) of the backward module's kernels
    (see lut_backward.py.j2) for the template options of `bwd`: the packed tiles' pointers
    (`PackedTiles`) are constexprs (None) without dq_pack / dkdv_pack. O is the forward's fp32
    output (`forward_for_grad`). ``separate_kv``: the kernels of separate K/V (their Q_VBS,
    kv_seq_len, num_kv_heads, and the dK/dV kernel's num_q_blocks; preprocess reads Q_VBS)."""
    sep = separate_kv
    elem = {"bf16": "*bf16", "fp16": "*fp16"}[spec.dtype]
    f32, i32 = "*fp32", "*i32"
    dq_pack = i32 if bwd is not None and bwd.dq_pack else "constexpr"
    dkdv_pack = i32 if bwd is not None and bwd.dkdv_pack else "constexpr"
    ptrs, scalars, flags = cursor_signature(spec)
    return {
        "preprocess": {"O": f32, "O_LO": "constexpr", "DO": elem, "DELTA": f32,
                       ("Q_VBS" if sep else "VBS"): i32, "seq_len": "i32", "num_heads": "i32",
                       "HAS_O_LO": "constexpr", "BLOCK_M": "constexpr"},
        "dq": {"Q": elem, "K": elem, "V": elem, "DO": elem, "LSE": f32, "DELTA": f32,
               "DSUM": f32, **ptrs, "VBS": i32, **_separate(sep, "Q_VBS", i32), "DQ": elem,
               "ERR": i32, **{name: dq_pack for name in BACKWARD_PACKED["dq"]},
               "seq_len": "i32", **_separate(sep, "kv_seq_len"), "num_heads": "i32",
               **_separate(sep, "num_kv_heads"), "num_q_blocks": "i32",
               "num_kv_blocks": "i32", **scalars, "qk_scale": "fp32", "sm_scale": "fp32",
               **{name: "constexpr" for name in flags}, "HAS_DSUM": "constexpr",
               "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "DQ_PACK": "constexpr",
               "INTERP_BF16": "constexpr"},
        "dkdv": {"Q": elem, "K": elem, "V": elem, "DO": elem, "LSE": f32, "DELTA": f32,
                 "KV_OFFSETS": i32, "KV_QCUBES": i32, "VBS": i32, **_separate(sep, "Q_VBS", i32),
                 "DK": elem, "DV": elem, "DQ_ACC": f32, "DS_SUM": f32, "ERR": i32,
                 **{name: dkdv_pack for name in BACKWARD_PACKED["dkdv"]},
                 "seq_len": "i32", **_separate(sep, "kv_seq_len"), "num_heads": "i32",
                 **_separate(sep, "num_kv_heads"), **_separate(sep, "num_q_blocks"),
                 "num_kv_blocks": "i32",
                 "qk_scale": "fp32", "sm_scale": "fp32", "ATOMIC_DQ": "constexpr",
                 "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "DKDV_PACK": "constexpr",
                 "INTERP_BF16": "constexpr"},
    }


def compile_triton_backward(spec: Spec, cfg: KernelConfig, target: Target, out_dir: Path,
                            source: Source | None = None,
                            bwd: BackwardConfig | None = None) -> list[Artifact]:
    """Compile every kernel of the backward module (preprocess, dQ, dK/dV) for `target`, with
    the target's default `BackwardConfig` (fitted to the spec); one Artifact per kernel."""
    bwd = (bwd or BackwardConfig.default_for(target)).fit(spec)
    if cfg.separate_kv:
        bwd = bwd.for_separate_kv()
    source = source or render_triton_backward(spec, cfg, target, bwd)
    arts = []
    for kernel, sig in backward_signatures(spec, bwd, cfg.separate_kv).items():
        consts, launch = bwd.kernel_launch(kernel)
        if kernel == "dq":
            consts = {**cursor_signature(spec)[2], "HAS_DSUM": False, **consts,
                      "INTERP_BF16": cfg.interp_bf16}
        if kernel == "dkdv":
            consts = {"ATOMIC_DQ": bwd.dq_atomic, **consts, "INTERP_BF16": cfg.interp_bf16}
        if kernel == "preprocess":  # from the fp32 O (`forward_for_grad`)
            consts = {"O_LO": None, "HAS_O_LO": False, **consts}
        # the packed tiles' pointers a config without packing leaves unused
        consts.update({name: None for name in BACKWARD_PACKED.get(kernel, ())
                       if sig[name] == "constexpr"})
        shape = "_".join(f"{k[6:].lower() or 'm'}{v}" for k, v in consts.items()
                         if k.startswith("BLOCK"))
        stem = (f"triton_{source.name.removesuffix('.py')}_{kernel}_{shape}"
                f"_w{launch['num_warps']}_s{launch['num_stages']}")
        arts.append(_compile_kernel(source, BACKWARD_KERNELS[kernel], sig, consts, launch,
                                    target, out_dir, stem, bwd.name))
    return arts


def _compile_kernel(source: Source, kernel: str, sig: dict[str, str], constexprs: dict,
                    launch: dict[str, int], target: Target, out_dir: Path, stem: str,
                    config_name: str) -> Artifact:
    """triton.compile one @triton.jit kernel of `source` (`sig`: every parameter in order)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _require_compiled_mode()
    # The AOT path must never run under the interpreter (it would hand back a Python function).
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        fn = load_triton(source, kernel)
        # Pointers are 16-byte aligned (torch allocations); sizes get no hint (S = cubes *
        # block and H*D are multiples of 16 for every spec we accept, topk is not).
        attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(sig.values())
                 if kind.startswith("*")}
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        gpu = GPUTarget(target.triton_backend, target.triton_arch,
                        target.warp_size)
        try:
            compiled = triton.compile(src, target=gpu, options=launch)
        except Exception as exc:  # triton raises several exception types for bad kernels
            raise CompileError(f"triton.compile failed for {target.name} {kernel} "
                               f"{config_name}: {type(exc).__name__}: {exc}") from exc
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    asm = compiled.asm
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = compiled.metadata
    if target.triton_backend == "cuda":
        binary, kind = asm["cubin"], "cubin"
        path = cache.atomic_write(out_dir / f"{stem}.cubin", binary)
        cache.atomic_write(out_dir / f"{stem}.ptx", asm["ptx"])
        res = cubin_resources(path)
        registers = res.get("registers")
        spills = res.get("spill_bytes")
        stack = res.get("stack_bytes")
        compiler = {"triton": triton.__version__, "ptxas": ptxas_version()}
        agprs = None
        mma = cubin_matrix_ops(path)
    else:
        binary, kind = asm["hsaco"], "hsaco"
        path = cache.atomic_write(out_dir / f"{stem}.hsaco", binary)
        amdgcn = asm.get("amdgcn", "")
        cache.atomic_write(out_dir / f"{stem}.amdgcn", amdgcn)
        registers = _amd_field(amdgcn, "vgpr_count")
        agprs = _amd_field(amdgcn, "agpr_count")
        # scratch (private segment) bytes per lane, the unit the HIP backend reports too
        spills = _amd_field(amdgcn, "private_segment_fixed_size")
        stack = spills
        compiler = {"triton": triton.__version__, "llvm": "bundled with triton"}
        mma = matrix_ops(amdgcn)
    return Artifact(
        path=path, kind=kind, backend="triton", target=target.name, arch=target.arch,
        kernel_name=meta.name if hasattr(meta, "name") else kernel,
        source_sha256=source.sha256, config=config_name, registers=registers, agprs=agprs,
        shared_bytes=int(meta.shared), spill_bytes=spills, stack_bytes=stack,
        threads=launch["num_warps"] * target.warp_size, compiler=compiler, matrix_ops=mma,
        command=[sys.executable, "-c", f"triton.compile(ASTSource({kernel}), target={gpu!r}, "
                 f"options={launch!r})"],
    )


def _amd_field(amdgcn: str, name: str) -> int | None:
    m = re.search(rf"\.{name}:\s+(\d+)", amdgcn)
    return int(m.group(1)) if m else None
