"""Question (issue #18): does the dK/dV consumer get faster when dP^T = V dO^T is issued before
P^T is made (`dp_early`), so the tensor core runs it under the exp2 of the scores?

- 0: today (S^T synchronous, then P^T, then dP^T and dV issued together);
- 1: dP^T issued right after S^T, accumulating onto -delta: ptxas orders its set-up after S^T's
  end, so the two do not overlap each other, but dP^T runs while P^T is made; no new spills;
- 2: dP^T from zero (delta subtracted after), in flight beside S^T; 9 more spilled words.

`h200_s8_overlap.py`'s harness: first the small-shape gradient checks of both new variants
(packed and not, head dims 64 and 128, two seeds, garbage in the padded slots, an unchosen cube,
bad values), then the default workload's training step as users call it, each candidate twice
(0 1 2 0 1 2), gradients scored against fp32 autograd, kernels from torch.profiler, the
reference step last. Table last; JSON in $OUT/h200_s8_overlap.json.

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=/tmp/tgc python3 bench/experiments/h200_s12_dp_early.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import h200_s8_overlap as harness  # noqa: E402

harness.CANDIDATES[:] = [
    (f"dp_early {v}{suffix}", False, {"dp_early": v}, None)
    for suffix in ("", " again") for v in (0, 1, 2)]
harness.SMALL_CHECKS[:] = [{"dp_early": 1}, {"dp_early": 2}]

if __name__ == "__main__":
    sys.exit(harness.main(["--small", *sys.argv[1:]]))
