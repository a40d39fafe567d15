"""The Gluon family's 8-bit kernel (issue #19, `tilegen.backends.gluon.quant`) on a machine
without a GPU: it renders and compiles for sm_90a with the 8-bit wgmma kinds (IGMMA, QGMMA) and
no spills, the targets and families without an 8-bit kernel refuse it with the reason, and the
op refuses what it cannot compute before anything runs. Its values are checked on the H200
(`bench/experiments/h200_quant_op.py`: the quantized rule with check 4)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import tilegen
from tilegen import backends, quant
from tilegen.spec import Spec
from tilegen.targets import get_target

SMALL = dict(grid=(8, 8, 8), num_heads=2, topk=3)


@pytest.mark.parametrize("head_dim,dtype,knobs", [
    (128, "bf16", {}), (64, "fp16", {}),
    # the other paths of the template: the consumer's own scale loads with S a tile ahead and
    # Q from the pre-pass; one arrive a tile
    (128, "bf16", {"key_tma": False, "wide_s": False, "qk_ahead": True, "q_in_kernel": False}),
    (128, "bf16", {"joint_free": True, "v_stages": 4}),
    # session 16's paths: row sums by the MMA, Q from registers, V^T tiles in 128-byte rows,
    # a quarter of exp2 on the FMA pipe; three consumers a CTA with P.V into O itself
    (128, "bf16", {"l_mma": True, "q_regs": True, "vt_tiled": True, "poly_exp": 1}),
    (128, "bf16", {"num_consumers": 3, "k_stages": 3, "consumer_regs": 160,
                   "two_level": False, "poly_exp": 2}),
])
def test_the_8bit_kernel_builds_for_sm_90a_with_igmma_and_qgmma(tmp_path, head_dim, dtype,
                                                                knobs):
    """Compiled in a process without the interpreter, as `tilegen build` does."""
    code = (
        "import json; from pathlib import Path\n"
        "from tilegen import Spec, backends\n"
        "from tilegen.targets import get_target\n"
        f"s = Spec(quant='int8_fp8', head_dim={head_dim}, dtype={dtype!r}, grid=(8, 8, 8),"
        " num_heads=2, topk=3)\n"
        "t = get_target('sm_90'); b = backends.get('gluon'); cfg = b.default_config(s, t)\n"
        f"cfg = cfg.replace(options={{**dict(cfg.options), **{knobs!r}}})\n"
        "srcs = b.sources(s, cfg, t)\n"
        f"art = b.compile(s, cfg, t, srcs[0], Path({str(tmp_path)!r}))\n"
        "print(json.dumps(dict(n=len(srcs), bad=b.violations(s, t, cfg), ops=art.matrix_ops,"
        " spills=art.spill_bytes, shared=art.shared_bytes, name=cfg.render_name)))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["n"] == 1 and out["bad"] == []  # forward only: no backward module
    assert out["ops"].get("IGMMA", 0) > 0 and out["ops"].get("QGMMA", 0) > 0
    assert not out["ops"].get("HGMMA")  # no 16-bit MMA left in the 8-bit kernel
    assert out["spills"] == 0
    for knob, value in knobs.items():  # the variant asked for is the one built
        assert f"{knob}{int(value)}" in out["name"], (knob, out["name"])
    target = get_target("sm_90")
    ctas = 1 if knobs.get("num_consumers", 1) > 1 else 2  # an SM's CTAs the shared memory holds
    assert ctas * (out["shared"] + target.reserved_shared_per_block) <= target.shared_per_sm


def test_targets_and_families_without_an_8bit_kernel_say_why():
    spec = Spec(quant="int8_fp8", **SMALL)
    gluon = backends.get("gluon")
    (why,) = gluon.spec_violations(spec, get_target("sm_100a"))
    assert "tcgen05" in why and "i8" in why and "f8f6f4" in why
    for name, tname in (("triton", "sm_90"), ("hip", "gfx942")):
        (why,) = backends.get(name).spec_violations(spec, get_target(tname))
        assert f"the {name} family has no quant='int8_fp8' kernel" in why and "gluon" in why
    # the CUDA family's is its wgmma mainloop's (tests/test_cuda_wgmma_8bit.py)
    assert backends.get("cuda").spec_violations(spec, get_target("sm_90")) == []
    (why,) = gluon.spec_violations(Spec(quant="int8", **SMALL), get_target("sm_90"))
    assert "the gluon family has no quant='int8' kernel" in why
    with pytest.raises(ValueError, match="has no quant='int8_fp8' kernel; families with it"):
        tilegen.load(spec, backend="triton")


def test_the_8bit_configs_are_its_own():
    spec = Spec(quant="int8_fp8", **SMALL)
    gluon, target = backends.get("gluon"), get_target("sm_90")
    cfg = gluon.default_config(spec, target)
    bf16_knob = cfg.replace(options=(("pack_partials", True),))
    (why,) = gluon.config_violations(spec, target, bf16_knob)
    assert "unknown 8-bit Gluon config key(s) ['pack_partials']" in why
    (why,) = gluon.config_violations(spec, target, cfg.replace(options=(("k_stages", 1),)))
    assert "k_stages must be at least 2" in why
    (why,) = gluon.config_violations(spec, target, cfg.replace(options=(("k_stages", 30),)))
    assert "shared memory" in why
    assert gluon.config_violations(spec, target, cfg.replace(
        options=(("k_stages", 6), ("v_stages", 4)))) == []
    # the knobs that need each other say which
    (why,) = gluon.config_violations(spec, target, cfg.replace(options=(("qk_ahead", True),)))
    assert "key_tma" in why and "qk_ahead" in why and "choose one" in why
    (why,) = gluon.config_violations(spec, target, cfg.replace(
        options=(("key_tma", False),)))
    assert "wide_s" in why and "needs key_tma" in why
    (why,) = gluon.config_violations(spec, target, cfg.replace(options=(("joint_free", True),)))
    assert "k_stages == v_stages" in why
    off_wide = (("key_tma", False), ("wide_s", False))
    for knob in ("two_level", "l_mma", "q_regs", "poly_exp"):
        value = False if knob == "two_level" else (1 if knob == "poly_exp" else True)
        (why,) = gluon.config_violations(spec, target, cfg.replace(
            options=off_wide + ((knob, value),)))
        assert knob in why and "wide_s" in why, (knob, why)
    (why,) = gluon.config_violations(spec, target, cfg.replace(options=(("poly_exp", 3),)))
    assert "0, 1 or 2" in why
    (why,) = gluon.config_violations(spec, target, cfg.replace(options=(("num_consumers", 4),)))
    assert "num_consumers must be 1, 2 or 3" in why
    # three consumers a CTA: their rings in one CTA's shared memory
    (why,) = gluon.config_violations(spec, target, cfg.replace(
        options=(("num_consumers", 3), ("k_stages", 4))))
    assert "shared memory" in why
    assert gluon.config_violations(spec, target, cfg.replace(
        options=(("num_consumers", 3), ("k_stages", 3), ("consumer_regs", 160)))) == []
    for opts in ((("qk_ahead", True), ("key_tma", False), ("wide_s", False)),
                 (("joint_free", True), ("v_stages", 4)),
                 (("key_tma", False), ("wide_s", False), ("q_in_kernel", False))):
        assert gluon.config_violations(spec, target, cfg.replace(options=opts)) == [], opts


def test_the_op_refuses_what_it_cannot_compute_before_it_runs():
    spec = Spec(quant="int8_fp8", **SMALL)
    with pytest.raises(ValueError, match="needs a target"):
        tilegen.load(spec)  # this machine has no GPU, and no target is named
    op = tilegen.load(spec, target="sm_90", backend="gluon")
    assert type(op).__name__ == "GluonQuantAttention"
    S = spec.num_cubes * 64
    q = torch.randn(1, S, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    k = v = torch.randn(1, S, 2, 128, dtype=torch.bfloat16)
    idx = torch.zeros(1, 2, spec.num_cubes, 3, dtype=torch.int32)
    vbs = torch.full((spec.num_cubes,), 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="forward only"):
        op(q, k, v, idx, vbs)
    with pytest.raises(ValueError, match="one shape"):
        op(q.detach(), k[:, :64], v[:, :64], idx, vbs)
    with pytest.raises(ValueError, match="max_prob"):
        op(q.detach(), k, v, idx, vbs, return_max_prob=True)
    qi = quant.quantize_torch(q.detach(), k, v, vbs, "int8_fp8")
    with pytest.raises(ValueError, match="topk_idx of shape"):
        op.from_quantized(qi, idx[:, :1], vbs)
    with pytest.raises(ValueError, match="one vbs entry per 64-token cube"):
        op.from_quantized(qi, idx, vbs[:-1])
    int8_only = quant.quantize_torch(q.detach(), k, v, vbs, "int8")
    with pytest.raises(ValueError, match="mode 'int8'"):
        op.from_quantized(int8_only, idx, vbs)


def _halves_attention(q, k, v, bufs, scale, by_bias: bool = False):
    """Attention over the 8-bit kernel's plan, read as its producer and consumer read it: each
    tile two 32-key halves from their first key row, keys past each half's fill masked (or,
    with ``by_bias``, keys whose key_bias is -inf: the kernel's KEY_TMA path)."""
    from tilegen.backends.gluon.prepass import HALF_FILL_SHIFT

    B, S, H, D = q.shape
    nq = S // 64
    plan, meta = bufs["plan"], bufs["meta"]
    o = torch.zeros(B, S, H, D)
    for b in range(B):
        for h in range(H):
            for qc in range(nq):
                row = (b * H + h) * nq + qc
                n_tiles = int(meta[row, 0])
                assert n_tiles >= 0
                keys, mask = [], []
                for e in plan[row, :2 * n_tiles].tolist():
                    first, fill = e & ((1 << HALF_FILL_SHIFT) - 1), e >> HALF_FILL_SHIFT
                    assert first % 32 == 0 and first + 32 <= S and 0 <= fill <= 32
                    keys.append(torch.arange(first, first + 32))
                    mask.append(bufs["key_bias"][0, first:first + 32] == 0 if by_bias
                                else torch.arange(32) < fill)
                if not keys:
                    continue
                keys, mask = torch.cat(keys), torch.cat(mask)
                rows = slice(qc * 64, (qc + 1) * 64)
                s = q[b, rows, h] @ k[b, keys, h].T * scale
                s[:, ~mask] = float("-inf")
                o[b, rows, h] = torch.softmax(s, -1) @ v[b, keys, h]
    return o


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("sizes", [(64, 32, 16, 8), (64, 33, 20, 8, 1, 16, 32, 63)])
def test_the_8bit_plan_in_halves_gives_the_rows_attention(interpreter, pack, sizes):
    """The 8-bit kernel's pre-pass (32-key halves; small cubes two to a tile with pack) plans
    exactly each row's attention, with counts and odd numbers of small cubes."""
    from tests.test_gluon_backend import _lut, _row_attention
    from tilegen.backends.gluon.prepass import halves_buffers, run_halves_prepass

    gen = torch.Generator().manual_seed(len(sizes) + 2 * pack)
    B, H, nq, D, topk = 1, 2, 12, 16, 7
    q, k, v = (torch.randn(B, nq * 64, H, D, generator=gen) for _ in range(3))
    order = torch.randperm(nq, generator=gen).tolist()
    vbs = torch.tensor([sizes[i % len(sizes)] for i in order], dtype=torch.int32)
    idx = _lut(gen, B, H, nq, topk)
    counts = torch.randint(0, topk + 1, (B, H, nq), dtype=torch.int32, generator=gen)
    for cnt in (None, counts):
        bufs = halves_buffers("cpu", B * H * nq, topk, nq)
        err = torch.zeros(1, dtype=torch.int32)
        run_halves_prepass(idx, vbs, cnt, bufs, B * H * nq, nq, topk, err, pack=pack)
        assert int(err) == 0
        want = _row_attention(q, k, v, idx, vbs, cnt, D ** -0.5)
        for by_bias in (False, True):
            got = _halves_attention(q, k, v, bufs, D ** -0.5, by_bias)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        slots = torch.arange(64)[None, :] < vbs[:, None]
        assert bufs["key_bias"].view(nq, 64)[slots].eq(0).all()
        assert bufs["key_bias"].view(nq, 64)[~slots].eq(float("-inf")).all()
        lens = (cnt if cnt is not None else torch.full(idx.shape[:3], topk)).reshape(-1)
        want_tiles = []
        for r, n in zip(idx.reshape(-1, topk).tolist(), lens.tolist(), strict=True):
            n_small = sum(int(vbs[c]) <= 32 for c in r[:n])
            want_tiles.append(n - n_small + (n_small + 1) // 2 if pack else n)
        assert bufs["meta"][:, 0].tolist() == want_tiles


def test_the_8bit_plan_flags_bad_rows(interpreter):
    """A bad index marks its row (n_tiles -1) and the error word, as the bf16 plan does."""
    from tests.test_gluon_backend import _lut
    from tilegen.backends.gluon.prepass import halves_buffers, run_halves_prepass

    gen = torch.Generator().manual_seed(5)
    B, H, nq, topk = 1, 1, 6, 3
    idx = _lut(gen, B, H, nq, topk)
    idx[0, 0, 2, 1] = nq  # out of range
    vbs = torch.full((nq,), 64, dtype=torch.int32)
    bufs = halves_buffers("cpu", nq, topk, nq)
    err = torch.zeros(1, dtype=torch.int32)
    run_halves_prepass(idx, vbs, None, bufs, nq, nq, topk, err)
    assert int(err) & 1
    assert bufs["meta"][:, 0].tolist() == [3, 3, -1, 3, 3, 3]


def test_the_8bit_ops_entry_refuses_what_it_cannot_run_here():
    """`tilegen.ops.block_sparse_attention_8bit` on this CPU: fp32 inputs and a call that needs
    gradients are refused before anything loads; a bf16 call reaches the 8-bit op's load, which
    names the targets that have its kernel (no fallback to the bf16 op)."""
    from tilegen.ops import block_sparse_attention_8bit

    q = torch.randn(1, 128, 2, 64)
    idx = torch.zeros(1, 2, 2, 1, dtype=torch.int32)
    vbs = torch.full((2,), 64, dtype=torch.int32)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        block_sparse_attention_8bit(q, q, q, idx, vbs)
    qb = q.bfloat16().requires_grad_()
    with pytest.raises(ValueError, match="forward only"):
        block_sparse_attention_8bit(qb, qb, qb, idx, vbs)
    with torch.no_grad(), pytest.raises(ValueError, match="needs a target with Hopper's wgmma"):
        block_sparse_attention_8bit(qb, qb, qb, idx, vbs)


def test_the_thw_8bit_entry_refuses_what_it_cannot_run_and_traces_without_a_break():
    """`tilegen.ops.block_sparse_attention_8bit_thw` (THW-ordered tokens, the diffusers
    integration's 8-bit layer): bad dtypes, shapes, cubes and a call that needs gradients are
    refused in one line; on this CPU the 8-bit op's load says which targets have its kernel; and
    its fake implementation lets `torch.compile` trace a caller as one graph."""
    from torch._dynamo.testing import CompileCounter

    from tilegen.ops import block_sparse_attention_8bit_thw

    grid = (4, 4, 8)
    q = torch.randn(1, 128, 2, 64)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        block_sparse_attention_8bit_thw(q, q, q, grid, 1)
    qb = q.bfloat16()
    with pytest.raises(ValueError, match=r"T\*H\*W=256"):
        block_sparse_attention_8bit_thw(qb, qb, qb, (4, 8, 8), 1)
    with pytest.raises(ValueError, match="holds 32 tokens"):
        block_sparse_attention_8bit_thw(qb, qb, qb, grid, 1, cube=(2, 4, 4))
    with pytest.raises(ValueError, match="forward only"):
        g = qb.clone().requires_grad_()
        block_sparse_attention_8bit_thw(g, g, g, grid, 1)
    with torch.no_grad(), pytest.raises(ValueError, match="needs a target with Hopper's wgmma"):
        block_sparse_attention_8bit_thw(qb, qb, qb, grid, 1)

    from tilegen import prologue

    angles = torch.rand(1, 128, 1, 64, dtype=torch.float64)
    nr = prologue.NormRope(torch.ones(128, dtype=torch.bfloat16),
                           torch.ones(128, dtype=torch.bfloat16), 1e-6, 1e-6,
                           *prologue.rope_tables(angles.cos(), angles.sin()))
    with pytest.raises(ValueError, match="rotary tables"):
        block_sparse_attention_8bit_thw(qb, qb, qb, grid, 1, norm_rope=dataclasses.replace(
            nr, cos=nr.cos[:7], sin=nr.sin[:7]))

    from tilegen.integrations.attention import sparse_attention

    with pytest.raises(ValueError, match="applied by the 8-bit pre-pass"):  # bf16 layers: no
        sparse_attention(qb, qb, qb, grid, (4, 4, 4), 1, norm_rope=nr)

    def layer(x, w, c, sn):  # the projections, the prologue applied by the op (norm_rope)
        y = block_sparse_attention_8bit_thw(x * 2, x, x, grid, 1, norm_rope=prologue.NormRope(
            w, w, 1e-6, 1e-6, c, sn))
        return (y + block_sparse_attention_8bit_thw(x * 2, x, x, grid, 1)).float().sum()

    counter = CompileCounter()
    torch._dynamo.reset()
    with torch.no_grad():
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            out = torch.compile(layer, backend=counter, fullgraph=True)(
                *(mode.from_tensor(t) for t in (qb, nr.q_weight, nr.cos, nr.sin)))
    assert out.shape == () and counter.frame_count == 1
    torch._dynamo.reset()
