"""Question: do the calls of separate K/V (issue #21, items 1-3: cross-attention, packed varlen,
GQA read in place) pass the rules on the H200, and does each lose to the equivalent call a user
could make without it: GQA against the KV heads repeated by the caller, cross-attention against
q padded to the KV length, a packed batch against a loop over its sequences?

One process, each stage in its own try/except (a failure is recorded and the rest runs); the
table is printed last and written to $OUT/h200_s11_kv.json. Every timing is of what users call
(`block_sparse_attention`, `block_sparse_attention_varlen`), triton.testing.do_bench medians.

1. gqa_check: 10 query heads over 2 KV heads (g = 5, the outlier in head 4), default grid: o
   against the fp32 oracle (`captures.score`, beside the oracle rounded to bf16: the rule's
   floor) and dq/dk/dv against fp32 autograd (`captures.grad_score`).
2. gqa_time: 40 query heads over 8 KV heads: in place (the Triton kernels of separate K/V)
   against the caller's repeat (the default family: the Gluon winner forward, the default
   backward) and against the Triton op on the repeated heads (the same family's kernels without
   separate K/V); forward and forward + backward.
3. cross: q on the default grid, K/V with twice the cubes (history frames), 40 heads, the same
   topk; against q padded with zero rows to the KV length (the default family); plus the check
   of o and grads on 8 heads.
4. varlen: grids (21, 30, 52), (11, 30, 52), (5, 30, 52), 40 heads, each at the default density:
   one packed call against a loop of three `block_sparse_attention` calls; outputs compared.
5. vsa: `video_sparse_attention` over the same three grids as a list (one fine launch) against
   a loop of three calls; outputs compared.

    PYTHONPATH=. [STAGES=gqa,cross,varlen,vsa] python bench/experiments/h200_s11_kv.py
"""

from __future__ import annotations

import json
import os
import traceback

import torch
from triton.testing import do_bench

import tilegen
from tilegen import captures
from tilegen.ops import block_sparse_attention, block_sparse_attention_varlen
from tilegen.reference import attention_fp32, attention_grads_fp32

OUT = os.environ.get("OUT", ".")
rows: list[dict] = []


def record(**kw):
    rows.append(kw)
    print(kw, flush=True)


def inputs(spec, seed=0, outlier=True):
    cap = captures.synthesize_for(spec, seed=seed, device="cuda", outlier=outlier)
    return tuple(cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))


def timed(name, call, tensors, stage, **extra):
    """Forward (no grad) and forward + backward medians of call(*tensors)."""
    fwd = do_bench(lambda: call(*tensors), warmup=10, rep=100, return_mode="median")
    leaves = [t.detach().requires_grad_(True) for t in tensors]
    out = call(*leaves)
    do = torch.randn_like(out)

    def train():
        call(*leaves).backward(do)
        for t in leaves:
            t.grad = None

    train()
    fb = do_bench(train, warmup=5, rep=50, return_mode="median")
    record(stage=stage, variant=name, forward_ms=fwd, fwd_bwd_ms=fb, **extra)


def check(stage, call, q, k, v, idx, vbs, q_vbs=None):
    """o and dq/dk/dv of call(q, k, v) against the fp32 oracle (GQA and cross aware)."""
    o = call(q, k, v)
    ref, _ = attention_fp32(q, k, v, idx, vbs, layout="bshd", block=64)
    rows_real = None
    if q_vbs is not None:
        rows_real = (torch.arange(64, device="cuda")[None] < q_vbs[:, None]).reshape(-1)
    fwd = captures.score(o, ref)
    floor = captures.score(ref.to(q.dtype), ref)
    g = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(q.shape, device="cuda", generator=g).bfloat16()
    if rows_real is not None:
        do[:, ~rows_real] = 0
    else:
        real = (torch.arange(64, device="cuda")[None] < vbs[:, None]).reshape(-1)
        if real.numel() == q.shape[1]:
            do[:, ~real] = 0
    qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
    call(qr, kr, vr).backward(do)
    refs = attention_grads_fp32(q, k, v, idx, vbs, None, do, block=64, q_vbs=q_vbs)
    grads = {n: captures.grad_score(t.grad, r)
             for n, t, r in zip(("dq", "dk", "dv"), (qr, kr, vr), refs, strict=True)}
    record(stage=stage, variant="check", forward=str(fwd), forward_pass=fwd.passed,
           bf16_floor=str(floor), **{n: str(s) for n, s in grads.items()},
           grads_pass=all(s.passed for s in grads.values()))


def gqa_check():
    q, k, v, idx, vbs = inputs(tilegen.Spec(num_heads=10), seed=1, outlier=4)
    k2, v2 = k[:, :, ::5].contiguous(), v[:, :, ::5].contiguous()
    check("gqa", lambda a, b, c: block_sparse_attention(a, b, c, idx, vbs), q, k2, v2, idx, vbs)


