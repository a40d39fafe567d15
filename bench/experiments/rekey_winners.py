"""Question: after a template refactor that changes the rendered source but not the kernel, do
the shipped winners still compile to the same binaries, so that they can stay current without a
GPU? (issue #24: "the shipped H200 winners either stay current (identical compiled binaries), or
are re-measured and re-shipped")

For every winner in tuning_db/winners.json, in two processes (the old checkout on PYTHONPATH,
then this one), each with a fresh kernel cache:

1. render the winner's variant, check that the old render's sha256 is the one the winner
   stored (so the old checkout is the one the winner was measured with);
2. compile it ahead of time for its target with tilegen's own backend (Triton's ptxas) and read
   the SASS back with the cuobjdump Triton bundles;
3. compare the two SASS listings (kernel-name lines dropped: the same code under its name).

A winner whose SASS is byte-identical gets the new source sha256 in its variant key (and in its
candidate's); anything else is left as it is and reported, to be re-measured on the GPU.

With --float-immediates, a winner whose SASS differs only in floating-point immediates (the
instruction words' encodings dropped, every float literal masked: the same opcodes, registers,
addresses and branch targets in the same order, so the same issue slots and latencies) is
re-keyed too, and the table says so with the number of lines that differ. It is for a change of
a constant that real inputs never reach (session 38: the 8-bit scales' floor, FLT_MIN -> 2^-60,
which only padded rows meet); anything more than a constant still needs the GPU.

    python bench/experiments/rekey_winners.py --base /tmp/base            # report only
    python bench/experiments/rekey_winners.py --base /tmp/base --write    # rewrite the file
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WINNERS = ROOT / "tuning_db" / "winners.json"

# Runs in the old or the new checkout: render, compile, dump SASS; prints one JSON line.
PROBE = r"""
import hashlib, json, re, subprocess, sys, tempfile
from pathlib import Path
from tilegen import backends
from tilegen.config import KernelConfig
from tilegen.spec import Spec
from tilegen.targets import get_target
job = json.loads(sys.argv[1])
spec = Spec.from_dict(job["spec"])
cfg = KernelConfig.from_dict(job["config"])
target = get_target(job["target"])
impl = backends.get(job["backend"])
src = impl.render(spec.kernel_spec, cfg, target)
out = Path(tempfile.mkdtemp())
arts = impl.compile(spec.kernel_spec, cfg, target, src, out)
arts = arts if isinstance(arts, list) else [arts]
import triton, os
cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
listing = []
for a in arts:
    sass = subprocess.run([str(cuobjdump), "--dump-sass", str(a.path)], capture_output=True,
                          text=True, check=True).stdout
    # the code, not the names it is filed under
    listing += [l for l in sass.splitlines() if l.strip() and "Function :" not in l
                and not l.lstrip().startswith(("code for", "Fatbin", "arch =", "code version",
                                               "host =", "compile_size", ".", "//"))]
print(json.dumps({"source_sha256": src.sha256,
                  "sass_sha256": hashlib.sha256("\n".join(listing).encode()).hexdigest(),
                  "sass": listing,
                  "sass_lines": len(listing),
                  "registers": [a.registers for a in arts], "spills": [a.spill_bytes for a in arts],
                  "matrix_ops": [a.matrix_ops for a in arts]}))
"""


# an instruction line's encoding comment, and a float literal (a digit before a '.' or an 'e'
# exponent, or inf / nan), as cuobjdump prints them
ENCODING = re.compile(r"/\*\s*0x[0-9a-f]{16}\s*\*/")
FLOAT = re.compile(
    r"(?<![\w.])-?(?:\d+\.\d*(?:e[+-]?\d+)?|\d+e[+-]?\d+|\+?inf|-?qnan|nan)(?![\w.])", re.I)


def without_floats(listing: list[str]) -> list[str]:
    """The SASS with encodings dropped and float immediates masked."""
    lines = (ENCODING.sub("", line).strip() for line in listing)
    return [FLOAT.sub("<f>", line) for line in lines if line]


def probe(checkout: Path, job: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(checkout)
    env["TILEGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="rekey-cache-")
    env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="rekey-triton-")
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(job)], cwd=checkout,
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{checkout}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, type=Path,
                    help="the checkout the winners were measured with (e.g. git archive HEAD)")
    ap.add_argument("--write", action="store_true", help="rewrite tuning_db/winners.json")
    ap.add_argument("--float-immediates", action="store_true",
                    help="also re-key winners whose SASS differs only in float immediates")
    args = ap.parse_args()
    doc = json.loads(WINNERS.read_text())
    specs = {w["spec_hash"]: w["spec"] for w in doc["workloads"]}
    configs = {json.dumps(c["variant"], sort_keys=True): c["config"] for c in doc["candidates"]}
    rows, changed = [], 0
    for w in doc["winners"]:
        v = w["variant"]
        job = {"spec": specs[w["spec_hash"]], "config": configs[json.dumps(v, sort_keys=True)],
               "target": v["target"], "backend": v["backend"]}
        old, new = probe(args.base, job), probe(ROOT, job)
        measured_with_base = old["source_sha256"] == v["source_sha256"]
        same = measured_with_base and old["sass_sha256"] == new["sass_sha256"]
        verdict = "yes" if same else "no"
        if measured_with_base and not same and args.float_immediates:
            masked_old, masked_new = without_floats(old["sass"]), without_floats(new["sass"])
            if masked_old == masked_new:
                differ = sum(a != b for a, b in zip(old["sass"], new["sass"], strict=True))
                same, verdict = True, f"but for float immediates ({differ} lines)"
        rows.append((w["spec_hash"][:12], v["backend"], v["config"][:60], w["median_ms"],
                     measured_with_base, old["sass_sha256"][:12], new["sass_sha256"][:12],
                     old["sass_lines"], old["registers"], new["registers"], verdict))
        if same and new["source_sha256"] != v["source_sha256"]:
            for c in doc["candidates"]:
                if c["variant"] == v:
                    c["variant"] = {**v, "source_sha256": new["source_sha256"]}
            w["variant"] = {**v, "source_sha256": new["source_sha256"]}
            changed += 1
    print("| spec | backend | config | ms | base = measured | SASS old | SASS new | SASS lines "
          "| regs old | regs new | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
    if args.write and changed:
        WINNERS.write_text(json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False,
                                      allow_nan=False) + "\n")
    print(f"{changed} winner(s) re-keyed{'' if args.write else ' (report only: --write)'}; "
          f"{sum(r[-1] == 'no' for r in rows)} need a GPU re-measurement")
    return 0 if all(r[-1] != "no" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
