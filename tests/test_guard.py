"""The device-side value guard of the C++ families (`tilegen.guard`), run under Triton's
interpreter: which rows it marks, the counts it lets the kernel walk, the error word, and the
NaN it writes into a marked row's outputs (and nowhere else). The kernel between the two passes
runs in tests/test_hip_backend.py (the HIP source on the CPU executor)."""

from __future__ import annotations

import pytest
import torch

from tilegen import Spec
from tilegen.guard import ValueGuard
from tilegen.inputs import Shapes

B, H, NQ, TOPK = 1, 2, 6, 3


def _lut(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(NQ, generator=g)[:TOPK] for _ in range(B * H * NQ)])
    idx = idx.view(B, H, NQ, TOPK).to(torch.int32)
    counts = torch.randint(0, TOPK + 1, (B, H, NQ), generator=g, dtype=torch.int32)
    vbs = torch.tensor([64, 32, 64, 16, 8, 64], dtype=torch.int32)
    return idx, counts, vbs


def _shapes(head_dim: int = 64) -> Shapes:
    return Shapes(B, NQ * 64, H, head_dim, NQ, NQ, TOPK)


@pytest.mark.parametrize("seed", [0, 1])
def test_guard_marks_exactly_the_rows_with_a_bad_value(seed):
    idx, counts, vbs = _lut(seed)
    counts[0, 0, :4] = TOPK  # rows walked in full, so their injected entries are read
    idx[0, 0, 0, 1] = -1  # index below 0
    idx[0, 0, 1, 2] = NQ  # index past NKV
    counts[0, 1, 0] = -1  # count below 0
    counts[0, 1, 1] = TOPK + 1  # count past TOPK
    idx[0, 0, 5, TOPK - 1] = NQ + 7  # past its count when counts[0, 0, 5] < TOPK: not read
    counts[0, 0, 5] = TOPK - 1
    vbs_bad = vbs.clone()
    vbs_bad[3] = 0  # cube 3: every row that walks it is bad
    guard = ValueGuard(Spec(head_dim=64))
    walk, marks = guard.before(idx, vbs_bad, counts, _shapes())
    expect = torch.zeros(B, H, NQ, dtype=torch.bool)
    for h in range(H):
        for q in range(NQ):
            n = int(counts[0, h, q])
            if not 0 <= n <= TOPK:
                expect[0, h, q] = True
                continue
            row = idx[0, h, q, :n].tolist()
            expect[0, h, q] = any(not 0 <= c < NQ for c in row) or any(
                int(vbs_bad[c]) == 0 for c in row if 0 <= c < NQ)
    assert torch.equal(marks.bool(), expect)
    assert expect[0, 0, 0] and expect[0, 0, 1] and expect[0, 1, 0] and expect[0, 1, 1]
    assert torch.equal(walk, torch.where(expect, 0, counts))
    word = int(guard.errors.buffer(idx.device))
    assert word & 1 and word & 4 and bool(word & 2) == any(
        3 in idx[0, h, q, :int(counts[0, h, q])].tolist()
        for h in range(H) for q in range(NQ) if 0 <= int(counts[0, h, q]) <= TOPK)
    with pytest.raises(ValueError, match="bad value") as err:
        guard.check()
    said = str(err.value)  # the kinds it met, by name
    assert "topk_idx entry outside" in said and "count outside" in said
    assert ("vbs entry" in said) == bool(word & 2)
    guard.check()  # raised once: the word is cleared


def test_error_names_only_the_kinds_met():
    idx, counts, vbs = _lut(4)
    counts[0, 1, 3] = TOPK + 2
    guard = ValueGuard(Spec(head_dim=64))
    guard.before(idx, vbs, counts, _shapes())
    with pytest.raises(ValueError, match="bad value") as err:
        guard.check()
    assert "count outside 0..TOPK" in str(err.value)
    assert "topk_idx entry" not in str(err.value) and "vbs entry" not in str(err.value)


def test_guard_without_counts_walks_topk_and_good_inputs_raise_nothing():
    idx, _, vbs = _lut(2)
    guard = ValueGuard(Spec(head_dim=64))
    walk, marks = guard.before(idx, vbs, None, _shapes())
    assert (walk == TOPK).all() and not marks.any()
    guard.check()


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_post_pass_poisons_only_marked_rows(layout):
    spec = Spec(head_dim=64, layout=layout)
    shapes = _shapes()
    g = torch.Generator().manual_seed(3)
    shape = (B, NQ * 64, H, 64) if layout == "bshd" else (B, H, NQ * 64, 64)
    o = torch.randn(shape, generator=g).to(torch.bfloat16)
    lse = torch.randn(B, H, NQ * 64, generator=g)
    mp = (torch.rand(B, H, NQ * 64, generator=g), torch.rand(B, H, NQ, generator=g))
    marks = torch.zeros(B, H, NQ, dtype=torch.int8)
    marks[0, 1, 2] = marks[0, 0, 5] = 1
    before = [t.clone() for t in (o, lse, *mp)]
    ValueGuard(spec).after(marks, o, lse, mp, shapes)
    o_bhsd = (o if layout == "bhsd" else o.transpose(1, 2)).float()
    o0 = (before[0] if layout == "bhsd" else before[0].transpose(1, 2)).float()
    bad_tokens = marks.bool().repeat_interleave(64, dim=2)  # (B, H, S)
    assert o_bhsd[bad_tokens].isnan().all() and torch.equal(o_bhsd[~bad_tokens], o0[~bad_tokens])
    assert lse[bad_tokens].isnan().all() and torch.equal(lse[~bad_tokens], before[1][~bad_tokens])
    assert mp[0][bad_tokens].isnan().all()
    assert torch.equal(mp[0][~bad_tokens], before[2][~bad_tokens])
    assert mp[1][marks.bool()].isnan().all()
    assert torch.equal(mp[1][~marks.bool()], before[3][~marks.bool()])
    ValueGuard(spec).after(torch.zeros_like(marks), o, None, None, shapes)  # nothing marked
