"""Reading NVIDIA cubins with the tools Triton's wheel bundles (no CUDA install needed): the
resource report (`cuobjdump --dump-resource-usage`), the matrix instructions in the SASS
(`cuobjdump --dump-sass`) and ptxas's version. Every family that builds cubins (Triton, Gluon,
the CUDA C++) reports through these, so their manifests read alike."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tilegen.compile import matrix_ops


def _bundled(tool: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool


def ptxas_version() -> str:
    """The bundled ptxas's release ("12.9"), or "unknown"."""
    try:
        out = subprocess.run([str(_bundled("ptxas")), "--version"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    m = re.search(r"release ([\d.]+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def cubin_resources(cubin: Path) -> dict[str, int]:
    """Registers, shared memory, stack and spill bytes of a cubin, via cuobjdump."""
    out = subprocess.run([str(_bundled("cuobjdump")), "--dump-resource-usage", str(cubin)],
                         capture_output=True, text=True)
    res: dict[str, int] = {}
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", out.stdout)
    if m:
        res = {"registers": int(m.group(1)), "stack_bytes": int(m.group(2)),
               "static_shared": int(m.group(3)), "local_bytes": int(m.group(4))}
        # ptxas for sm_90 spills into the stack frame (STL/LDL, STACK > 0, LOCAL 0); a Triton or
        # Gluon kernel has no calls or local arrays, so its frame is spills
        res["spill_bytes"] = res["stack_bytes"] + res["local_bytes"]
    return res


def cubin_matrix_ops(cubin: Path) -> dict[str, int] | None:
    """The cubin's matrix instructions by mnemonic (cuobjdump --dump-sass); None when it cannot
    be read."""
    proc = subprocess.run([str(_bundled("cuobjdump")), "--dump-sass", str(cubin)],
                          capture_output=True, text=True)
    return matrix_ops(proc.stdout) if proc.returncode == 0 else None
