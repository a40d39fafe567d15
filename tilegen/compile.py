"""Toolchains: one module per compiler (Triton AOT, nvcc, clang-19 HIP).

Every compiler returns `Artifact`s with the same resource report, so the build manifest, the
cache and the tests treat all backends alike.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path


class ToolchainMissing(RuntimeError):
    """A compiler needed for a target is not installed; the message says how to install it."""


class CompileError(RuntimeError):
    """The compiler rejected a generated source; the message holds its diagnostics."""


@dataclass
class Artifact:
    """One compiled binary and what the compiler reported about it."""

    path: Path
    kind: str  # "cubin" | "hsaco"
    backend: str  # "triton" | "cuda" | "hip"
    target: str  # "sm_90" | "sm_100a" | "gfx942"
    arch: str  # the exact ISA: "sm_90a", "sm_100a", "gfx942"
    kernel_name: str
    source: Path | None = None
    source_sha256: str = ""
    config: str = ""
    registers: int | None = None  # per thread (VGPRs on AMD)
    agprs: int | None = None  # AMD accumulation registers
    shared_bytes: int | None = None  # static + dynamic shared memory / LDS per block
    # local / scratch memory per thread, in bytes: cuobjdump LOCAL + STACK (Triton, Gluon),
    # ptxas spill stores + loads (nvcc), private segment size (AMD, both backends); 0: no spills
    spill_bytes: int | None = None
    stack_bytes: int | None = None
    occupancy: int | None = None  # blocks (or waves) per SM/CU where known
    threads: int | None = None
    compiler: dict[str, str] = field(default_factory=dict)  # tool -> version
    # matrix instructions in the binary, by mnemonic ("HGMMA", "UTCHMMA", "v_mfma_..."): what
    # the tensor cores are really asked to do; None where no disassembler was at hand
    matrix_ops: dict[str, int] | None = None
    command: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("path", "source"):
            if d[key] is not None:
                d[key] = str(d[key])
        return d


#: tensor-core mnemonics: SASS mma.sync (HMMA), wgmma (HGMMA; IGMMA int8, QGMMA fp8), tcgen05
#: (UTCHMMA, UTCQMMA, ...), integer and fp8 forms, and AMD MFMA (the whole mnemonic, so its
#: shape shows)
_MATRIX_MNEMONIC = re.compile(
    r"\b(HMMA|HGMMA|IGMMA|QGMMA|IMMA|QMMA|UTC[A-Z]*MMA|v_mfma_[a-z0-9_]+)\b")


def matrix_ops(disassembly: str) -> dict[str, int]:
    """How many times each matrix instruction appears in a SASS or AMDGCN listing."""
    return dict(sorted(Counter(m.group(1) for m in _MATRIX_MNEMONIC.finditer(disassembly)).items()))


def format_matrix_ops(ops: dict[str, int] | None) -> str:
    """``HGMMA*64`` style; "none" for a binary without any, "?" where it was not read."""
    if ops is None:
        return "?"
    return ",".join(f"{k}*{v}" for k, v in ops.items()) or "none"
