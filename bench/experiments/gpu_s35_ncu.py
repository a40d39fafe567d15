"""Issue #19, session 35: one variant of gpu_s35_fixed.py, kernel + plan four times on the
default workload, for Nsight Compute (`ncu -k regex:int8_fp8_bm64 --launch-skip 2
--launch-count 1`): why the persistent grid's dynamic schedule is 1.5% behind one CTA a cube at
TOPK 78 (RESULTS, session 35, run 4).

    python3 bench/experiments/gpu_s35_ncu.py "1c K2 V2 linear dynamic"
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tilegen import captures
from tilegen.spec import Spec

sys.path.insert(0, str(Path(__file__).parent))
import gpu_s35_fixed as fixed  # noqa: E402

spec = Spec(quant="int8_fp8")
cap = captures.synthesize_for(spec.replace(quant="none"), seed=0, device="cuda")
op = fixed.load(spec, sys.argv[1])
qi = op.quantize(cap["q"], cap["k"], cap["v"], cap["vbs"])
for _ in range(4):
    op.from_quantized(qi, cap["topk_idx"], cap["vbs"], return_lse=False)
torch.cuda.synchronize()
