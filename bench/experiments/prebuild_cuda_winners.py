"""Compile the CUDA family's shipped winners (tuning_db/winners.json) for sm_90a here, with lse
and without, into TILEGEN_CACHE_DIR: what a device call's sweep loads, so the GPU machine
compiles none of them (the gpu_s30 / gpu_s32 prepare scripts run it).

    TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/prebuild_cuda_winners.py
"""

from __future__ import annotations

import json
from pathlib import Path

import tilegen
from tilegen.backends.cuda.nvcc import compile_cuda
from tilegen.config import KernelConfig
from tilegen.spec import Spec
from tilegen.targets import get_target

WINNERS = Path(__file__).resolve().parents[2] / "tuning_db" / "winners.json"


def main() -> int:
    doc = json.loads(WINNERS.read_text())
    specs = {w["spec_hash"]: w["spec"] for w in doc["workloads"]}
    configs = {c["variant"]["config"]: c["config"] for c in doc["candidates"]}
    target = get_target("sm_90")
    for w in doc["winners"]:
        if w["variant"]["backend"] != "cuda":
            continue
        op = tilegen.load(Spec.from_dict(specs[w["spec_hash"]]),
                          KernelConfig.from_dict(configs[w["variant"]["config"]]),
                          backend="cuda", target="sm_90")
        for lse in (True, False):
            run = op._launch_for(lse)
            compile_cuda(run.source, target, None, run.digest)
        print(f"prebuilt the {w['device_name']} winner {w['variant']['config']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
