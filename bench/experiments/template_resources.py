"""Question: do the Triton and Gluon templates compile to the same machine code after a template
change? (issue #24, item 1: the knobs move from Jinja to constexpr parameters)

For every target (sm_90, sm_100a, gfx942) and every Triton and Gluon variant the project
renders, compile it ahead of time with tilegen's own backends (no GPU) and write a JSON table of
each kernel's registers, spills, shared memory, matrix instructions and a hash of its machine
code (the SASS from cuobjdump; the AMDGCN instruction lines without debug info), so that two
checkouts can be compared:

    export PYTHONHASHSEED=0  # Triton's sm_100a code generation depends on it (see below)
    PYTHONPATH=/tmp/base TILEGEN_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) \
        python3 bench/experiments/template_resources.py --out base.json
    TILEGEN_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) \
        python3 bench/experiments/template_resources.py --out new.json
    python3 bench/experiments/template_resources.py --diff base.json new.json [--markdown]

The variants: each target's default configs, the shipped winners (tuning_db/winners.json), the
Triton forward and backward kernels, each kernel encoding (lut, sliding_tile; mask runs the LUT
kernel), the spec traits the templates branch on (vbs off, BHSD, head_dim 64 / fp16), lse and
max_prob on/off, share_kv, the timing experiments (debug), and every option value of the
[tunable.*] spaces of targets/*/target.toml (the boolean Gluon knobs as a product, ring depths
and launch parameters one at a time from the default).

The machine code of some sm_100a kernels (and of two-consumer Gluon CTAs) is not a function of
the source alone: the same checkout gives one of two SASS listings (register names differ)
depending on the process's PYTHONHASHSEED. Compare runs with one fixed seed, and a remaining
code-only difference against the codes other seeds give.

``--gpu`` runs the sm_90 variants on this machine's GPU instead: each forward against the
reference variant (the contract's scoring rule), each backward against the fp32 reference.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path


def sass_hash(path: Path) -> str | None:
    """sha256 of the machine code: the SASS of a cubin, or the AMDGCN instruction lines (the
    listing beside a hsaco) without debug info, locations and comments."""
    if path.suffix == ".cubin":
        from tilegen.cubin import _bundled

        out = subprocess.run([str(_bundled("cuobjdump")), "--dump-sass", str(path)],
                             capture_output=True, text=True)
        if out.returncode:
            return None
        return hashlib.sha256(out.stdout.encode()).hexdigest()[:16]
    listing = path.with_suffix(".amdgcn")
    if not listing.exists():
        return None
    keep = []
    in_text = True
    for line in listing.read_text().splitlines():
        s = line.strip()
        if s.startswith(".section"):
            in_text = not s.split()[1].startswith((".debug", ".AMDGPU", ".note", ".rodata"))
            continue
        if s.startswith(".amdgpu_metadata") or s.startswith(".end_amdgpu_metadata"):
            in_text = s.startswith(".end")
            continue
        if not in_text or not s or s.startswith((".loc", ".file", ";", ".Ltmp", ".Lfunc_begin",
                                                 ".cfi", ".Ldebug", ".Linfo")):
            continue
        keep.append(s.split(";")[0].rstrip())
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------- the variants
def _winners():
    from tilegen.config import KernelConfig
    from tilegen.paths import ROOT
    from tilegen.spec import Spec

    data = json.loads((ROOT / "tuning_db" / "winners.json").read_text())
    specs = {w["spec_hash"]: Spec.from_dict(w["spec"]) for w in data["workloads"]}
    out = []
    for w in data["winners"]:
        v = w["variant"]
        cand = next(c for c in data["candidates"] if c["variant"] == v)
        out.append((v["target"], v["backend"], specs[w["spec_hash"]],
                    KernelConfig.from_dict(cand["config"]), v))
    return out


def variants(targets):
    """(label, target, family, spec, KernelConfig, BackwardConfig | None) for every variant."""
    from tilegen import backends as registry
    from tilegen.backends.triton.backward import BackwardConfig
    from tilegen.spec import Spec
    from tilegen.targets import get_target

    lut, st = Spec(), Spec(encoding="sliding_tile")
    trait_specs = {"lut": lut, "sliding_tile": st, "mask": Spec(encoding="mask"),
                   "lut_full": Spec(variable_block_sizes=False), "lut_bhsd": Spec(layout="bhsd"),
                   "lut_d64_fp16": Spec(head_dim=64, dtype="fp16"),
                   "st_full": Spec(encoding="sliding_tile", variable_block_sizes=False)}
    out = []
    seen: dict[tuple, int] = {}

    def add(label, tname, family, spec, cfg, bwd=None):
        key = (tname, family, spec.kernel_hash, cfg.name, bwd.name if bwd else "")
        if key in seen:  # the same kernel under another name: keep one, both labels
            i = seen[key]
            if label.startswith("winner"):
                out[i] = (f"{out[i][0]} ({label})",) + out[i][1:]
            return
        seen[key] = len(out)
        out.append((label, tname, family, spec, cfg, bwd))

    for tname in targets:
        target = get_target(tname)
        tun = tomllib.loads((target.generated_dir.parent / "target.toml").read_text()
                            ).get("tunable", {})
        launch_dims = {k: v for k, v in tun.items() if not isinstance(v, dict)}
        # -- Triton forward
        tri = registry.get("triton")
        base = tri.default_config(lut, target)
        for sname, spec in trait_specs.items():
            cfg0 = tri.default_config(spec, target)
            for extra, cfg in (("", cfg0), ("nolse", cfg0.replace(store_lse=False)),
                               ("maxprob", cfg0.replace(store_max_prob=True)),
                               ("nolse_maxprob", cfg0.replace(store_lse=False,
                                                              store_max_prob=True))):
                if not tri.violations(spec, target, cfg):
                    add(f"fwd {sname} {extra}".strip(), tname, "triton", spec, cfg)
        for dim, values in launch_dims.items():
            for val in values:
                cfg = base.replace(**{dim: val})
                for sname in ("lut", "sliding_tile"):
                    spec = trait_specs[sname]
                    if not tri.violations(spec, target, cfg):
                        add(f"fwd {sname} {dim}={val}", tname, "triton", spec, cfg)
                        if dim == "block_m" and val < spec.block_q:  # atomic cube mean
                            add(f"fwd {sname} {dim}={val} maxprob", tname, "triton", spec,
                                cfg.replace(store_max_prob=True))
        # -- Triton backward
        bdef = BackwardConfig.default_for(target)
        bdims = tun.get("triton_bwd", {})
        for sname in ("lut", "sliding_tile", "lut_full", "lut_bhsd", "lut_d64_fp16", "st_full"):
            spec = trait_specs[sname]
            add(f"bwd {sname}", tname, "triton_bwd", spec, base, bdef.fit(spec))
        import dataclasses

        bcands = [("dq_atomic", dataclasses.replace(bdef, dq_atomic=True))]
        for dim, values in bdims.items():
            for val in values:
                bcands.append((f"{dim}={val}", dataclasses.replace(bdef, **{dim: val})))
        for dqp, dkp in itertools.product((False, True), repeat=2):
            bcands.append((f"dq_pack={int(dqp)} dkdv_pack={int(dkp)}",
                           dataclasses.replace(bdef, dq_pack=dqp, dkdv_pack=dkp)))
            bcands.append((f"dq_pack={int(dqp)} dkdv_pack={int(dkp)} dq_atomic",
                           dataclasses.replace(bdef, dq_pack=dqp, dkdv_pack=dkp,
                                               dq_atomic=True)))
        for label, b in bcands:
            for sname in ("lut", "sliding_tile"):
                spec = trait_specs[sname]
                b2 = b.fit(spec)
                if not b2.violations(spec):
                    add(f"bwd {sname} {label}", tname, "triton_bwd", spec, base, b2)
        # -- Gluon
        if "gluon" in target.backends:
            glu = registry.get("gluon")
            g0 = glu.default_config(lut, target)
            gdims = tun.get("gluon", {})

            def gadd(label, spec, cfg, glu=glu, target=target, tname=tname):
                if not glu.spec_violations(spec, target) and not glu.violations(spec, target,
                                                                                  cfg):
                    add(label, tname, "gluon", spec, cfg)

            opts0 = dict(g0.options)
            bool_dims = [d for d, v in gdims.items() if set(v) == {True, False}
                         and d != "share_kv"]
            other = {d: v for d, v in gdims.items() if d not in bool_dims and d != "share_kv"}
            for sname in ("lut", "sliding_tile", "lut_d64_fp16", "mask"):
                spec = trait_specs[sname]
                c0 = glu.default_config(spec, target)
                for extra, cfg in (("", c0), ("nolse", c0.replace(store_lse=False)),
                                   ("maxprob", c0.replace(store_max_prob=True)),
                                   ("nolse_maxprob", c0.replace(store_lse=False,
                                                                store_max_prob=True))):
                    gadd(f"gluon {sname} {extra}".strip(), spec, cfg)
            # the product of the boolean knobs x num_consumers, then the ring depths one at a time
            for vals in itertools.product(*[gdims[d] for d in bool_dims]):
                for nc in other.get("num_consumers", [1]):
                    opts = {**opts0, **dict(zip(bool_dims, vals, strict=True)),
                            "num_consumers": nc}
                    label = " ".join(f"{d}={int(v)}" for d, v in zip(bool_dims, vals,
                                                                     strict=True))
                    for sname in ("lut", "sliding_tile"):
                        gadd(f"gluon {sname} nc={nc} {label}", trait_specs[sname],
                             g0.replace(options=opts))
            for dim, values in other.items():
                for val in values:
                    for nc in (1, 2):
                        opts = {**opts0, dim: val, "num_consumers": nc if dim != "num_consumers"
                                else val}
                        gadd(f"gluon lut nc={opts['num_consumers']} {dim}={val}", lut,
                             g0.replace(options=opts))
            for k, v in itertools.product(gdims.get("k_stages", [2]), gdims.get("v_stages", [2])):
                gadd(f"gluon lut k_stages={k} v_stages={v}", lut,
                     g0.replace(options={**opts0, "k_stages": k, "v_stages": v}))
            if "share_kv" in gdims:
                for pack, fence, k, v in itertools.product((True, False), (True, False),
                                                           gdims.get("k_stages", [2]),
                                                           gdims.get("v_stages", [2])):
                    opts = {**opts0, "share_kv": True, "num_consumers": 2, "q_in_regs": True,
                            "qk_ahead": True, "pack_partials": pack, "fence_wait": fence,
                            "k_stages": k, "v_stages": v}
                    gadd(f"gluon lut share_kv pack={int(pack)} fence={int(fence)} k={k} v={v}",
                         lut, g0.replace(options=opts))
                sk = g0.replace(options={**opts0, "share_kv": True, "num_consumers": 2})
                for extra, cfg in (("nolse", sk.replace(store_lse=False)),
                                   ("maxprob", sk.replace(store_max_prob=True))):
                    gadd(f"gluon lut share_kv {extra}", lut, cfg)
            for dbg in ("no_loads", "no_mma"):
                gadd(f"gluon lut debug={dbg}", lut, g0.replace(options={**opts0, "debug": dbg}))
            for nc in (2, 3):
                gadd(f"gluon lut nc={nc} k1 v2 nopack", lut, g0.replace(options={
                    **opts0, "num_consumers": nc, "k_stages": 1, "v_stages": 2,
                    "pack_partials": False}))
    # -- the shipped winners
    for tname, family, spec, cfg, _ in _winners():
        if tname in targets:
            add(f"winner {spec.encoding}", tname, family, spec, cfg)
    return out


# ------------------------------------------------------------------------------- compile
def _compile_max_prob(spec, cfg, target, src, out_dir):
    """The Triton forward with the max_prob epilogue, for a checkout whose AOT compile does not
    take it (its two fp32 pointers follow ERR, as in lut_kernel.py.j2)."""
    from tilegen.backends.triton import aot

    sig = aot.signature(spec)
    items = list(sig.items())
    at = [k for k, _ in items].index("ERR") + 1
    sig = dict(items[:at] + [("MAX_PROB", "*fp32"), ("MAX_PROB_CUBE", "*fp32")] + items[at:])
    consts = {**aot.cursor_signature(spec)[2], "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}
    n_ptr = sum(1 for t in sig.values() if t.startswith("*"))
    stem = f"triton_{src.name.removesuffix('.py')}_{cfg.launch_name}"
    return aot._compile_kernel(src, aot.TRITON_KERNEL_NAME, sig, consts, n_ptr, cfg.launch,
                               target, out_dir, stem, cfg.name)


def compile_one(item, out_dir: Path) -> list[dict]:
    label, tname, family, spec, cfg, bwd = item
    from tilegen import backends as registry
    from tilegen.targets import get_target

    target = get_target(tname)
    kspec = spec.kernel_spec
    if family == "triton_bwd":
        from tilegen.backends.triton.aot import compile_triton_backward
        from tilegen.backends.triton.backward import render_triton_backward

        src = render_triton_backward(kspec, cfg, target, bwd)
        arts = compile_triton_backward(kspec, cfg, target, out_dir, src, bwd)
    else:
        impl = registry.get(family)
        src = impl.render(kspec, cfg, target)
        try:
            arts = impl.compile(kspec, cfg, target, src, out_dir)
        except Exception:
            if family != "triton" or not cfg.store_max_prob:
                raise
            arts = _compile_max_prob(kspec, cfg, target, src, out_dir)
    rows = []
    for a in arts if isinstance(arts, list) else [arts]:
        kernel = a.kernel_name
        rows.append({
            "key": f"{tname} | {family} | {label} | {cfg.name}"
                   + (f" | {bwd.name}" if bwd else "") + f" | {kernel}",
            "target": tname, "family": family, "label": label, "config": cfg.name,
            "bwd": bwd.name if bwd else None, "kernel": kernel,
            "registers": a.registers, "agprs": a.agprs, "spill_bytes": a.spill_bytes,
            "stack_bytes": a.stack_bytes, "shared_bytes": a.shared_bytes,
            "threads": a.threads, "matrix_ops": a.matrix_ops, "code": sass_hash(Path(a.path)),
            "source_sha256": src.sha256, "source_name": src.name,
        })
    return rows


def run(args) -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # AOT compiles need a compiled-mode process
    items = variants(tuple(args.targets.split(",")))
    if args.list:
        for it in items:
            print(it[1], it[2], it[0], it[4].name, it[5].name if it[5] else "")
        print(len(items), "variants")
        return
    rows, failures = [], []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i, it in enumerate(items):
            out_dir = Path(tmp) / f"v{i}"
            try:
                rows += compile_one(it, out_dir)
            except Exception as exc:  # record and go on
                failures.append({"variant": f"{it[1]} {it[2]} {it[0]} {it[4].name}",
                                 "error": f"{type(exc).__name__}: {exc}"[:2000]})
                print("FAILED", failures[-1]["variant"], failures[-1]["error"][:300],
                      file=sys.stderr)
            if i % 20 == 0:
                print(f"[{i + 1}/{len(items)}] {time.time() - t0:.0f}s", file=sys.stderr)
    import tilegen

    Path(args.out).write_text(json.dumps({"tilegen": str(Path(tilegen.__file__).parent),
                                          "rows": rows, "failures": failures}, indent=1))
    print(f"{len(rows)} kernels, {len(failures)} failures, {time.time() - t0:.0f}s -> {args.out}")


# ------------------------------------------------------------------------------- on a GPU
def _cos(a, b) -> float:
    import torch

    a, b = a.float().flatten(), b.float().flatten()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def gpu_check(args) -> int:
    """Run each sm_90 variant (the debug timing experiments aside) on a small synthetic
    workload of its spec on this machine's GPU: the forward (o, lse, max_prob) against the
    reference variant (the contract's scoring rule for o), the backward's dq, dk, dv against the
    fp32 reference (cosine). Writes one JSON row per variant to --out as it goes."""
    import torch

    import tilegen
    from tilegen.captures import score, synthesize_for
    from tilegen.config import REFERENCE_CONFIG
    from tilegen.reference import attention_backward_fp32

    items = [it for it in variants(("sm_90",)) if "debug" not in it[0]
             and (not args.only or it[2] in args.only.split(","))][:args.limit or None]
    rows, bad, t0 = [], 0, time.time()
    refs: dict = {}
    for label, _, family, spec, cfg, bwd in items:
        if args.max_seconds and time.time() - t0 > args.max_seconds:
            print(f"stopping after {len(rows)} of {len(items)} variants (--max-seconds)")
            break
        spec = spec.kernel_spec.replace(grid=(12, 16, 16), num_heads=2, topk=7)
        row = {"family": family, "label": label, "config": cfg.name,
               "bwd": bwd.name if bwd else None}
        try:
            cap = synthesize_for(spec, seed=1, device=args.device)
            st = spec.encoding == "sliding_tile"
            cubes = (cap["vbs"],) if st else (cap["topk_idx"], cap["vbs"])
            key = spec.kernel_hash
            if key not in refs:
                refs[key] = tilegen.load(spec, REFERENCE_CONFIG, backend="triton")
            ref = refs[key]
            if family == "triton_bwd":
                op = tilegen.load(spec, cfg, backend="triton")
                op.backward_config = bwd
                q, k, v = (cap[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
                do = torch.randn_like(cap["q"], dtype=torch.float32)
                o = op(q, k, v, *cubes, return_lse=False)
                (o.float() * do).sum().backward()
                lut, counts = ((ref.window_lut(q.device, 1, spec.num_heads)) if st
                               else (cap["topk_idx"], None))
                want = attention_backward_fp32(
                    cap["q"].float(), cap["k"].float(), cap["v"].float(), lut,
                    cap["vbs"] if spec.variable_block_sizes else None, counts, do,
                    layout=spec.layout, block=spec.block_kv)
                row["cos"] = [_cos(g.grad, w) for g, w in zip((q, k, v), want, strict=True)]
                ok = min(row["cos"]) > 0.999 and all(torch.isfinite(g.grad).all() for g in
                                                   (q, k, v))
            else:
                op = tilegen.load(spec, cfg, backend=family)
                kw = dict(return_lse=cfg.store_lse, return_max_prob=cfg.store_max_prob)
                got, want = op(cap["q"], cap["k"], cap["v"], *cubes, **kw), ref(
                    cap["q"], cap["k"], cap["v"], *cubes, **kw)
                o, o_ref = (got.o, want.o) if cfg.store_max_prob else (
                    (got[0], want[0]) if cfg.store_lse else (got, want))
                sc = score(o, o_ref, layout=spec.layout)
                row["score"] = str(sc)
                ok = sc.passed
                if cfg.store_lse:
                    lse, lse_ref = (got.lse, want.lse) if cfg.store_max_prob else (got[1], want[1])
                    row["lse_err"] = float((lse - lse_ref).abs().nan_to_num(0).max())
                    ok &= row["lse_err"] < 1e-2
                if cfg.store_max_prob:
                    row["mp_err"] = float((got.max_prob - want.max_prob).abs().max())
                    row["mpc_err"] = float((got.max_prob_cube - want.max_prob_cube).abs().max())
                    ok &= row["mp_err"] < 1e-2 and row["mpc_err"] < 1e-2
            row["ok"] = bool(ok)
        except Exception as exc:  # record and go on
            row["ok"], row["error"] = False, f"{type(exc).__name__}: {exc}"[:1500]
        bad += not row["ok"]
        rows.append(row)
        print(("ok  " if row["ok"] else "FAIL"), family, label, cfg.name, row.get("bwd") or "",
              row.get("score") or row.get("cos") or row.get("error", ""), flush=True)
        Path(args.out).write_text(json.dumps({"rows": rows, "failures": bad,
                                              "seconds": time.time() - t0}, indent=1))
    print(f"{len(rows)} variants, {bad} failed, {time.time() - t0:.0f}s")
    return 1 if bad else 0


# ------------------------------------------------------------------------------- diff
FIELDS = ("registers", "agprs", "spill_bytes", "stack_bytes", "shared_bytes", "threads",
          "matrix_ops")


def _mma(m):
    return ",".join(f"{k}={v}" for k, v in sorted((m or {}).items())) or "none"


#: shorter spellings of the config names' parts, for the markdown table
SHORT = (("bm64_bn64_w4_s1_consumer_regs232_", ""), ("fence_wait", "fw"), ("k_stages", "k"),
         ("num_consumers", "nc"), ("pack_partials", "pk"), ("q_in_regs", "qr"),
         ("qk_ahead", "qa"), ("share_kv", "sh"), ("v_stages", "v"), ("debug", "dbg_"))


def _short(name: str) -> str:
    for a, b in SHORT:
        name = name.replace(a, b)
    return name


def diff(a_path: str, b_path: str, markdown: bool) -> int:
    a = {r["key"]: r for r in json.loads(Path(a_path).read_text())["rows"]}
    bdata = json.loads(Path(b_path).read_text())
    b = {r["key"]: r for r in bdata["rows"]}
    changed, same_code = [], 0
    for key in sorted(set(a) | set(b)):
        ra, rb = a.get(key), b.get(key)
        if ra is None or rb is None:
            changed.append((key, "only in " + ("after" if ra is None else "before"), ra or rb,
                            None))
            continue
        d = [f for f in FIELDS if ra[f] != rb[f]]
        if ra["code"] == rb["code"]:
            same_code += 1
        if d or ra["code"] != rb["code"]:
            changed.append((key, ", ".join(d) or "code only", ra, rb))
    print(f"{len(a)} kernels before, {len(b)} after; identical machine code: {same_code}; "
          f"resource differences: {sum(1 for c in changed if c[1] != 'code only')}; "
          f"code-only differences: {sum(1 for c in changed if c[1] == 'code only')}")
    for key, what, ra, rb in changed:
        if rb is None:
            print(f"- {key}: {what}")
            continue
        print(f"- {key}: {what}: " + "; ".join(
            f"{f} {ra[f]} -> {rb[f]}" for f in FIELDS if ra[f] != rb[f]))
    if markdown:  # one row per kernel; a cell reads "before -> after" where they differ
        print()
        print("| target | family | variant | config | kernel | regs | spills | shared | mma | "
              "code |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for key in sorted(set(a) & set(b)):
            ra, rb = a[key], b[key]

            def cell(f, fmt=str, ra=ra, rb=rb):
                x, y = fmt(ra[f]), fmt(rb[f])
                return x if x == y else f"{x} -> {y}"
            config = ra["bwd"] or _short(ra["config"])  # the backward: its BackwardConfig
            print(f"| {ra['target']} | {ra['family']} | {ra['label']} | `{config}` | "
                  f"{ra['kernel'].removeprefix('tilegen_')} | {cell('registers')} | "
                  f"{cell('spill_bytes')} | {cell('shared_bytes')} | {cell('matrix_ops', _mma)} "
                  f"| {'same' if ra['code'] == rb['code'] else 'differs'} |")
    return 1 if any(c[1] != "code only" for c in changed) else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="template_resources.json")
    ap.add_argument("--targets", default="sm_90,sm_100a,gfx942")
    ap.add_argument("--list", action="store_true", help="print the variants, compile nothing")
    ap.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--markdown", action="store_true", help="with --diff: the full table")
    ap.add_argument("--gpu", action="store_true",
                    help="run the sm_90 variants on this machine's GPU against the references")
    ap.add_argument("--only", default="", help="with --gpu: families (gluon,triton,triton_bwd)")
    ap.add_argument("--limit", type=int, default=0, help="with --gpu: the first N variants")
    ap.add_argument("--max-seconds", type=float, default=0, help="with --gpu: stop after this")
    ap.add_argument("--device", default="cuda", help="with --gpu: cpu runs the Triton families "
                    "under TRITON_INTERPRET=1 (a dry run of this script)")
    args = ap.parse_args()
    if args.gpu:
        sys.exit(gpu_check(args))
    if args.diff:
        sys.exit(diff(*args.diff, args.markdown))
    run(args)


if __name__ == "__main__":
    main()
