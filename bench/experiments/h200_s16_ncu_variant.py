"""Issue #19, session 16: one 8-bit kernel variant under Nsight Compute (as
`h200_s15_ncu_quant.py` profiles the default), to compare issue rate, stalls and pipe use
between configs. The options ride over the sm_90 default config:

    ncu --target-processes all -k regex:lut_ws_quant --launch-skip 2 --launch-count 1 \\
        --set full --import-source no -o $OUT/v python3 \\
        bench/experiments/h200_s16_ncu_variant.py 'num_consumers=3,k_stages=3,two_level=0'
"""

from __future__ import annotations

import sys

import torch

import tilegen
from tilegen import backends, captures
from tilegen.spec import Spec
from tilegen.targets import get_target


def main() -> None:
    opts = {}
    for kv in filter(None, (sys.argv[1] if len(sys.argv) > 1 else "").split(",")):
        key, val = kv.split("=")
        opts[key] = int(val) if key.endswith(("stages", "consumers", "regs")) else bool(int(val))
    spec = Spec(quant="int8_fp8")
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=0, device="cuda")
    cfg = backends.get("gluon").default_config(spec.kernel_spec, get_target("sm_90"))
    op = tilegen.load(spec, cfg.replace(options={**dict(cfg.options), **opts}), backend="gluon")
    args = [cap[n] for n in ("q", "k", "v", "topk_idx", "vbs")]
    for _ in range(3):
        op(*args, return_lse=False)
    torch.cuda.synchronize()
    print(repr(op))


if __name__ == "__main__":
    main()
