"""GPU harness for the warp-specialized Gluon kernel (issue #8): correctness + timing, one call.

    PYTHONUNBUFFERED=1 python3 bench/gluon_bench.py --out $OUT \
        --variants '[{"num_consumers": 1, "consumer_regs": 232}, ...]'

Parent process: synthesizes the captures on the GPU (seeds), runs the reference Triton variant
(REFERENCE_CONFIG) for o_ref, an fp32 reference on a few heads (the outlier head included), and
times the reference (start and end of the run). Each Gluon variant runs in its own subprocess
with a timeout (a Gluon layout assertion aborts the process, a pipeline bug deadlocks): small
random tests first (counts, empty rows, partial cubes, a bad index / vbs / count that must give a
NaN row and the error flag), then each capture with a NaN-poisoned output, scored by
tilegen.captures.score against the reference variant and against fp32 on the chosen heads, then
timed with triton.testing.do_bench (median): the whole op (pre-pass + kernel), the kernel alone
and the pre-pass alone. Logs and JSON go under --out; a compact table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
WORK = "/tmp/gluon_bench"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- references


def fp32_heads(q, k, v, idx, vbs, heads):
    """fp32 reference restricted to `heads` (o in (B, S, len(heads), D))."""
    from tilegen.reference import attention_fp32

    sel = list(heads)
    o, _ = attention_fp32(q[:, :, sel].contiguous(), k[:, :, sel].contiguous(),
                          v[:, :, sel].contiguous(), idx[:, sel].contiguous(), vbs)
    return o


def head_stats(o, ref):
    """min per-head cosine, max|d|, mean|d| of o vs ref (B, S, h, D)."""
    import torch

    a, b = o.float(), ref.float()
    cos = torch.nn.functional.cosine_similarity(a.permute(0, 2, 1, 3).flatten(2),
                                                b.permute(0, 2, 1, 3).flatten(2), dim=2)
    d = (a - b).abs()
    return {"min_cos": float(cos.min()), "max_abs": float(d.max()), "mean_abs": float(d.mean()),
            "finite": bool(torch.isfinite(a).all())}


def torch_small_ref(q, k, v, idx, vbs, counts, scale):
    import torch

    B, S, H, D = q.shape
    o = torch.zeros(B, S, H, D, device=q.device, dtype=torch.float32)
    lse = torch.full((B, H, S), float("-inf"), device=q.device)
    for b in range(B):
        for h in range(H):
            for qc in range(S // 64):
                n = idx.shape[3] if counts is None else int(counts[b, h, qc])
                if n == 0:
                    continue
                cubes = idx[b, h, qc, :n].tolist()
                K = torch.cat([k[b, c * 64:c * 64 + int(vbs[c]), h] for c in cubes]).float()
                V = torch.cat([v[b, c * 64:c * 64 + int(vbs[c]), h] for c in cubes]).float()
                s = q[b, qc * 64:(qc + 1) * 64, h].float() @ K.T * scale
                o[b, qc * 64:(qc + 1) * 64, h] = torch.softmax(s, -1) @ V
                lse[b, h, qc * 64:(qc + 1) * 64] = torch.logsumexp(s, -1) * 1.4426950408889634
    return o, lse


# ----------------------------------------------------------------------------- child


def child(cfg: dict, args) -> dict:
    import torch
    import triton

    from tilegen import captures
    from tilegen.backends.gluon.launch import GluonLaunch
    from tilegen.backends.gluon.prepass import run_prepass

    res: dict = {"cfg": cfg}
    t0 = time.time()
    run = GluonLaunch(None, cfg)
    res["variant"] = __import__("tilegen.backends.gluon.render", fromlist=["x"]).variant_name(cfg)
    dev = "cuda"

    # --- small tests
    g = torch.Generator(device="cpu").manual_seed(1)
    B, H, NQ, D, TOPK = 2, 3, 12, 128, 7
    S = NQ * 64
    q, k, v = (torch.randn(B, S, H, D, generator=g).to(dev, torch.bfloat16) for _ in range(3))
    vbs = torch.tensor([[64, 32, 16, 8][i % 4] for i in torch.randperm(NQ, generator=g).tolist()],
                       dtype=torch.int32, device=dev)
    idx = torch.stack([torch.randperm(NQ, generator=g)[:TOPK] for _ in range(B * H * NQ)]).view(
        B, H, NQ, TOPK).int().to(dev)
    counts = torch.randint(0, TOPK + 1, (B, H, NQ), generator=g, dtype=torch.int32).to(dev)
    scale = D ** -0.5
    small = []
    for cn in (None, counts):
        want_lse = bool(cfg.get("store_lse", False))
        o = torch.full_like(q, float("nan"))
        o, lse = run(q, k, v, idx, vbs, counts=cn, out=o)
        torch.cuda.synchronize()
        ro, rl = torch_small_ref(q, k, v, idx, vbs, cn, scale)
        # every row, padded query rows included (they are computed like the reference does)
        st = head_stats(o, ro)
        if want_lse and lse is not None:
            fin = torch.isfinite(rl)
            st["lse_max_abs"] = float((lse[fin] - rl[fin]).abs().max()) if fin.any() else 0.0
            st["lse_empty_ok"] = bool(torch.isneginf(lse[~fin]).all())
        st["err_flag"] = int(run.error_flag.item())
        small.append(st)
    # bad values: one out-of-range index -> that row NaN, flag 1, other rows fine
    bad_idx = idx.clone()
    bad_idx[1, 2, 5, 3] = NQ + 100
    o = torch.full_like(q, float("nan"))
    run.error_flag.zero_() if run.error_flag is not None else None
    o, _ = run(q, k, v, bad_idx, vbs, out=o)
    torch.cuda.synchronize()
    row_nan = bool(torch.isnan(o[1, 5 * 64:5 * 64 + int(vbs[5]), 2]).all())
    others = o.clone()
    others[1, 5 * 64:6 * 64, 2] = 0
    ro, _ = torch_small_ref(q, k, v, idx, vbs, None, scale)
    ro[1, 5 * 64:6 * 64, 2] = 0
    bad_st = head_stats(others, ro)
    bad_st.update(row_nan=row_nan, err_flag=int(run.error_flag.item()))
    run.error_flag.zero_()
    small.append(bad_st)
    res["small"] = small
    res["small_ok"] = bool(cfg.get("debug")) or all(s["finite"] and s["min_cos"] > 0.9999 and s["max_abs"] < 3e-2
                          for s in small[:2]) and bad_st["row_nan"] and bad_st["err_flag"] == 1 \
        and bad_st["finite"] and bad_st["max_abs"] < 3e-2
    log(f"{res['variant']}: small tests {'ok' if res['small_ok'] else 'FAILED'} "
        f"({time.time() - t0:.1f}s): {json.dumps(small)}")
    del q, k, v

    # --- full captures
    caps = []
    for s in args.seeds:
        cap = torch.load(f"{WORK}/cap{s}.pt", weights_only=True)
        caps.append(cap)
    res["captures"] = []
    for cap in (caps if not cfg.get("debug") else []):
        q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
        o = torch.full_like(q, float("nan"))
        o, _ = run(q, k, v, idx, vbs, out=o)
        torch.cuda.synchronize()
        sc = captures.score(o, cap["o_ref"])
        heads = cap["heads"]
        h32 = head_stats(o[:, :, heads], cap["o32"])
        r32 = cap["ref_vs_fp32"]
        res["captures"].append({
            "seed": cap["seed"], "passed": sc.passed, "finite": sc.finite,
            "min_head_cos": sc.min_head_cos, "max_abs": sc.max_abs, "mean_abs": sc.mean_abs,
            "fp32_heads": heads, "vs_fp32": h32, "ref_vs_fp32": r32,
            "err_flag": int(run.error_flag.item()),
        })
        log(f"{res['variant']}: seed {cap['seed']}: {sc}; vs fp32 heads {heads}: {h32}")
    # --- timing on capture 0
    cap = caps[0]
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    o = torch.empty_like(q)
    op = lambda: run(q, k, v, idx, vbs, out=o)  # noqa: E731
    res["ms_op"] = triton.testing.do_bench(op, warmup=200, rep=1500, return_mode="median")
    rows = idx.shape[0] * idx.shape[1] * idx.shape[2]
    bufs = run._buffers(q.device, rows, idx.shape[3])
    pre = lambda: run_prepass(idx, vbs, None, bufs, rows, vbs.shape[0], idx.shape[3],  # noqa: E731
                              pack=run.cfg["pack_partials"])
    res["ms_prepass"] = triton.testing.do_bench(pre, warmup=50, rep=300, return_mode="median")
    res["ms_kernel_est"] = res["ms_op"] - res["ms_prepass"]
    meta = bufs["meta"][:, 0].float()
    res["mean_tiles"] = float(meta.mean())
    res["op_ms_again"] = triton.testing.do_bench(op, warmup=50, rep=800, return_mode="median")
    log(f"{res['variant']}: op {res['ms_op']:.3f} ms (again {res['op_ms_again']:.3f}), "
        f"prepass {res['ms_prepass']:.4f} ms, mean tiles/row {res['mean_tiles']:.2f}")
    return res


# ----------------------------------------------------------------------------- parent


def parent(args) -> None:
    import torch
    import triton

    import tilegen
    from tilegen import captures
    from tilegen.config import REFERENCE_CONFIG

    os.makedirs(WORK, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    ref_op = tilegen.load(tilegen.Spec(), REFERENCE_CONFIG)
    summary: dict = {"variants": [], "reference": {}}
    for s in args.seeds:
        t0 = time.time()
        cap = captures.synthesize(seed=s, device="cuda")
        t1 = time.time()
        q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
        o_ref, _ = ref_op.launch(q, k, v, idx, vbs, store_lse=True)
        torch.cuda.synchronize()
        outl = list(cap.get("outlier_heads") or [])
        heads = sorted(set(outl + [0, 17, 39]))[:4]
        o32 = fp32_heads(q, k, v, idx, vbs, heads)
        r32 = head_stats(o_ref[:, :, heads], o32)
        log(f"seed {s}: synth {t1 - t0:.1f}s, outlier heads {outl}; reference vs fp32 on {heads}: {r32}")
        torch.save({"q": q, "k": k, "v": v, "topk_idx": idx, "vbs": vbs, "o_ref": o_ref,
                    "o32": o32, "heads": heads, "seed": s, "ref_vs_fp32": r32},
                   f"{WORK}/cap{s}.pt")
        summary["reference"][f"seed{s}_vs_fp32"] = r32
        if s == args.seeds[0]:
            vb = vbs.long()
            real_keys = vb[idx.long()].sum().item()
            summary["work"] = {"tflop_padded": 4 * 64 * 64 * 128 * idx.numel() / 1e12,
                               "tflop_real": 4 * 64 * 128 * real_keys / 1e12}
            fn = lambda: ref_op.launch(q, k, v, idx, vbs, store_lse=True)  # noqa: E731
            summary["reference"]["ms_start"] = triton.testing.do_bench(fn, warmup=200, rep=1500,
                                                                       return_mode="median")
            log(f"reference variant (bare launch, lse stored): {summary['reference']['ms_start']:.3f} ms")
        del cap, q, k, v, o_ref, o32
        torch.cuda.empty_cache()
    variants = json.loads(args.variants)
    for i, cfg in enumerate(variants):
        path = os.path.join(args.out, f"v{i}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg), "--result", path,
               "--seeds", *map(str, args.seeds)]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
            out = p.stdout + p.stderr
            rc = p.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            out += "\nTIMEOUT"
            rc = "timeout"
        with open(os.path.join(args.out, "children.log"), "a") as f:
            f.write(f"===== variant {i} {cfg} rc={rc} {time.time() - t0:.1f}s\n{out}\n")
        print(out[-3000:] if rc != 0 else "\n".join(out.splitlines()[-6:]), flush=True)
        if os.path.exists(path):
            summary["variants"].append(json.load(open(path)))
        else:
            summary["variants"].append({"cfg": cfg, "error": f"rc={rc}", "tail": out[-1500:]})
    cap = torch.load(f"{WORK}/cap{args.seeds[0]}.pt", weights_only=True)
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    fn = lambda: ref_op.launch(q, k, v, idx, vbs, store_lse=True)  # noqa: E731
    summary["reference"]["ms_end"] = triton.testing.do_bench(fn, warmup=100, rep=1500,
                                                             return_mode="median")
    json.dump(summary, open(os.path.join(args.out, "summary.json"), "w"), indent=1)
    ref_ms = min(summary["reference"]["ms_start"], summary["reference"]["ms_end"])
    print("\n=== Gluon variants (H200, default workload; ms = median, op = pre-pass + kernel)")
    print(f"reference variant bm64_bn64_w4_s3: start {summary['reference']['ms_start']:.3f} ms, "
          f"end {summary['reference']['ms_end']:.3f} ms")
    print(f"{'variant':42s} {'op ms':>7s} {'again':>7s} {'pre ms':>7s} {'x ref':>6s} {'TF/s':>6s} "
          f"{'small':>5s} {'pass':>9s} {'min cos':>9s} {'max|d|':>8s} {'mean|d|':>8s} {'fp32 cos':>9s}")
    for r in summary["variants"]:
        if "error" in r or "ms_op" not in r:
            print(f"{json.dumps(r.get('cfg'))[:42]:42s} ERROR {r.get('error')} {r.get('tail', '')[-300:]!r}")
            continue
        caps_ = r["captures"] or [{"passed": False, "min_head_cos": float("nan"), "max_abs": float("nan"),
                                   "mean_abs": float("nan"), "vs_fp32": {"min_cos": float("nan")}}]
        print(f"{r['variant']:42s} {r['ms_op']:7.3f} {r['op_ms_again']:7.3f} {r['ms_prepass']:7.4f} "
              f"{ref_ms / r['ms_op']:6.3f} {summary['work']['tflop_real'] / r['ms_op'] * 1e3:6.0f} "
              f"{str(r['small_ok']):>5s} {','.join('P' if c['passed'] else 'F' for c in caps_):>9s} "
              f"{min(c['min_head_cos'] for c in caps_):9.6f} {max(c['max_abs'] for c in caps_):8.2e} "
              f"{max(c['mean_abs'] for c in caps_):8.2e} {min(c['vs_fp32']['min_cos'] for c in caps_):9.6f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gluon_out"))
    ap.add_argument("--variants", default='[{"num_consumers": 1, "consumer_regs": 232}]')
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--timeout", type=float, default=150)
    ap.add_argument("--child", default=None)
    ap.add_argument("--result", default=None)
    args = ap.parse_args()
    if args.child is not None:
        try:
            res = child(json.loads(args.child), args)
        except Exception:  # noqa: BLE001
            res = {"cfg": json.loads(args.child), "error": traceback.format_exc()[-3000:]}
            print(res["error"], flush=True)
        json.dump(res, open(args.result, "w"), indent=1)
        return
    parent(args)


if __name__ == "__main__":
    main()
