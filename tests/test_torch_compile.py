"""`tilegen.ops.block_sparse_attention` is a torch.library custom op that torch.compile traces."""

import pytest
import torch

from tilegen import captures
from tilegen.ops import block_sparse_attention
from tilegen.reference import attention_fp32


class TinyBlock(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim, dtype=torch.bfloat16)

    def forward(self, q, k, v, idx, vbs):
        o = block_sparse_attention(q, k, v, idx, vbs)
        return self.proj(o) + q


def _cap():
    return captures.synthesize(seed=0, grid=(5, 6, 8), heads=2, head_dim=64, topk=3)


def test_op_is_registered_with_a_fake():
    assert hasattr(torch.ops.tilegen, "block_sparse_attention")
    cap = _cap()
    args = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"], None, "bshd", None)
    torch.library.opcheck(torch.ops.tilegen.block_sparse_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.tilegen.block_sparse_attention.default, (*args, False),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_traces_the_op(backend):
    torch.manual_seed(0)
    cap = _cap()
    args = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"])
    model = TinyBlock(64)
    eager = model(*args)
    compiled = torch.compile(model, fullgraph=True, backend=backend)(*args)
    torch.testing.assert_close(compiled, eager)
    o, lse = block_sparse_attention(*args, return_lse=True)
    o32, lse32 = attention_fp32(*args)
    assert captures.score(o, o32.to(o.dtype)).passed
    torch.testing.assert_close(lse, lse32)
