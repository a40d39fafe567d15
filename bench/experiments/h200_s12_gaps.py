"""Question: where do the two calls of issue #21 that lose their comparison spend the time?

1. GQA (40 query heads over 8 KV heads), forward + backward: `block_sparse_attention` in place
   against the caller's repeat, timed two ways: the repeat inside the timed call (k8, v8 the
   leaves, so the repeat and its backward sum count, as a user's model pays them) and the
   tensors repeated once outside it (the kernel on 40 KV heads alone). The variants run
   interleaved (A B C A B C ...) so a drift of the GPU's clock reaches all of them.
2. VSA over a list of three grids against a loop of three calls, forward + backward.
3. large: 256- and 384-token cubes (and the 64-token default beside them) on the 40-head default
   capture, whose outputs are small enough for the rule's absolute bounds: o of the loaded op
   against the fp32 oracle, beside the oracle rounded once to bf16 (the floor).
4. step: the default training step (`block_sparse_attention` + backward) profiled, to see what
   runs outside the kernels.

Each variant's step is also profiled (torch.profiler, 5 steps): the CUDA kernels by total time,
so the two sides of each comparison can be set beside each other. Table last; JSON in
$OUT/h200_s12_gaps.json.

    PYTHONPATH=. [STAGES=gqa,vsa] python bench/experiments/h200_s12_gaps.py
"""

from __future__ import annotations

import json
import os
import traceback
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import tilegen
from tilegen import captures
from tilegen.ops import block_sparse_attention, video_sparse_attention

OUT = os.environ.get("OUT", ".")
rows: list[dict] = []


def record(**kw):
    rows.append(kw)
    print({k: v for k, v in kw.items() if k != "kernels"}, flush=True)


def train_step(call, leaves, do):
    def step():
        call(*leaves).backward(do)
        for t in leaves:
            t.grad = None
    return step


def kernels_of(step, n=5):
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    tot: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name[:90]] += e.device_time_total / 1e3 / n
    top = sorted(tot.items(), key=lambda kv: -kv[1])[:18]
    return {"sum_ms": sum(tot.values()), "top": top}


def interleaved(variants, rounds=4):
    """{name: [median ms per round]} of each (name, step), rounds interleaved."""
    out = {name: [] for name, _ in variants}
    for _ in range(rounds):
        for name, step in variants:
            out[name].append(do_bench(step, warmup=3, rep=60, return_mode="median"))
    return out


def gqa():
    cap = captures.synthesize_for(tilegen.Spec(), seed=0, device="cuda", outlier=True)
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    k8, v8 = k[:, :, ::5].contiguous(), v[:, :, ::5].contiguous()
    kr, vr = k8.repeat_interleave(5, dim=2), v8.repeat_interleave(5, dim=2)
    do = torch.randn_like(q)

    def bsa(a, b, c):
        return block_sparse_attention(a, b, c, idx, vbs)

    def repeat_in_call(a, b, c):
        return bsa(a, b.repeat_interleave(5, dim=2), c.repeat_interleave(5, dim=2))

    leaf = lambda *ts: [t.detach().requires_grad_(True) for t in ts]  # noqa: E731
    fwd = [("in place", lambda: bsa(q, k8, v8)),
           ("repeat in the call", lambda: repeat_in_call(q, k8, v8)),
           ("pre-repeated (kernel on 40 KV heads)", lambda: bsa(q, kr, vr))]
    steps = [("in place", train_step(bsa, leaf(q, k8, v8), do)),
             ("repeat in the call", train_step(repeat_in_call, leaf(q, k8, v8), do)),
             ("pre-repeated (kernel on 40 KV heads)", train_step(bsa, leaf(q, kr, vr), do))]
    with torch.no_grad():
        f = interleaved(fwd)
    for _, s in steps:
        s()
    fb = interleaved(steps)
    for name, step in steps:
        record(stage="gqa", variant=name, forward_ms=min(f[name]), fwd_bwd_ms=min(fb[name]),
               forward_rounds=f[name], fwd_bwd_rounds=fb[name], kernels=kernels_of(step))
    got, rep = leaf(q, k8, v8), leaf(q, k8, v8)
    bsa(*got).backward(do)
    repeat_in_call(*rep).backward(do)
    record(stage="gqa", variant="grads: in place vs repeat in the call (max |diff|)",
           **{n: (a.grad.float() - b.grad.float()).abs().max().item()
              for n, a, b in zip(("dq", "dk", "dv"), got, rep, strict=True)})


