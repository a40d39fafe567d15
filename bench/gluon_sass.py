"""Compile Gluon variants for sm_90a on a CPU machine and report SASS facts.

    python3 bench/gluon_sass.py '{"num_consumers": 2}' ...

Per variant: registers, stack/spills, HGMMA by shape, MUFU.EX2 count, and for each consumer loop
how many MUFU.EX2 sit between the wait for Q.K (DEPBAR.LE 1) and the wait for P.V (DEPBAR.LE 0):
32 means the softmax overlaps the in-flight P.V, 0 means ptxas serialised it.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("TILEGEN_CACHE_DIR", tempfile.mkdtemp())

from tilegen.backends.gluon import render as R  # noqa: E402
from tilegen.backends.gluon.launch import compile_offline  # noqa: E402

BIN = os.path.join(os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin")


def facts(cfg):
    k = compile_offline(cfg)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([f"{BIN}/cuobjdump", "--dump-sass", f.name], capture_output=True, text=True).stdout
    res = subprocess.run([f"{BIN}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                         text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", sass)
    names = [o[1] for o in ops]
    hg = {}
    for line in sass.splitlines():
        m = re.search(r"HGMMA\.(\w+)", line)
        if m:
            hg[m.group(1)] = hg.get(m.group(1), 0) + 1
    # MUFU.EX2 issued while a P.V HGMMA group is in flight (between its last HGMMA and the
    # next wait for zero groups): the softmax work that overlaps the tensor cores within one warpgroup
    overlap = []
    cnt = None
    lines = [l for l in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s+[@A-Z]", l)]
    for n, line in zip(names, lines):
        if n.startswith("HGMMA.64x%d" % 128):
            cnt = 0
        elif n.startswith("WARPGROUP.DEPBAR") and line.split(";")[0].rstrip().endswith("0x0") and cnt is not None:
            overlap.append(cnt)
            cnt = None
        elif n == "MUFU.EX2" and cnt is not None:
            cnt += 1
    ptx = os.path.join(tempfile.mkdtemp(), "k.ptx")
    open(ptx, "w").write(k.asm["ptx"])
    warn = subprocess.run([f"{BIN}/ptxas", "-arch=sm_90a", "-v", f"-maxrregcount={k.metadata.maxnreg}", ptx,
                           "-o", ptx + ".cubin"], capture_output=True, text=True).stderr
    warn = [w.split(":", 1)[1].strip()[:90] for w in warn.splitlines() if "Performance Loss" in w]
    reg = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    return {
        "variant": R.variant_name(cfg), "maxnreg": R.maxnreg_for(R.resolve(cfg)),
        "smem": k.metadata.shared, "reg/stack/local": reg.groups() if reg else None,
        "LDL/STL": sum(n.startswith(("LDL", "STL")) for n in names),
        "HGMMA": hg, "MUFU.EX2": names.count("MUFU.EX2"),
        "ex2 under P.V": overlap, "ptxas warnings": warn,
    }


if __name__ == "__main__":
    cfgs = [json.loads(a) for a in sys.argv[1:]] or [{}]
    for c in cfgs:
        try:
            print(json.dumps(facts(c)))
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"cfg": c, "error": f"{type(e).__name__}: {e}"[:2000]}))
