"""The backward pass (issue #10): dQ/dK/dV of the generated Triton backward kernels under
TRITON_INTERPRET=1, the CPU PyTorch path, the custom op's autograd and torch.compile, against
the fp32 autograd reference with the gradient rule (`captures.grad_score`).

Tiny shapes: grid 5x6x8 (8 cubes, vbs in {64, 32, 16, 8}), 2 heads, TOPK 3, head 1 an outlier
head (logits ~300). Every case also has an empty LUT row (counts 0), a KV cube that no query
cube chose, and finite garbage in the padded slots of q, k, v and dO.
"""

import pytest
import torch

import tilegen
from tilegen import KernelConfig, Spec, captures
from tilegen.backends.triton.backward import BackwardConfig, inverse_map
from tilegen.ops import block_sparse_attention
from tilegen.reference import (
    attention_backward_fp32,
    attention_fp32,
    attention_grads_fp32,
    query_valid,
)

GRID, HEADS, TOPK = (5, 6, 8), 2, 3
NCUBES = 8
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
UNCHOSEN = 5  # a KV cube no query cube selects (after `_case`)


def _slots(layout, S):
    return (1, S, 1, 1) if layout == "bshd" else (1, 1, S, 1)


def _case(seed, head_dim, dtype, layout, counts=True):
    cap = captures.synthesize(seed=seed, grid=GRID, heads=HEADS, head_dim=head_dim, topk=TOPK,
                              dtype=DTYPES[dtype], outlier=[1])
    idx = cap["topk_idx"].clone()
    # drop cube UNCHOSEN from every row: replace it by a cube the row does not hold
    for b, h, qc, _ in (idx == UNCHOSEN).nonzero().tolist():
        row = idx[b, h, qc].tolist()
        idx[b, h, qc, row.index(UNCHOSEN)] = next(
            c for c in range(NCUBES) if c not in row and c != UNCHOSEN)
    cap["topk_idx"] = idx
    g = torch.Generator().manual_seed(seed)
    cap["counts"] = None
    if counts:
        cnt = torch.randint(1, TOPK + 1, idx.shape[:3], generator=g, dtype=torch.int32)
        cnt[0, 0, 2] = 0  # an empty row
        cnt[0, 1, 3] = 0  # one in the outlier head too
        cap["counts"] = cnt
    if layout == "bhsd":
        for key in ("q", "k", "v"):
            cap[key] = cap[key].transpose(1, 2).contiguous()
    S = NCUBES * 64
    cap["real"] = query_valid(cap["vbs"], S, 64, torch.device("cpu")).view(_slots(layout, S))
    cap["do"] = torch.randn(cap["q"].shape, generator=g).to(cap["q"].dtype)
    return cap


