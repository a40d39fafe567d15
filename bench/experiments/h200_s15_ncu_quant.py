"""Issue #19, sessions 15-16: the 8-bit op's kernel under Nsight Compute, to see where its time
goes (warp stall reasons, pipe use, issue rate). One call of `tilegen.load(Spec(quant=
"int8_fp8"))` on the default workload (TOPK 78, seed 0) after two warm-up calls; ncu profiles
the third launch of the 8-bit kernel. An optional argument names a variant's knobs over the
default config, as `h200_quant_op.py --variants` takes them (one variant):

    ncu --target-processes all -k regex:lut_ws_quant --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \\
        --csv --page details python3 bench/experiments/h200_s15_ncu_quant.py > $OUT/ncu.csv
    ncu ... --set full -o $OUT/v python3 bench/experiments/h200_s15_ncu_quant.py \\
        'num_consumers=3,k_stages=3,consumer_regs=160,two_level=0'
"""

from __future__ import annotations

import sys

import torch
from h200_quant_op import VARIANT, load8, parse_variants

from tilegen import captures
from tilegen.spec import Spec


def main() -> None:
    if len(sys.argv) > 1:
        (opts,) = parse_variants(sys.argv[1])
        VARIANT.update(opts)
    spec = Spec(quant="int8_fp8")
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=0, device="cuda")
    op = load8(spec)
    args = [cap[n] for n in ("q", "k", "v", "topk_idx", "vbs")]
    for _ in range(3):
        op(*args, return_lse=False)
    torch.cuda.synchronize()
    print(repr(op))


if __name__ == "__main__":
    main()