def vsa():
    grids = [(21, 30, 52), (11, 30, 52), (5, 30, 52)]
    g = torch.Generator(device="cuda").manual_seed(0)
    n = sum(a * b * c for a, b, c in grids)
    q, k, v = (torch.randn(1, n, 40, 128, device="cuda", generator=g).bfloat16()
               for _ in range(3))
    do = torch.randn_like(q)

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

    leaf = lambda: [t.detach().requires_grad_(True) for t in (q, k, v)]  # noqa: E731
    steps = [("list of grids", train_step(packed, leaf(), do)),
             ("loop of 3 calls", train_step(loop, leaf(), do))]
    with torch.no_grad():
        f = interleaved([("list of grids", lambda: packed(q, k, v)),
                         ("loop of 3 calls", lambda: loop(q, k, v))], rounds=3)
    for _, s in steps:
        s()
    fb = interleaved(steps, rounds=3)
    for name, step in steps:
        record(stage="vsa", variant=name, forward_ms=min(f[name]), fwd_bwd_ms=min(fb[name]),
               forward_rounds=f[name], fwd_bwd_rounds=fb[name], kernels=kernels_of(step))
    with torch.no_grad():
        a, b = packed(q, k, v), loop(q, k, v)
    record(stage="vsa", variant="forward: list == loop", equal=bool(torch.equal(a, b)),
           max_diff=(a.float() - b.float()).abs().max().item())
    got, rep = leaf(), leaf()
    packed(*got).backward(do)
    loop(*rep).backward(do)
    record(stage="vsa", variant="grads: list vs loop (max |diff| / max |grad|)",
           **{n: ((x.grad.float() - y.grad.float()).abs().max()
                  / y.grad.float().abs().max()).item()
              for n, x, y in zip(("dq", "dk", "dv"), got, rep, strict=True)})


def large():
    import math

    from tilegen.reference import attention_fp32

    base = tilegen.Spec()
    for cube in ((4, 4, 4), (4, 8, 8), (6, 8, 8)):
        vol = math.prod(cube)
        probe = tilegen.Spec(block_q=vol, block_kv=vol, cube=cube, grid=base.grid, topk=1)
        spec = probe.replace(topk=max(1, round(probe.num_cubes * base.topk / base.num_cubes)))
        if cube == (4, 4, 4):
            spec = base
        cap = captures.synthesize_for(spec, seed=2, device="cuda", outlier=True)
        q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
        op = tilegen.load(spec)
        o, _ = op(q, k, v, idx, vbs)
        ref, _ = attention_fp32(q, k, v, idx, vbs, layout="bshd", block=spec.block_kv)
        fwd = captures.score(o, ref)
        floor = captures.score(ref.to(q.dtype), ref)
        record(stage="large", variant=f"cube {cube}, topk {spec.topk}, 40 heads", op=repr(op),
               forward=str(fwd), forward_pass=fwd.passed, bf16_floor=str(floor),
               floor_pass=floor.passed, mean_abs_ref=ref.abs().mean().item())
        del q, k, v, ref, o, cap
        torch.cuda.empty_cache()


def step():
    cap = captures.synthesize_for(tilegen.Spec(), seed=0, device="cuda", outlier=True)
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    do = torch.randn_like(q)
    s = train_step(lambda a, b, c: block_sparse_attention(a, b, c, idx, vbs),
                   [t.detach().requires_grad_(True) for t in (q, k, v)], do)
    s()
    t = interleaved([("default step", s)], rounds=3)
    record(stage="step", variant="default step", fwd_bwd_ms=min(t["default step"]),
           fwd_bwd_rounds=t["default step"], kernels=kernels_of(s))


def main():
    only = os.environ.get("STAGES")
    for name, fn in (("gqa", gqa), ("vsa", vsa), ("large", large), ("step", step)):
        if only and name not in only.split(","):
            continue
        try:
            fn()
        except Exception:
            record(stage=name, error=traceback.format_exc()[-2500:])
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "h200_s12_gaps.json"), "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                   "rows": rows}, f, indent=1, default=str)
    for r in rows:
        if "kernels" in r:
            print(f"\n## {r['stage']}: {r['variant']}: kernels {r['kernels']['sum_ms']:.3f} ms "
                  "per step")
            for name, ms in r["kernels"]["top"]:
                print(f"  {ms:8.3f}  {name}")
    print("\n| stage | variant | forward ms (min of rounds) | fwd+bwd ms | rounds |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {r.get('variant', '')} | {r.get('forward_ms', '')} | "
              f"{r.get('fwd_bwd_ms', '')} | "
              f"{r.get('fwd_bwd_rounds', r.get('forward', r.get('error', '')))} |")
        if "bf16_floor" in r:
            print(f"|   | floor | | | {r['bf16_floor']} (mean |o_ref| {r['mean_abs_ref']:.4f}) |")


if __name__ == "__main__":
    main()
