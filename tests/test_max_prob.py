"""The softmax-normalizer signal max_prob = 1/l (issue #14) and the adaptive budget built on it.

Every path that computes attention writes the signal from its own softmax: the generated Triton
kernel under the interpreter (one program per cube, and block_m < block_q with atomic cube
adds), the CPU PyTorch path, the CUDA kernel (rendered and compiled with nvcc), the HIP kernel
(its C++ run on the CPU executor) and the custom op under torch.compile. Each is compared with
the fp32 reference (`attention_fp32(max_prob=True)`: exp(max logit - lse) per row), on captures
with partial cubes (vbs 64/32/16/8), an outlier head (logits ~300) and empty rows (counts 0).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import tilegen
from tilegen import KernelConfig, Spec, captures, sparsity
from tilegen.backends import get
from tilegen.maxprob import AttentionOutput, cube_mean
from tilegen.reference import attention_fp32
from tilegen.targets import get_target

GRID, HEADS, TOPK = (5, 6, 8), 2, 3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ROOT = Path(__file__).resolve().parents[1]


def small_case(seed: int, head_dim: int, dtype: str, layout: str, topk: int = TOPK) -> dict:
    """8 cubes with vbs {64, 32, 16, 8}, head 1 an outlier head, counts with empty rows."""
    cap = captures.synthesize(seed=seed, grid=GRID, heads=HEADS, head_dim=head_dim, topk=topk,
                              dtype=DTYPES[dtype], outlier=[1])
    if layout == "bhsd":
        for key in ("q", "k", "v"):
            cap[key] = cap[key].transpose(1, 2).contiguous()
    counts = torch.randint(0, topk + 1, (1, HEADS, 8),
                           generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    counts[0, 0, 0] = 0  # an empty row
    counts[0, 1, 1:3] = topk  # full rows in the outlier head
    cap["counts"] = counts
    return cap


def spec_for(head_dim: int, dtype: str, layout: str, vbs: bool = True) -> Spec:
    return Spec(head_dim=head_dim, dtype=dtype, layout=layout, grid=GRID, num_heads=HEADS,
                topk=TOPK, variable_block_sizes=vbs)


def explicit_cube_mean(mp: torch.Tensor, vbs: torch.Tensor | None, block: int = 64):
    """The cube mean spelled out: a Python loop over cubes, the first vbs[c] rows of each."""
    B, H, S = mp.shape
    out = torch.empty(B, H, S // block)
    for c in range(S // block):
        n = block if vbs is None else int(vbs[c])
        out[:, :, c] = mp[:, :, c * block:c * block + n].double().mean(-1).float()
    return out


def check_signal(res: AttentionOutput, cap: dict, spec: Spec, counts=None) -> None:
    vbs = cap["vbs"] if spec.variable_block_sizes else None
    args = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], vbs)
    _, lse_ref, mp_ref = attention_fp32(*args, counts, layout=spec.layout, max_prob=True)
    B, H, S = lse_ref.shape
    assert res.max_prob.shape == (B, H, S) and res.max_prob.dtype == torch.float32
    assert res.max_prob_cube.shape == (B, H, S // 64) and res.max_prob_cube.dtype == torch.float32
    assert torch.isfinite(res.max_prob).all() and torch.isfinite(res.max_prob_cube).all()
    torch.testing.assert_close(res.max_prob, mp_ref, rtol=1e-4, atol=1e-6)
    # 1/l really is the row's largest weight, 2^(m - lse): m from the logits, lse the kernel's
    assert ((res.max_prob > 0) & (res.max_prob <= 1 + 1e-6) | (res.max_prob == 0)).all()
    torch.testing.assert_close(res.max_prob_cube, explicit_cube_mean(res.max_prob, vbs),
                               rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(res.max_prob_cube, cube_mean(mp_ref, vbs, 64), rtol=1e-4,
                               atol=1e-6)
    # the outlier head: base-2 lse past fp32 exp range, the signal still finite and peaked
    assert lse_ref[:, 1].max() > 128
    assert res.max_prob[:, 1].max() > res.max_prob[:, 0].max()
    if counts is not None:  # rows with no key give 0, exactly
        empty = (counts == 0).repeat_interleave(64, dim=2)
        assert empty.any() and (res.max_prob[empty] == 0).all()
        assert (res.max_prob_cube[counts == 0] == 0).all()
        assert (res.max_prob[~empty] > 0).all()


CASES = [  # (seed, head_dim, dtype, layout, block_m, block_n, counts)
    (0, 64, "fp16", "bshd", 64, 32, True),   # one program per cube: the cube mean is stored
    (1, 64, "bf16", "bhsd", 32, 32, False),  # two programs per cube: atomic adds (interp_bf16)
    (2, 128, "bf16", "bshd", 16, 64, True),  # four programs per cube
]


@pytest.mark.parametrize("seed,head_dim,dtype,layout,bm,bn,with_counts", CASES)
def test_interpreter_max_prob_is_one_over_l(interpreter, seed, head_dim, dtype, layout, bm, bn,
                                            with_counts):
    cap = small_case(seed, head_dim, dtype, layout)
    counts = cap["counts"] if with_counts else None
    spec = spec_for(head_dim, dtype, layout)
    op = tilegen.load(spec, KernelConfig(block_m=bm, block_n=bn), target=None)
    args = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"], counts)
    res = op(*args, return_max_prob=True)
    assert isinstance(res, AttentionOutput)
    check_signal(res, cap, spec, counts)
    o, lse = op(*args)  # the signal changes nothing else
    assert torch.equal(o, res.o) and torch.equal(lse, res.lse)
    lean = op(*args, return_lse=False, return_max_prob=True)
    assert lean.lse is None and torch.equal(lean.max_prob, res.max_prob)


def test_interpreter_full_cubes_mean_over_every_row(interpreter):
    cap = small_case(3, 64, "fp16", "bshd")
    spec = spec_for(64, "fp16", "bshd", vbs=False)
    op = tilegen.load(spec, KernelConfig(block_m=32, block_n=32), target=None)
    res = op(cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"], return_max_prob=True)
    check_signal(res, cap, spec)


def test_cpu_pytorch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for layout, vbs in (("bshd", True), ("bhsd", False)):
        cap = small_case(4, 64, "bf16", layout)
        spec = spec_for(64, "bf16", layout, vbs)
        op = tilegen.load(spec, KernelConfig(), target=None)
        args = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"], cap["counts"])
        res = op(*args, return_max_prob=True)
        check_signal(res, cap, spec, cap["counts"])


def test_cpu_path_matches_interpreter(monkeypatch):
    cap = small_case(5, 64, "fp16", "bshd")
    op = tilegen.load(spec_for(64, "fp16", "bshd"), KernelConfig(block_m=32), target=None)
    args = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"], cap["counts"])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = op(*args, return_max_prob=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interp = op(*args, return_max_prob=True)
    torch.testing.assert_close(interp.max_prob, cpu.max_prob, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(interp.max_prob_cube, cpu.max_prob_cube, rtol=1e-4, atol=1e-6)


def test_gradient_call_returns_the_signal_too(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cap = small_case(6, 64, "bf16", "bshd")
    op = tilegen.load(spec_for(64, "bf16", "bshd"), KernelConfig(), target=None)
    base = (cap["topk_idx"], cap["vbs"], cap["counts"])
    ref = op(cap["q"], cap["k"], cap["v"], *base, return_max_prob=True)
    q = cap["q"].clone().requires_grad_(True)
    res = op(q, cap["k"], cap["v"], *base, return_lse=False, return_max_prob=True)
    assert res.lse is None and not res.max_prob.requires_grad
    torch.testing.assert_close(res.max_prob, ref.max_prob)
    res.o.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_option_costs_nothing_when_off():
    """Off, the rendered source is the one without the option, byte for byte (no argument, no
    store), so tuned winners stay current; on, it is its own variant."""
    spec, sm90 = Spec(), get_target("sm_90")
    off, on = KernelConfig(), KernelConfig(store_max_prob=True)
    assert off.name == "bm64_bn64_w4_s3_lse" and on.name == "bm64_bn64_w4_s3_lse_maxprob"
    assert "store_max_prob" not in off.to_dict() and on.to_dict()["store_max_prob"] is True
    assert KernelConfig.from_dict(on.to_dict()) == on
    for family in ("triton", "cuda"):
        backend = get(family)
        text_off = backend.render(spec, off, sm90).text
        committed = ROOT / "targets" / "sm_90" / "generated" / backend.render(spec, off, sm90).name
        assert committed.read_text() == text_off
        assert "MAX_PROB" not in text_off and "max_prob" not in text_off
        assert "max_prob" in backend.render(spec, on, sm90).text.lower()
        assert backend.variant_key(spec, on, sm90) != backend.variant_key(spec, off, sm90)
    with pytest.raises(ValueError, match="not tunable"):
        from tilegen.tune.space import Dim

        Dim("store_max_prob", (True, False), "render")


# -- the custom op --------------------------------------------------------------------------
def test_custom_op_fake_and_fullgraph_compile(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from tilegen.ops import block_sparse_attention

    cap = small_case(7, 64, "bf16", "bshd")
    args = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"], cap["counts"])
    torch.library.opcheck(torch.ops.tilegen.block_sparse_attention_max_prob.default,
                          (*args, "bshd", None, True),
                          test_utils=("test_schema", "test_faketensor"))

    def f(q, k, v, idx, vbs, counts):
        out = block_sparse_attention(q, k, v, idx, vbs, counts, return_lse=True,
                                     return_max_prob=True)
        return out.o.float() * 2, out.lse, out.max_prob, out.max_prob_cube

    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b)
    check_signal(block_sparse_attention(*args, return_max_prob=True), cap, Spec(head_dim=64),
                 cap["counts"])
    q = cap["q"].clone().requires_grad_(True)
    out = block_sparse_attention(q, *args[1:], return_max_prob=True)
    out.o.float().sum().backward()
    torch.testing.assert_close(out.max_prob, eager[2])
    assert q.grad is not None


# -- the adaptive budget ----------------------------------------------------------------------
def test_adaptive_topk_monotone_and_bounded():
    g = torch.Generator().manual_seed(0)
    topk = 78
    x = torch.rand(2, 3, 500, generator=g) ** 6  # spans 1e-6 .. 1, below the floor included
    x[0, 0, :3] = torch.tensor([0.0, float("nan"), 1.0])
    for kw in ({}, {"budget_diffuse": 0.6, "budget_peaked": 0.1, "min_count": 4}):
        counts = sparsity.adaptive_topk(x, topk, **kw)
        assert counts.dtype == torch.int32 and counts.shape == x.shape
        lo = kw.get("min_count", 1)
        assert counts.min() >= lo and counts.max() <= topk
        order = x.nan_to_num(0.0).flatten().argsort()
        assert (counts.flatten()[order].diff() <= 0).all()  # never more cubes when more peaked
        hi = round(topk * kw.get("budget_diffuse", sparsity.ADAPTIVE_DEFAULTS["budget_diffuse"]))
        assert counts[0, 0, 0] == counts[0, 0, 1] == hi  # no signal: the diffuse budget
        low = round(topk * kw.get("budget_peaked", sparsity.ADAPTIVE_DEFAULTS["budget_peaked"]))
        assert counts[0, 0, 2] == max(lo, low)  # one-hot rows: the peaked budget
    for bad, err in (({"budget_peaked": 0.9, "budget_diffuse": 0.5}, "must not grow"),
                     ({"budget_diffuse": 0.0}, "budget_diffuse must lie in"),
                     ({"min_count": 79}, "exceeds topk")):
        with pytest.raises(ValueError, match=err):
            sparsity.adaptive_topk(x, topk, **bad)
    with pytest.raises(ValueError, match="3-D"):
        sparsity.adaptive_topk(x[0], topk)


def test_ranked_lut_cut_by_counts_is_the_best_cubes():
    cap = captures.synthesize(seed=1, grid=(8, 8, 12), heads=2, head_dim=64, topk=4)
    q, k, vbs = cap["q"], cap["k"], cap["vbs"]
    ranked = sparsity.ranked_topk(q, k, vbs, 6)
    scores = sparsity.coarse_scores(q, k, vbs)
    assert (scores.gather(-1, ranked.long()).diff(dim=-1) <= 0).all()  # best first
    # its first 4 are the coarse stage's top 4
    assert torch.equal(ranked[..., :4].sort(-1).values, sparsity.mean_pool_topk(q, k, vbs, 4))
    counts = torch.randint(1, 7, ranked.shape[:3], generator=torch.Generator().manual_seed(0),
                           dtype=torch.int32)
    cut = sparsity.cut_lut(ranked, counts)
    assert cut.dtype == torch.int32 and cut.shape == ranked.shape
    assert torch.equal(cut.sort(-1).values, ranked.sort(-1).values)  # a permutation per row
    for row_cut, row_ranked, n in zip(cut.flatten(0, 2), ranked.flatten(0, 2),
                                      counts.flatten().tolist(), strict=True):
        kept = row_cut[:n]
        assert torch.equal(kept, row_ranked[:n].sort().values)  # the best n, ascending ids


# -- the C++ families -------------------------------------------------------------------------
def test_cuda_renders_and_compiles_with_the_signal(tmp_path):
    from tilegen.backends.cuda import nvcc as nv
    from tilegen.backends.cuda import runtime as rt
    from tilegen.compile import ToolchainMissing

    sm90 = get_target("sm_90")
    for spec, cfg in ((Spec(), KernelConfig(store_max_prob=True)),
                      (Spec(head_dim=64, variable_block_sizes=False),
                       KernelConfig(block_m=32, block_n=32, num_warps=2, num_stages=2,
                                    store_max_prob=True))):
        src = nv.render_cuda(spec, cfg, sm90)
        m = re.search(rf"{nv.kernel_name(spec, cfg)}\((.*?)\)\s*{{", src.text, re.S)
        params = [p.strip().split()[-1] for p in m.group(1).split(",")]
        assert params == [n for n, _ in rt.kernel_signature(True)]
        library = src.expanded()  # the signal's code is in the static headers
        assert ("atomicAdd(max_prob_cube" in library) and ("kBlockM == T::kBlockQ" in library)
        try:
            art = nv.compile_cuda(src, sm90, tmp_path)
        except ToolchainMissing as exc:
            pytest.skip(str(exc))
        assert art.spill_bytes == 0
    args = rt.kernel_args({"q": 1, "max_prob": 9, "max_prob_cube": 10}, 64, 1, 1, 1, 1.0,
                          store_max_prob=True)
    assert [n for n, _, _ in args][8:10] == ["max_prob", "max_prob_cube"]


needs_clang = pytest.mark.skipif(shutil.which("clang++-19") is None,
                                 reason="clang++-19 not installed (the HIP CPU executor)")


@needs_clang
@pytest.mark.parametrize("cfg", [
    KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),  # gfx942 default, 4 waves
    KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=2),  # 2 waves per row group
], ids=lambda c: c.name)
def test_hip_kernel_on_cpu_executor(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(tmp_path))
    from tilegen.backends.hip import runtime as hiprt
    from tilegen.backends.hip.host.executor import HostKernel

    spec = Spec(head_dim=64)
    cap = small_case(8, 64, "bf16", "bshd", topk=5)
    kernel = HostKernel(spec, cfg.replace(store_max_prob=True))
    o, lse = kernel(cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"], cap["counts"])
    mp, mpc = kernel.max_prob
    check_signal(AttentionOutput(o, lse, mp, mpc), cap, spec, cap["counts"])
    assert hiprt.kernarg_size(True) == hiprt.kernarg_size() + 16


# -- the calibration script ---------------------------------------------------------------------
def test_calibration_script_cpu_small(tmp_path, monkeypatch, capsys):
    """bench/experiments/h200_max_prob.py --cpu-small runs the whole pipeline on the CPU (PyTorch
    path)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spec_ = importlib.util.spec_from_file_location(
        "h200_max_prob", ROOT / "bench" / "experiments" / "h200_max_prob.py")
    mod = importlib.util.module_from_spec(spec_)
    sys.modules["h200_max_prob"] = mod
    spec_.loader.exec_module(mod)
    # the script's peakedness is adaptive_topk's
    x = torch.rand(1, 2, 50)
    t = mod.peakedness(x, 10, 64)
    counts = sparsity.adaptive_topk(x, 10, budget_diffuse=1.0, budget_peaked=0.2)
    torch.testing.assert_close(counts, torch.round(10 * (1.0 - 0.8 * t)).clamp(1, 10).int())
    assert mod.spearman(torch.arange(5.0), torch.tensor([1.0, 2, 2, 3, 9])) > 0.97
    assert mod.main(["--cpu-small", "--out", str(tmp_path)]) == 0
    import json

    res = json.loads((tmp_path / "h200_max_prob.json").read_text())
    assert not res["errors"] and res["calibration"]["pooled"]["W0.5"]["rho_max_prob_p0.9"] > 0
    assert res["calibration"]["cases"][0]["max_prob_max_rel_err"] < 1e-4
    assert "equal budget" in capsys.readouterr().out


