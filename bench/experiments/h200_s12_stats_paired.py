"""Question (issue #18): does the dK/dV consumer get faster when each row's lse and delta are
read as one 8-byte pair (`stats_paired`: one load and one 64-bit address per column instead of
two; offline the packed loop falls from 849 to 735 instructions, its integer ones from 317 to
214), with dp_early 1 (the default) in both? Second call (`STAGE=smem`): with the pairs staged
in shared memory by the producer warp (`stats_smem`: the consumer's packed loop 743 -> 598
instructions, 37 -> 4 global loads), against stats_paired alone (the default after call 1).
Third call (`STAGE=acc_zero`): S^T and dP^T from zero, in flight together, the staged
statistics read after each wait (`acc_zero`: 598 -> 575, no wgmma serialized), against
stats_smem (the default after call 2).

`h200_s8_overlap.py`'s harness: the small-shape gradient checks of the paired variant first,
then the default workload's training step, candidates interleaved (off on off on), gradients
scored against fp32 autograd, kernels from torch.profiler, the reference step last.

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=/tmp/tgc python3 bench/experiments/h200_s12_stats_paired.py
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import h200_s8_overlap as harness  # noqa: E402

if os.environ.get("STAGE") == "acc_zero":
    harness.CANDIDATES[:] = [
        (f"acc_zero {int(v)}{suffix}", False, {"acc_zero": v}, None)
        for suffix in ("", " again") for v in (False, True)]
    harness.SMALL_CHECKS[:] = [{"acc_zero": True}]
elif os.environ.get("STAGE") == "smem":
    harness.CANDIDATES[:] = [
        (f"stats_smem {int(v)}{suffix}", False, {"stats_smem": v, "acc_zero": False}, None)
        for suffix in ("", " again") for v in (False, True)]
    harness.SMALL_CHECKS[:] = [{"stats_smem": True, "acc_zero": False}]
else:
    harness.CANDIDATES[:] = [
        (f"stats_paired {int(v)}{suffix}", False,
         {"stats_paired": v, "stats_smem": False, "acc_zero": False}, None)
        for suffix in ("", " again") for v in (False, True)]
    harness.SMALL_CHECKS[:] = [{"stats_paired": True, "stats_smem": False, "acc_zero": False}]

if __name__ == "__main__":
    sys.exit(harness.main(["--small", *sys.argv[1:]]))