def gqa_time():
    q, k, v, idx, vbs = inputs(tilegen.Spec())
    k8, v8 = k[:, :, ::5].contiguous(), v[:, :, ::5].contiguous()
    kr, vr = k8.repeat_interleave(5, dim=2), v8.repeat_interleave(5, dim=2)
    bsa = lambda a, b, c: block_sparse_attention(a, b, c, idx, vbs)  # noqa: E731
    timed("block_sparse_attention, H_kv=8 (g=5)", bsa, (q, k8, v8), "gqa")
    timed("repeated by the caller (default family)", bsa, (q, kr, vr), "gqa")
    from tilegen.backends.triton.backward import BackwardConfig

    triton = tilegen.load(tilegen.Spec(), backend="triton")
    triton.grad_forward_family = "triton"  # the Triton kernels alone, forward and backward
    triton.backward_config = BackwardConfig()
    gluon = tilegen.load(tilegen.Spec(), backend="gluon")
    timed("Triton kernels only, in place (separate_kv)",
          lambda a, b, c: triton(a, b, c, idx, vbs)[0], (q, k8, v8), "gqa")
    timed("Triton kernels only, repeated", lambda a, b, c: triton(a, b, c, idx, vbs)[0],
          (q, kr, vr), "gqa")
    fwd = do_bench(lambda: gluon(q, k8, v8, idx, vbs, return_lse=False), warmup=10, rep=100,
                   return_mode="median")
    record(stage="gqa", variant="Gluon op in place (separate_kv), forward", forward_ms=fwd,
           op=repr(gluon))
    o1 = triton(q, k8, v8, idx, vbs)[0]
    o2 = triton(q, kr, vr, idx, vbs)[0]
    record(stage="gqa", variant="Triton: in place == repeated", equal=bool(torch.equal(o1, o2)))
    o3 = gluon(q, k8, v8, idx, vbs)[0]
    o4 = gluon(q, kr, vr, idx, vbs)[0]
    record(stage="gqa", variant="Gluon: in place == repeated", equal=bool(torch.equal(o3, o4)),
           max_diff=(o3.float() - o4.float()).abs().max().item())
    # the gradients of the shipped path against the caller's repeat (autograd sums the group)
    do = torch.randn_like(q)
    got = [t.detach().requires_grad_(True) for t in (q, k8, v8)]
    bsa(*got).backward(do)
    rep = [t.detach().requires_grad_(True) for t in (q, k8, v8)]
    bsa(rep[0], rep[1].repeat_interleave(5, dim=2), rep[2].repeat_interleave(5, dim=2)).backward(do)
    record(stage="gqa", variant="grads: in place vs repeated (max |diff| / max |grad|)",
           **{n: ((a.grad.float() - b.grad.float()).abs().max()
                  / b.grad.float().abs().max()).item()
              for n, a, b in zip(("dq", "dk", "dv"), got, rep, strict=True)})


def cross():
    spec = tilegen.Spec()
    q, k, v, idx, vbs = inputs(spec)
    _, k2, v2, _, _ = inputs(spec, seed=3)
    nq = idx.shape[2]
    kk, vv = torch.cat((k2, k), 1), torch.cat((v2, v), 1)  # history cubes first
    vbs2 = torch.cat((vbs, vbs))
    # each row keeps half its cubes in the current frames and half in the history
    idx2 = torch.cat((idx[..., ::2], idx[..., 1::2] + nq), -1).sort(-1).values.contiguous()
    full = torch.full((nq,), 64, dtype=torch.int32, device="cuda")
    q_vbs = vbs
    bsa = lambda a, b, c: block_sparse_attention(a, b, c, idx2, vbs2, q_vbs=q_vbs)  # noqa: E731
    timed("cross, S_kv = 2 S_q", bsa, (q, kk, vv), "cross")
    # the padded call: q with zero rows to the KV length, rows past S_q pointing anywhere
    qp = torch.cat((q, torch.zeros_like(q)), 1)
    idxp = torch.cat((idx2, idx2), 2).contiguous()
    pad = lambda a, b, c: block_sparse_attention(a, b, c, idxp, vbs2)  # noqa: E731
    timed("q padded to S_kv (default family)", pad, (qp, kk, vv), "cross")
    triton = tilegen.load(spec, backend="triton")
    fwd = do_bench(lambda: triton(q, kk, vv, idx2, vbs2, q_vbs=q_vbs, return_lse=False),
                   warmup=10, rep=100, return_mode="median")
    record(stage="cross", variant="Triton op (separate_kv), forward", forward_ms=fwd)
    o1 = triton(q, kk, vv, idx2, vbs2, q_vbs=q_vbs)[0]
    o2 = block_sparse_attention(q, kk, vv, idx2, vbs2, q_vbs=q_vbs)
    ref, _ = attention_fp32(q, kk, vv, idx2, vbs2, layout="bshd", block=64)
    real = (torch.arange(64, device="cuda")[None] < vbs[:, None]).reshape(-1)
    record(stage="cross", variant="default vs Triton vs oracle (40 heads, real rows)",
           max_diff=(o1.float() - o2.float())[:, real].abs().max().item(),
           default=str(captures.score(o2[:, real].contiguous(), ref[:, real].contiguous())),
           triton=str(captures.score(o1[:, real].contiguous(), ref[:, real].contiguous())))
    del full
    q8, k8, v8, i8, b8 = inputs(tilegen.Spec(num_heads=8), seed=1, outlier=4)
    _, k8b, v8b, _, _ = inputs(tilegen.Spec(num_heads=8), seed=4)
    kk8, vv8 = torch.cat((k8b, k8), 1), torch.cat((v8b, v8), 1)
    i82 = torch.cat((i8[..., ::2], i8[..., 1::2] + nq), -1).sort(-1).values.contiguous()
    b82 = torch.cat((b8, b8))
    check("cross", lambda a, b, c: block_sparse_attention(a, b, c, i82, b82, q_vbs=b8),
          q8, kk8, vv8, i82, b82, q_vbs=b8)