def test_every_encoding_writes_the_signal(interpreter):
    """mask (the LUT kernel after the on-device conversion) and sliding_tile (its own cursor)
    give the signal of attention over their cubes: the fp32 reference on the equivalent LUT."""
    from tilegen.encodings import sliding_tile_lut

    cap = small_case(3, 64, "fp16", "bshd")
    base = spec_for(64, "fp16", "bshd")
    mask = sparsity.lut_to_mask(cap["topk_idx"], 8)
    res = tilegen.load(base.replace(encoding="mask"))(
        cap["q"], cap["k"], cap["v"], mask, cap["vbs"], return_max_prob=True)
    check_signal(res, cap, base)
    st = base.replace(encoding="sliding_tile", window=(1, 1, 1), topk=8)
    res = tilegen.load(st)(cap["q"], cap["k"], cap["v"], cap["vbs"], return_max_prob=True)
    lut, counts = sliding_tile_lut(st, 1, HEADS, "cpu")
    _, _, mp_ref = attention_fp32(cap["q"], cap["k"], cap["v"], lut, cap["vbs"], counts,
                                  max_prob=True)
    torch.testing.assert_close(res.max_prob, mp_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(res.max_prob_cube, cube_mean(mp_ref, cap["vbs"], 64), rtol=1e-4,
                               atol=1e-6)
