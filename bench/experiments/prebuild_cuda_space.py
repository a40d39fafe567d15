"""Compile every feasible point of the CUDA family's tuning space (`[tunable.cuda]` of
targets/sm_90/target.toml) for sm_90a here, with no GPU, into $TILEGEN_CACHE_DIR, so that a
tuning run on the GPU (`gpu_s21_tune.sh`, `gpu_s21_ship.sh`) spends no time in nvcc. The tuner
times each point with lse, so only those cubins are built. Split the points over processes
with PART/PARTS (two cores: run two).

    TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/prebuild_cuda_space.py default 0 2 &
    TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/prebuild_cuda_space.py default 1 2
    ... int8_fp8 0 2 / int8_fp8 1 2     (the 8-bit spec, bench/specs/int8_fp8.toml)
    ... int8_fp8 0 2 --space kv_copies=tma,bulk --space consumers=1,2 ...   (the space of a
                                                        `tilegen tune --space ...` run)
"""

from __future__ import annotations

import argparse
import time

from tilegen.backends.cuda import BACKEND
from tilegen.backends.cuda.nvcc import compile_cuda
from tilegen.spec import Spec
from tilegen.targets import get_target
from tilegen.tune.space import SearchSpace, parse_space_override


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", choices=["default", "int8_fp8"])
    ap.add_argument("part", type=int, nargs="?", default=0)
    ap.add_argument("parts", type=int, nargs="?", default=1)
    ap.add_argument("--space", action="append", default=[], metavar="NAME=V1,V2",
                    help="override one field of the space, as `tilegen tune --space`")
    args = ap.parse_args()
    overrides = dict(parse_space_override(text) for text in args.space)
    target = get_target("sm_90")
    spec = Spec(quant="int8_fp8") if args.spec == "int8_fp8" else Spec()
    feasible = SearchSpace.from_target(spec, target, overrides, backend="cuda").feasible()
    print(f"{args.spec}: {len(feasible)} feasible points", flush=True)
    for n, cfg in enumerate(feasible):
        if n % args.parts != args.part:
            continue
        t0 = time.perf_counter()
        c = cfg.replace(store_lse=True)
        src = BACKEND.render(spec.kernel_spec, c, target)
        key = BACKEND.variant_key(spec.kernel_spec, c, target, src)
        compile_cuda(src, target, None, key.digest)
        print(f"{n} {cfg.name} {time.perf_counter() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
