"""Question: do the 256- and 384-token cubes (issue #21, item 4) pass the rules on the GPU, and
what do they cost beside 64-token cubes at the same density? And what does GQA through
`block_sparse_attention` cost beside the caller repeating the KV heads (item 3)?

One process on the H200, each stage in its own try/except (a failure is recorded and the rest
runs); the table is printed last and written to $OUT/h200_s10_shapes.json.

1. check: cubes (4, 4, 4) (the default spec's), (4, 8, 8) and (6, 8, 8) on the default grid
   (21, 30, 52) at 12.5% density, 8 heads (head 4 the outlier), `tilegen.load(spec)`: o against
   the fp32 oracle (`captures.score`) beside the oracle rounded once to bf16 (the rule's floor),
   dq/dk/dv against fp32 autograd (`captures.grad_score`).
2. time, 40 heads: forward (no grad) and forward + backward through the loaded op, for cubes of
   64 (the default spec: the shipped Gluon winner forward, the Triton/Gluon backward), 256, 384.
3. GQA, default workload with KV heads 8 (g = 5): `block_sparse_attention(q, k8, v8, ...)`
   against the same call with k8, v8 repeated by the caller; forward and forward + backward.

    PYTHONPATH=. [STAGES=check,time,gqa] python bench/experiments/h200_s10_shapes.py
"""

from __future__ import annotations

import json
import math
import os
import traceback

import torch
from triton.testing import do_bench

import tilegen
from tilegen import captures
from tilegen.ops import block_sparse_attention
from tilegen.reference import attention_fp32, attention_grads_fp32

OUT = os.environ.get("OUT", ".")
GRID = (21, 30, 52)
rows: list[dict] = []


def record(**kw):
    rows.append(kw)
    print(kw, flush=True)


def spec_for(cube, heads):
    vol = math.prod(cube)
    base = tilegen.Spec()
    probe = tilegen.Spec(block_q=vol, block_kv=vol, cube=cube, grid=GRID, num_heads=heads,
                         topk=1)
    topk = max(1, round(probe.num_cubes * base.topk / base.num_cubes))
    return probe.replace(topk=topk)


def inputs(spec, seed=0, outlier=True):
    cap = captures.synthesize_for(spec, seed=seed, device="cuda", outlier=outlier)
    return tuple(cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))


def check(cube):
    spec = tilegen.Spec(num_heads=8) if cube == (4, 4, 4) else spec_for(cube, 8)
    q, k, v, idx, vbs = inputs(spec, seed=1, outlier=4)
    op = tilegen.load(spec)
    o, _ = op(q, k, v, idx, vbs)
    ref, _ = attention_fp32(q, k, v, idx, vbs, layout="bshd", block=spec.block_kv)
    fwd = captures.score(o, ref)
    floor = captures.score(ref.to(q.dtype), ref)  # the fp32 oracle rounded once to bf16
    g = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(q.shape, device="cuda", generator=g).bfloat16()
    qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
    o2, _ = op(qr, kr, vr, idx, vbs)
    real = (torch.arange(spec.block_q, device="cuda")[None] < vbs[:, None]).reshape(1, -1, 1, 1)
    o2.backward(torch.where(real, do, 0))
    refs = attention_grads_fp32(q, k, v, idx, vbs, None, do, block=spec.block_kv)
    grads = {n: captures.grad_score(t.grad, r)
             for n, t, r in zip(("dq", "dk", "dv"), (qr, kr, vr), refs, strict=True)}
    record(stage="check", cube=cube, topk=spec.topk, op=repr(op), forward=str(fwd),
           forward_pass=fwd.passed, bf16_floor=str(floor),
           mean_abs_ref=ref.abs().mean().item(), **{n: str(s) for n, s in grads.items()},
           grads_pass=all(s.passed for s in grads.values()))


def time_cube(cube):
    spec = tilegen.Spec() if cube == (4, 4, 4) else spec_for(cube, 40)
    q, k, v, idx, vbs = inputs(spec)
    op = tilegen.load(spec)
    fwd = do_bench(lambda: op(q, k, v, idx, vbs, return_lse=False), warmup=10, rep=100,
                   return_mode="median")
    qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
    do = torch.randn_like(q)

    def train():
        o, _ = op(qr, kr, vr, idx, vbs)
        o.backward(do)
        qr.grad = kr.grad = vr.grad = None

    train()
    fb = do_bench(train, warmup=5, rep=50, return_mode="median")
    record(stage="time", cube=cube, topk=spec.topk, op=repr(op), forward_ms=fwd,
           fwd_bwd_ms=fb)


def gqa_variant(name, q, kk, vv, idx, vbs):
    fwd = do_bench(lambda: block_sparse_attention(q, kk, vv, idx, vbs), warmup=10, rep=100,
                   return_mode="median")
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, kk, vv))
    do = torch.randn_like(q)

    def train():
        block_sparse_attention(qg, kg, vg, idx, vbs).backward(do)
        qg.grad = kg.grad = vg.grad = None

    train()
    fb = do_bench(train, warmup=5, rep=50, return_mode="median")
    record(stage="gqa", variant=name, kv_heads=kk.shape[2], forward_ms=fwd, fwd_bwd_ms=fb)


def gqa():
    q, k, v, idx, vbs = inputs(tilegen.Spec())
    k8, v8 = k[:, :, ::5].contiguous(), v[:, :, ::5].contiguous()
    kr, vr = k8.repeat_interleave(5, dim=2), v8.repeat_interleave(5, dim=2)
    gqa_variant("gqa (g=5)", q, k8, v8, idx, vbs)
    gqa_variant("repeated by the caller", q, kr, vr, idx, vbs)
    o1 = block_sparse_attention(q, k8, v8, idx, vbs)
    o2 = block_sparse_attention(q, kr, vr, idx, vbs)
    record(stage="gqa", variant="equal outputs", equal=bool(torch.equal(o1, o2)))


def main():
    only = os.environ.get("STAGES")  # e.g. STAGES=check: the stages whose name starts so
    stages = [("check 64", lambda: check((4, 4, 4))),
                     ("check 256", lambda: check((4, 8, 8))),
                     ("check 384", lambda: check((6, 8, 8))),
                     ("time 64", lambda: time_cube((4, 4, 4))),
                     ("time 256", lambda: time_cube((4, 8, 8))),
                     ("time 384", lambda: time_cube((6, 8, 8))),
                     ("gqa", gqa)]
    for name, fn in stages:
        if only and not any(name.startswith(o) for o in only.split(",")):
            continue
        try:
            fn()
        except Exception:
            record(stage=name, error=traceback.format_exc()[-2000:])
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "h200_s10_shapes.json"), "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                   "rows": rows}, f, indent=1, default=str)
    print("| stage | what | forward ms | fwd+bwd ms | result |")
    print("|---|---|---|---|---|")
    for r in rows:
        what = r.get("cube") or r.get("variant") or ""
        res = r.get("error", "")[-200:] or (
            f"fwd {r['forward']} (bf16 floor {r['bf16_floor']}) grads {r['grads_pass']}"
            if r["stage"] == "check"
            else r.get("op", r.get("equal", "")))
        print(f"| {r['stage']} | {what} | {r.get('forward_ms', '')} | {r.get('fwd_bwd_ms', '')} "
              f"| {res} |")


if __name__ == "__main__":
    main()