def varlen():
    grids = [(21, 30, 52), (11, 30, 52), (5, 30, 52)]
    parts = [inputs(tilegen.Spec(grid=g, topk=max(1, round(
        tilegen.Spec(grid=g, topk=1).num_cubes * 0.125))), seed=i) for i, g in enumerate(grids)]
    width = max(p[3].shape[-1] for p in parts)
    counts, luts = [], []
    for p in parts:
        lut = p[3][0]
        c = lut.shape[-1]
        counts.append(torch.full(lut.shape[:2], c, dtype=torch.int32, device="cuda"))
        luts.append(torch.cat((lut, lut[..., :1].expand(-1, -1, width - c)), -1))
    q, k, v = (torch.cat([p[i][0] for p in parts], 0) for i in range(3))
    idx = torch.cat(luts, 1).contiguous()
    cnt = torch.cat(counts, 1).contiguous()
    vbs = torch.cat([p[4] for p in parts])
    sizes = [p[4].numel() for p in parts]
    cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")

    def packed(a, b, c):
        return block_sparse_attention_varlen(a, b, c, idx, vbs, cu, cu, cnt)

    def loop(a, b, c):
        outs = []
        for s, p in enumerate(parts):
            t0, t1 = int(cu[s]) * 64, int(cu[s + 1]) * 64
            outs.append(block_sparse_attention(a[None, t0:t1], b[None, t0:t1],
                                               c[None, t0:t1], p[3], p[4])[0])
        return torch.cat(outs, 0)

    timed("packed, 3 grids, one call", packed, (q, k, v), "varlen", tokens=q.shape[0])
    timed("loop over the 3 sequences", loop, (q, k, v), "varlen")
    record(stage="varlen", variant="packed == loop",
           equal=bool(torch.equal(packed(q, k, v), loop(q, k, v))),
           max_diff=(packed(q, k, v).float() - loop(q, k, v).float()).abs().max().item())


def vsa_list():
    """The full VSA over a list of grids (one packed fine launch) against a loop of
    video_sparse_attention calls, 40 heads, each grid at its default density."""
    from tilegen.ops import video_sparse_attention

    grids = [(21, 30, 52), (11, 30, 52), (5, 30, 52)]
    g = torch.Generator(device="cuda").manual_seed(0)
    n = sum(a * b * c for a, b, c in grids)
    q, k, v = (torch.randn(1, n, 40, 128, device="cuda", generator=g).bfloat16()
               for _ in range(3))

    def packed(a, b, c):
        return video_sparse_attention(a, b, c, grids)

    def loop(a, b, c):
        outs, at = [], 0
        for grid in grids:
            m = grid[0] * grid[1] * grid[2]
            outs.append(video_sparse_attention(a[:, at:at + m], b[:, at:at + m],
                                               c[:, at:at + m], grid))
            at += m
        return torch.cat(outs, 1)

    timed("video_sparse_attention, 3 grids packed", packed, (q, k, v), "vsa_list")
    timed("loop over the 3 grids", loop, (q, k, v), "vsa_list")
    a, b = packed(q, k, v), loop(q, k, v)
    record(stage="vsa_list", variant="packed vs loop", equal=bool(torch.equal(a, b)),
           max_diff=(a.float() - b.float()).abs().max().item())


def main():
    only = os.environ.get("STAGES")
    stages = [("gqa check", gqa_check), ("gqa time", gqa_time), ("cross", cross),
              ("varlen", varlen), ("vsa", vsa_list)]
    for name, fn in stages:
        if only and not any(name.startswith(o) for o in only.split(",")):
            continue
        try:
            fn()
        except Exception:
            record(stage=name, error=traceback.format_exc()[-2500:])
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "h200_s11_kv.json"), "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                   "rows": rows}, f, indent=1, default=str)
    print("| stage | variant | forward ms | fwd+bwd ms | result |")
    print("|---|---|---|---|---|")
    for r in rows:
        res = r.get("error", "")[-300:] or (
            f"fwd {r['forward']} (floor {r['bf16_floor']}) dq {r['dq']} dk {r['dk']} "
            f"dv {r['dv']}" if r.get("variant") == "check" else r.get("equal", r.get("op", "")))
        print(f"| {r['stage']} | {r.get('variant', '')} | {r.get('forward_ms', '')} | "
              f"{r.get('fwd_bwd_ms', '')} | {res} |")


if __name__ == "__main__":
    main()