def _garbage(cap, seed):
    """q, k, v, dO with fresh finite random values in every padded slot."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for key in ("q", "k", "v", "do"):
        x = cap[key]
        noise = (torch.randn(x.shape, generator=g) * 4).to(x.dtype)
        out.append(torch.where(cap["real"], x, noise))
    return out


def _spec(head_dim, dtype, layout):
    return Spec(head_dim=head_dim, dtype=dtype, layout=layout, grid=GRID, num_heads=HEADS,
                topk=TOPK)


def _run(op, q, k, v, do, cap):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = op(q, k, v, cap["topk_idx"], cap["vbs"], cap["counts"], return_lse=False)
    o.backward(do)
    return q.grad, k.grad, v.grad


def _reference(cap, layout):
    return attention_grads_fp32(cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"],
                                cap["counts"], cap["do"], layout=layout)


CASES = [  # (seed, head_dim, dtype, layout, backward config)
    (0, 64, "bf16", "bshd", BackwardConfig()),
    (1, 128, "bf16", "bhsd", BackwardConfig()),
    (2, 64, "fp16", "bhsd", BackwardConfig(dq_block_m=32, dq_block_n=32, dkdv_block_n=32,
                                           dkdv_block_m=32, pre_block_m=32)),
    (3, 128, "fp16", "bshd", BackwardConfig(dq_block_n=32, dkdv_block_m=16)),
    # the variant whose dK/dV kernel also adds dQ atomically (no dQ kernel)
    (7, 64, "bf16", "bshd", BackwardConfig(dq_atomic=True)),
    (8, 128, "fp16", "bhsd", BackwardConfig(dq_atomic=True, dkdv_block_n=32, dkdv_block_m=32)),
    # packed tiles: partial cubes of one size class share a tile (dQ's keys, dK/dV's queries)
    (4, 64, "bf16", "bshd", BackwardConfig(dq_pack=True, dkdv_pack=True)),
    (5, 128, "fp16", "bhsd", BackwardConfig(dkdv_pack=True, dq_atomic=True, dq_block_m=32)),
    (6, 64, "bf16", "bhsd", BackwardConfig(dq_pack=True, dkdv_block_n=32)),
]


@pytest.mark.parametrize("seed,head_dim,dtype,layout,bcfg", CASES)
def test_backward_kernels_pass_the_gradient_rule(interpreter, seed, head_dim, dtype, layout,
                                                 bcfg):
    cap = _case(seed, head_dim, dtype, layout)
    op = tilegen.load(_spec(head_dim, dtype, layout), KernelConfig(), target=None)
    op.backward_config = bcfg
    ref = _reference(cap, layout)
    q, k, v, do = _garbage(cap, seed=100 + seed)
    grads = _run(op, q, k, v, do, cap)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        s = captures.grad_score(g, r, layout=layout)
        assert s.passed, f"{name}: {s}"
        assert g.dtype == cap["q"].dtype
        # padded slots come out zero
        assert not torch.where(cap["real"], 0, g.float()).any(), name
    dk, dv = grads[1:]
    unchosen = slice(UNCHOSEN * 64, (UNCHOSEN + 1) * 64)
    for g in (dk, dv):
        part = g[:, unchosen] if layout == "bshd" else g[:, :, unchosen]
        assert not part.any()  # no query cube chose it: exactly zero
    # other garbage in the padded slots: the same real gradients, bit for bit (the atomic
    # variant's dQ sums in a run-dependent order: equal to rounding)
    again = _run(op, *_garbage(cap, seed=200 + seed), cap)
    for g, g2 in zip(grads, again, strict=True):
        a, b = torch.where(cap["real"], g, 0), torch.where(cap["real"], g2, 0)
        assert torch.equal(a, b) or (bcfg.dq_atomic and torch.allclose(a, b, atol=1e-3))


def test_outlier_head_is_one_and_empty_rows_give_zero_dq(interpreter):
    cap = _case(0, 64, "bf16", "bshd")
    _, lse = attention_fp32(cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"],
                            cap["counts"])
    assert lse[:, 1][torch.isfinite(lse[:, 1])].max() > 128  # logits ~300 (natural units)
    op = tilegen.load(_spec(64, "bf16", "bshd"), KernelConfig(), target=None)
    dq, _, _ = _run(op, cap["q"], cap["k"], cap["v"], cap["do"], cap)
    assert not dq[0, 2 * 64:3 * 64, 0].any() and not dq[0, 3 * 64:4 * 64, 1].any()


def test_cpu_pytorch_path_gives_the_reference_gradients(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cap = _case(4, 64, "bf16", "bshd")
    args = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"], cap["counts"])
    ref = _reference(cap, "bshd")
    explicit = attention_backward_fp32(*args, cap["do"])
    for a, r in zip(explicit, ref, strict=True):  # the explicit formulas are autograd's function
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4)
    op = tilegen.load(_spec(64, "bf16", "bshd"), target=None)
    q, k, v, do = _garbage(cap, seed=7)
    for grads in (_run(op, q, k, v, do, cap),
                  _run(block_sparse_attention, q, k, v, do, cap)):
        for g, r in zip(grads, ref, strict=True):
            assert captures.grad_score(g, r).passed


@pytest.mark.parametrize("path", ["interpreter", "pytorch"])
def test_gradient_through_lse(monkeypatch, path):
    """A loss that uses lse too (return_lse=True): d lse folds into delta."""
    monkeypatch.setenv("TRITON_INTERPRET", "1" if path == "interpreter" else "0")
    cap = _case(5, 64, "fp16", "bshd")
    q, k, v = (cap[x].clone().requires_grad_(True) for x in "qkv")
    o, lse = block_sparse_attention(q, k, v, cap["topk_idx"], cap["vbs"], cap["counts"],
                                    return_lse=True)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(3))
    finite = torch.isfinite(lse)
    loss = (o.float() * cap["do"].float()).sum() + torch.where(finite, lse * dlse, 0).sum()
    loss.backward()
    ref = attention_grads_fp32(cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"],
                               cap["counts"], cap["do"], dlse)
    for g, r in zip((q.grad, k.grad, v.grad), ref, strict=True):
        s = captures.grad_score(g, r)
        assert s.passed, str(s)


def test_delta_from_the_rounding_residual(interpreter):
    """The training forward keeps O's rounding residual in 16 bits (half the fp32 O's bytes):
    o + residual carries O to ~16 bits, so the backward from (o, o_lo) matches the one from the
    fp32 O to well inside the gradient rule, where o alone (delta from the rounded O) does not
    come as close."""
    from tilegen.backends.triton.op import residual_of

    cap = _case(9, 64, "bf16", "bshd")
    op = tilegen.load(_spec(64, "bf16", "bshd"), target=None)
    args = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"], cap["counts"])
    o, lse, o_acc = op.forward_for_grad(*args, residual=True)
    assert o_acc.dtype == torch.float32  # the Triton kernels write the fp32 O; callers convert
    o_lo = residual_of(o, o_acc)
    assert o_lo.dtype == o.dtype
    real = cap["real"].expand_as(o)
    assert torch.allclose((o.float() + o_lo.float())[real], o_acc[real], rtol=2 ** -14,
                          atol=1e-30)
    rest = (cap["topk_idx"], cap["vbs"], cap["counts"])
    fp32 = op.launch_backward(cap["do"], *args[:3], o_acc, lse, *rest)
    split = op.launch_backward(cap["do"], *args[:3], o, lse, *rest, o_lo=o_lo)
    rounded = op.launch_backward(cap["do"], *args[:3], o, lse, *rest)
    for a, b, c in zip(fp32, split, rounded, strict=True):
        scale = a.float().abs().max()
        gap = (a.float() - b.float()).abs().max() / scale
        assert gap <= 2e-3, gap
        assert gap <= (a.float() - c.float()).abs().max() / scale


def test_unused_outputs_reach_the_backward_as_none(interpreter, monkeypatch):
    """A loss on o alone hands the backward no dlse (not a zero tensor, which would take the dQ
    kernels' HAS_DSUM path), and the training forward's fp32 output gets no zero gradient of
    its size; a loss on lse alone still reaches q and k (do = 0)."""
    from tilegen.backends.triton.op import BlockSparseAttention

    seen = []
    real_backward = BlockSparseAttention.backward

    def spy(self, do, *args, **kwargs):
        seen.append((do, kwargs.get("dlse")))
        return real_backward(self, do, *args, **kwargs)

    monkeypatch.setattr(BlockSparseAttention, "backward", spy)
    cap = _case(8, 64, "bf16", "bshd")
    q, k, v = (cap[x].clone().requires_grad_(True) for x in "qkv")
    o, lse = block_sparse_attention(q, k, v, cap["topk_idx"], cap["vbs"], cap["counts"],
                                    return_lse=True)
    (o.float() * cap["do"].float()).sum().backward()
    assert len(seen) == 1 and seen[0][1] is None and seen[0][0] is not None
    q.grad = k.grad = v.grad = None
    o, lse = block_sparse_attention(q, k, v, cap["topk_idx"], cap["vbs"], cap["counts"],
                                    return_lse=True)
    torch.where(torch.isfinite(lse), lse, 0).sum().backward()
    assert seen[1][1] is not None and not seen[1][0].any()
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_step(interpreter, backend):
    """torch.compile(fullgraph=True) traces forward and backward of a step through the op."""
    cap = _case(6, 64, "bf16", "bshd", counts=False)
    torch.manual_seed(0)
    proj = torch.nn.Linear(64, 64, dtype=torch.bfloat16)

    def step(q, k, v):  # AOTAutograd traces the backward graph when it compiles this
        o = block_sparse_attention(q, k, v, cap["topk_idx"], cap["vbs"])
        return proj(o).float().square().mean()

    def grads(fn):
        proj.zero_grad()
        q, k, v = (cap[x].clone().requires_grad_(True) for x in "qkv")
        loss = fn(q, k, v)
        loss.backward()
        return [loss, q.grad, k.grad, v.grad, proj.weight.grad.clone()]

    eager = grads(step)
    torch._dynamo.reset()
    compiled = grads(torch.compile(step, fullgraph=True, backend=backend))
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


def test_inverse_map_matches_the_lut():
    g = torch.Generator().manual_seed(0)
    B, H, NQ, NKV, TOPK = 2, 3, 5, 7, 4
    idx = torch.stack([torch.randperm(NKV, generator=g)[:TOPK] for _ in range(B * H * NQ)])
    idx = idx.view(B, H, NQ, TOPK).int()
    counts = torch.randint(0, TOPK + 1, (B, H, NQ), generator=g, dtype=torch.int32)
    idx[0, 0, 0, 0] = NKV + 3  # out of range: left out (the dQ kernel flags it)
    counts[0, 0, 0] = TOPK
    offsets, qcubes = inverse_map(idx, counts, NKV)
    assert offsets.dtype == qcubes.dtype == torch.int32
    for b in range(B):
        for h in range(H):
            for c in range(NKV):
                i = (b * H + h) * NKV + c
                got = qcubes[offsets[i]:offsets[i + 1]].tolist()
                want = [q for q in range(NQ)
                        if c in idx[b, h, q, :counts[b, h, q]].tolist()]
                assert got == want


def test_families_without_backward_hand_gradient_calls_to_triton(monkeypatch, caplog):
    """Gradients flow on every path (the contract): a family with no backward kernels (here the
    CUDA C++ op, built on this CPU machine) runs a call that needs gradients through the Triton
    family's differentiable op, and says so once; the gradients equal the Triton op's."""
    import logging

    from tilegen import backends

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU PyTorch path of the Triton family
    cap = _case(3, 64, "fp16", "bshd")
    spec = Spec(head_dim=64, dtype="fp16", grid=GRID, num_heads=HEADS, topk=TOPK)
    cuda_op = backends.get("cuda").make_op(spec, None, None)
    triton_op = backends.get("triton").make_op(spec, tilegen.config.reference_config(spec), None)
    grads = []
    for op in (cuda_op, triton_op):
        q, k, v = (cap[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
        with caplog.at_level(logging.INFO, logger="tilegen"):
            o = op(q, k, v, cap["topk_idx"], cap["vbs"], cap["counts"], return_lse=False)
        o.float().sum().backward()
        grads.append((q.grad, k.grad, v.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
    said = "cuda family hands calls that need gradients to the Triton family's op"
    assert any(said in r.getMessage() for r in caplog.records)


def test_backward_ops_are_registered_with_fakes(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cap = _case(9, 64, "bf16", "bshd")
    base = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"], cap["counts"])
    train = torch.ops.tilegen.block_sparse_attention_for_grad.default
    torch.library.opcheck(train, (*base, "bshd", None),
                          test_utils=("test_schema", "test_faketensor"))
    o, lse, o_acc = train(*base, "bshd", None)
    bwd = torch.ops.tilegen.block_sparse_attention_backward.default
    torch.library.opcheck(bwd, (cap["do"], *base[:3], o_acc, lse, *base[3:], None, "bshd", None),
                          test_utils=("test_schema", "test_faketensor"))
    # the public op called directly with return_lse=False still has a backward
    q = cap["q"].clone().requires_grad_(True)
    o, _ = torch.ops.tilegen.block_sparse_attention(q, *base[1:], "bshd", None, False)
    o.backward(cap["do"])
    assert captures.grad_score(q.grad, _reference(cap, "bshd")[0]).passed


def test_packed_tiles_hold_every_entry_once_and_save_tiles():
    """`packed_inverse_map` / `packed_lut`: the tiles of each owner cover its cubes exactly once,
    cubes of one size class share a tile, and a bad index gives the row count -1."""
    from tilegen.backends.triton.backward import packed_inverse_map, packed_lut

    cap = _case(0, 64, "bf16", "bshd")
    idx, vbs, counts = cap["topk_idx"], cap["vbs"], cap["counts"]
    n_tiles = n_cubes = 0
    for packed, lists in (
            (packed_inverse_map(idx, counts, vbs, NCUBES, 64),
             [[qc for qc in range(NCUBES) if c in idx[0, h, qc, :counts[0, h, qc]].tolist()]
              for h in range(HEADS) for c in range(NCUBES)]),
            (packed_lut(idx, counts, vbs, NCUBES, 64),
             [idx[0, h, qc, :counts[0, h, qc]].tolist()
              for h in range(HEADS) for qc in range(NCUBES)])):
        for o, want in enumerate(lists):
            first = int(packed.offsets[o])
            seen = []
            for t in range(first, first + int(packed.count[o])):
                start, meta = int(packed.tile_start[t]), int(packed.tile_meta[t])
                lg, n = meta & 255, meta >> 8
                cubes = packed.items[start:start + n].tolist()
                assert n * (1 << lg) <= 64 and all(int(vbs[c]) <= 1 << lg for c in cubes)
                seen += cubes
            assert sorted(seen) == sorted(want)
        n_tiles += int(packed.count.sum())
        n_cubes += sum(len(w) for w in lists)
    assert n_tiles < n_cubes  # partial cubes shared tiles
    bad = idx.clone()
    bad[0, 1, 4, 0] = NCUBES  # out of range
    lut = packed_lut(bad, None, vbs, NCUBES, 64)
    assert int(lut.count[NCUBES + 4]) == -1 and int(lut.count[4]) >= 0
