"""Question (issue 24, item 1): does moving the CK-style C++ library out of the Jinja templates
into static headers (templates/cuda/include, templates/hip/include) change any compiled variant?

Compiles every CUDA and HIP variant tilegen renders with tilegen's own AOT compile (the backend's
`compile`: the Artifact's registers, spill_bytes, shared_bytes, matrix_ops) and hashes its
machine code (cuobjdump --dump-sass / llvm-objdump -d, with addresses stripped: `sass_sha256`;
the mnemonics alone: `ops_sha256`), into a JSON table; `--diff` compares two tables.

    git archive HEAD | tar -x -C /tmp/base          # the tree before the change
    PYTHONPATH=/tmp/base TILEGEN_CACHE_DIR=$(mktemp -d) python3 cpp_resources.py before.json
    TILEGEN_CACHE_DIR=$(mktemp -d) python3 cpp_resources.py after.json
    python3 cpp_resources.py --diff before.json after.json

TARGETS=sm_90,sm_100a (or gfx942) limits the targets, JOBS=N the parallel compiles (default 2).

Variants: for each target with a C++ family (sm_90, sm_100a: cuda; gfx942: hip), every spec
the family accepts over head_dim {64, 128} x dtype {bf16, fp16} x layout {bshd, bhsd} x
variable block sizes {on, off} (encoding "lut"; a "mask" spec compiles the same LUT kernel,
checked; "sliding_tile" is refused by both families), x every valid config of the target's
default and its tunable space (block_m, block_n, num_warps, num_stages), x store_lse {on, off}
x store_max_prob {off, on}.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def variants():
    from tilegen import backends
    from tilegen.render import spec_basename
    from tilegen.spec import Spec
    from tilegen.targets import get_target

    out = []
    only = [t for t in os.environ.get("TARGETS", "").split(",") if t]
    for tname, bname in (("sm_90", "cuda"), ("sm_100a", "cuda"), ("gfx942", "hip")):
        if only and tname not in only:
            continue
        target, backend = get_target(tname), backends.get(bname)
        space = backend.tunable(target)
        keys = list(space)
        for d, dt, lay, vbs in itertools.product((64, 128), ("bf16", "fp16"), ("bshd", "bhsd"),
                                                 (True, False)):
            spec = Spec(head_dim=d, dtype=dt, layout=lay, variable_block_sizes=vbs)
            if backend.spec_violations(spec, target):
                continue
            base = backend.default_config(spec, target)
            cfgs = [base] + [base.replace(**dict(zip(keys, vals, strict=True)))
                             for vals in itertools.product(*space.values())]
            seen = set()
            for cfg in cfgs:
                if cfg.name in seen or backend.violations(spec, target, cfg):
                    continue
                seen.add(cfg.name)
                for lse, mp in ((True, False), (True, True), (False, False), (False, True)):
                    c = cfg.replace(store_lse=lse, store_max_prob=mp)
                    out.append((tname, bname, spec, c, cfg == base,
                                f"{tname}/{spec_basename(spec)}/{c.name}"))
    return out


def _sass(path: Path, kind: str, arch: str) -> str:
    if kind == "cubin":
        from tilegen.cubin import _bundled

        text = subprocess.run([str(_bundled("cuobjdump")), "--dump-sass", str(path)],
                              capture_output=True, text=True, check=True).stdout
        lines = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", ln).strip() for ln in text.splitlines()
                 if ln.strip() and "code for" not in ln and "Function :" not in ln
                 and "Fatbin" not in ln and ".target" not in ln]
    else:
        objdump = shutil.which("llvm-objdump-19") or "llvm-objdump"
        text = subprocess.run([objdump, "-d", f"--mcpu={arch}", "--no-show-raw-insn",
                               "--no-leading-addr", str(path)],
                              capture_output=True, text=True, check=True).stdout
        lines = [ln.split("//")[0].strip() for ln in text.splitlines()
                 if ln.strip() and "file format" not in ln]
    return "\n".join(lines)


def _mnemonics(sass: str) -> str:
    """The instruction sequence without operands: equal when only register names differ."""
    out = []
    for ln in sass.splitlines():
        ln = re.sub(r"/\*.*?\*/", "", ln).strip()
        if not ln or ln.endswith(":"):
            continue
        words = ln.split()
        out.append(" ".join(words[:2]) if words[0].startswith("@") else words[0])
    return "\n".join(out)


def compile_one(item):
    from tilegen import backends
    from tilegen.targets import get_target

    tname, bname, spec, cfg, is_default, key = item
    target, backend = get_target(tname), backends.get(bname)
    src = backend.render(spec, cfg, target)
    with tempfile.TemporaryDirectory() as tmp:
        art = backend.compile(spec, cfg, target, src, Path(tmp))
        sass = _sass(art.path, art.kind, art.arch)
    row = {
        "target": tname, "backend": bname, "spec": {"head_dim": spec.head_dim, "dtype":
               spec.dtype, "layout": spec.layout, "vbs": spec.variable_block_sizes},
        "config": cfg.name, "default_config": is_default,
        "registers": art.registers, "agprs": art.agprs, "spill_bytes": art.spill_bytes,
        "stack_bytes": art.stack_bytes, "shared_bytes": art.shared_bytes,
        "occupancy": art.occupancy, "threads": art.threads, "matrix_ops": art.matrix_ops,
        "kernel_name": art.kernel_name, "source_sha256": src.sha256,
        "rendered_lines": src.text.count("\n"),
        "sass_sha256": hashlib.sha256(sass.encode()).hexdigest(),
        "ops_sha256": hashlib.sha256(_mnemonics(sass).encode()).hexdigest(),
        "sass_lines": sass.count("\n") + 1,
    }
    mask = backend.render(spec.replace(encoding="mask").kernel_spec, cfg, target)
    row["mask_same_source"] = mask.text == src.text
    return key, row


def run(out: str) -> None:
    items = variants()
    print(f"{len(items)} variants", file=sys.stderr)
    table = {}
    with ThreadPoolExecutor(max_workers=int(os.environ.get("JOBS", "2"))) as pool:
        for i, (key, row) in enumerate(pool.map(compile_one, items)):
            table[key] = row
            if i % 50 == 0:
                print(f"{i}/{len(items)} {key}", file=sys.stderr)
    import tilegen

    Path(out).write_text(json.dumps({"tilegen": tilegen.__file__, "variants": table},
                                    indent=1, sort_keys=True) + "\n")


FIELDS = ("registers", "agprs", "spill_bytes", "stack_bytes", "shared_bytes", "occupancy",
          "threads", "matrix_ops", "kernel_name", "sass_sha256", "ops_sha256")


def _load(paths: str) -> dict:
    """One table, or several joined with commas (the targets run apart)."""
    out: dict = {}
    for p in paths.split(","):
        out.update(json.loads(Path(p).read_text())["variants"])
    return out


def diff(a_path: str, b_path: str) -> None:
    a, b = _load(a_path), _load(b_path)
    only = sorted(set(a) ^ set(b))
    changed = {k: [f for f in FIELDS if a[k][f] != b[k][f]] for k in sorted(set(a) & set(b))}
    changed = {k: v for k, v in changed.items() if v}
    print(f"variants: before {len(a)}, after {len(b)}, in one only {len(only)}, "
          f"any field changed {len(changed)}")
    for k in only:
        print("  only in", "before" if k in a else "after", k)
    for k, fs in changed.items():
        print(f"  {k}: " + ", ".join(f"{f} {a[k][f]} -> {b[k][f]}" for f in fs))


if __name__ == "__main__":
    if sys.argv[1] == "--diff":
        diff(sys.argv[2], sys.argv[3])
    else:
        run(sys.argv[1])
