"""Question: where do the 2.3 ms that storing dS^T adds to the Gluon dK/dV kernel go? (issue #18)

On the default workload (`captures.synthesize_for(Spec(), outlier=True)`), with lse, the fp32 O
and delta as the backward gets them, the Gluon dK/dV kernel alone (`GluonBackward.dkdv`, one
group of all heads, the inverse map prebuilt), timed (`do_bench`, median) without the store,
with it, and with one step of the store left out (the `debug` timing experiments of
templates/gluon/lut_ws_backward.py.j2: their results are garbage): the wait for the previous
pair's TMA store, the shared-memory write of the tile, the TMA store itself. The reference
(with the store) is timed first and last. The table is printed last.

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=/tmp/tgc python3 bench/experiments/h200_ds_store_cost.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main() -> int:
    import triton

    import tilegen
    from tilegen import captures
    from tilegen.backends.gluon.backward import GluonBackward
    from tilegen.backends.triton.backward import inverse_map

    spec = tilegen.Spec()
    cap = captures.synthesize_for(spec, seed=0, device="cuda", outlier=True)
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    op = tilegen.load(spec, backend="triton")
    _o, lse, o32 = op.forward_for_grad(q, k, v, idx, vbs)
    g = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(q.shape, generator=g, device="cuda").to(q.dtype)
    delta = (do.float() * o32).sum(-1).permute(0, 2, 1).contiguous()
    B, S, H, D = q.shape
    nq = S // 64
    offsets, qcubes = inverse_map(idx, None, nq)
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    ds = torch.empty((B * H * nq * idx.shape[3] * 64, 64), dtype=q.dtype, device="cuda")
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    rows = {}
    for label, debug, store in (("with the store (reference)", "", True),
                                ("no store", "", False),
                                ("store, no wait for the previous store", "no_ds_wait", True),
                                ("store, no shared-memory write", "no_ds_smem", True),
                                ("store, no TMA store", "no_ds_tma", True),
                                ("with the store again", "", True)):
        gb = GluonBackward(spec, op.target, {"ds_store": store, "debug": debug,
                                             "scratch_bytes": 1 << 40})

        def call(gb=gb, store=store):
            gb.dkdv(q, k, v, do, lse, delta, offsets, qcubes, vbs, dk, dv,
                    ds if store else None, err, spec.sm_scale)

        call()
        torch.cuda.synchronize()
        rows[label] = float(triton.testing.do_bench(call, warmup=25, rep=300,
                                                    return_mode="median"))
        print(f"{label:<40} {rows[label]:8.3f} ms", flush=True)
    out = Path(os.environ.get("OUT", "out")) / "h200_ds_store_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "ms": rows}, indent=2))
    print("\n".join(f"{k:<40} {v:8.3f}" for k, v in rows.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
