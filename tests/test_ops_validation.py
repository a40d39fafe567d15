"""Bad inputs raise TypeError / ValueError naming the argument, before any launch."""

import pytest
import torch

import tilegen
from tilegen import KernelConfig, Spec

SPEC = Spec(head_dim=64, dtype="fp16", grid=(4, 4, 16), num_heads=2, topk=2)  # 4 cubes


def inputs(layout="bshd", dtype=torch.float16):
    B, H, NC, D, TOPK = 1, 2, 4, 64, 2
    shape = (B, NC * 64, H, D) if layout == "bshd" else (B, H, NC * 64, D)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(3))
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]], dtype=torch.int32).expand(B, H, NC, TOPK)
    return dict(q=q, k=k, v=v, topk_idx=idx.contiguous(),
                vbs=torch.tensor([64, 32, 16, 8], dtype=torch.int32))


def call(**changes):
    args = inputs()
    args.update(changes)
    op = tilegen.load(SPEC, target=None)
    return op(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("topk_idx"),
              args.pop("vbs"), **args)


def test_valid_inputs_run_on_the_cpu_path():
    o, lse = call()
    assert o.shape == inputs()["q"].shape and o.dtype == torch.float16
    assert lse.shape == (1, 2, 256) and lse.dtype == torch.float32


@pytest.mark.parametrize("changes,exc,needle", [
    (dict(q=inputs()["q"].float()), TypeError, "q has dtype"),
    (dict(k=[1, 2]), TypeError, "k must be a torch.Tensor"),
    (dict(v=inputs()["v"][..., :32]), ValueError, "one shape"),
    (dict(q=inputs()["q"][:, :200], k=inputs()["k"][:, :200], v=inputs()["v"][:, :200]),
     ValueError, "multiple of block_q"),
    (dict(topk_idx=inputs()["topk_idx"].long()), TypeError, "topk_idx has dtype"),
    (dict(topk_idx=inputs()["topk_idx"][:, :1].contiguous()), ValueError,
     "topk_idx must have shape"),
    (dict(topk_idx=inputs()["topk_idx"] + 3), ValueError, "outside [0, NKV=4)"),
    (dict(topk_idx=inputs()["topk_idx"] - 1), ValueError, "topk_idx holds values"),
    (dict(topk_idx=torch.zeros(1, 2, 4, 5, dtype=torch.int32)), ValueError, "TOPK=5"),
    (dict(vbs=torch.tensor([64, 32, 16, 0], dtype=torch.int32)), ValueError, "vbs holds values"),
    (dict(vbs=torch.tensor([64, 32, 16, 65], dtype=torch.int32)), ValueError, "outside 1..64"),
    (dict(vbs=torch.tensor([64, 32, 16], dtype=torch.int32)), ValueError, "vbs must have shape"),
    (dict(vbs=torch.tensor([64, 32, 16, 8])), TypeError, "vbs has dtype"),
    (dict(counts=torch.full((1, 2, 4), 3, dtype=torch.int32)), ValueError, "counts holds"),
    (dict(counts=torch.full((1, 2), 1, dtype=torch.int32)), ValueError, "counts must be"),
    (dict(q=inputs()["q"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "not contiguous"),
])
def test_bad_inputs(changes, exc, needle):
    with pytest.raises(exc) as err:
        call(**changes)
    assert needle in str(err.value)


def test_head_dim_mismatch():
    op = tilegen.load(Spec(head_dim=128, dtype="fp16"), target=None)
    a = inputs()
    with pytest.raises(ValueError, match="head_dim=128"):
        op(a["q"], a["k"], a["v"], a["topk_idx"], a["vbs"])


def test_invalid_config_is_rejected_before_compiling():
    with pytest.raises(ValueError, match="block_n=48"):
        tilegen.load(SPEC, KernelConfig(block_n=48), target=None)
    with pytest.raises(ValueError, match="shared memory"):
        tilegen.load(SPEC.replace(head_dim=128), KernelConfig(num_stages=8, block_n=64),
                     target="gfx942")
    with pytest.raises(TypeError, match="tilegen.Spec"):
        tilegen.load("default")  # type: ignore[arg-type]


def test_bad_input_fails_before_anything_is_rendered_or_launched(tmp_path, monkeypatch):
    """Under the interpreter a good call renders the kernel into the cache and launches it; a
    bad one raises first, so the cache stays empty."""
    from tilegen.backends.triton import jit

    monkeypatch.setattr(jit, "_modules", {})  # nothing imported yet in this process
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="vbs holds values"):
        call(vbs=torch.tensor([64, 32, 16, 0], dtype=torch.int32))
    assert not (tmp_path / "bad").exists()
    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(tmp_path / "good"))
    call()
    assert list((tmp_path / "good").rglob("*.py"))  # the good call did render + launch


def test_device_mismatch_names_the_argument():
    a = inputs()
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        call(k=a["k"].to("meta"))
    with pytest.raises(ValueError, match="vbs is on meta"):
        call(vbs=a["vbs"].to("meta"))


def test_sm_scale_and_op_errors_name_the_argument():
    a = inputs()
    with pytest.raises(TypeError, match="sm_scale must be a float"):
        call(sm_scale="x")
    with pytest.raises(ValueError, match="sm_scale must be positive"):
        call(sm_scale=-1.0)
    from tilegen.ops import block_sparse_attention

    with pytest.raises(TypeError, match="q has dtype torch.float32"):
        block_sparse_attention(a["q"].float(), a["k"], a["v"], a["topk_idx"], a["vbs"])
    with pytest.raises(ValueError, match="layout='sbhd'"):
        block_sparse_attention(a["q"], a["k"], a["v"], a["topk_idx"], a["vbs"], layout="sbhd")


def test_backend_selection():
    from tilegen.backends.cuda.runtime import CudaBlockSparseAttention

    op = tilegen.load(Spec(), backend="cuda")  # constructed lazily: compiles on first call
    assert isinstance(op, CudaBlockSparseAttention)
    with pytest.raises(ValueError, match="backend='metal' is not allowed"):
        tilegen.load(Spec(), backend="metal")
    try:
        import hip  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="hip-python"):
            tilegen.load(Spec(), backend="hip")


def test_custom_op_takes_the_fastest_family_unless_grad_is_needed(monkeypatch):
    """A no-grad `block_sparse_attention` loads the device's fastest tuned family (backend
    None); the gradient path asks for the Triton family, the one with backward kernels."""
    import torch

    from tilegen import ops

    asked = []
    real = ops.load

    def spy(spec=None, config=None, **kw):
        asked.append(kw.get("backend"))
        return real(spec, config, **kw)

    monkeypatch.setattr(ops, "load", spy)
    monkeypatch.setattr(ops, "_ops", {})
    q = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    ops._op_for(q, "bshd")
    ops._op_for(q, "bshd", "triton")
    assert asked == [None, "triton"]


def test_duplicate_indices_are_rejected_when_values_are_checked():
    """Indices in a row must be distinct (the contract); value checks (always on the CPU,
    `check_values=True` on GPUs) reject a repeat, naming the row; slots past a row's count are
    never read, so a repeat there is fine."""
    args = inputs()
    dup = args["topk_idx"].clone()
    dup[0, 1, 2] = torch.tensor([3, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"row \(b, h, q\) = \(0, 1, 2\) holds index 3 more"):
        call(topk_idx=dup)
    counts = torch.full((1, 2, 4), 2, dtype=torch.int32)
    counts[0, 1, 2] = 1
    call(topk_idx=dup, counts=counts)


def test_nan_rows_give_nan_on_every_path(monkeypatch):
    """A NaN in q makes that row's o and lse NaN, on the kernel path (under the interpreter)
    and on the PyTorch path alike; lse = -inf stays reserved for empty rows."""
    args = inputs()
    q = args["q"].clone()
    q[0, 70, 1, 5] = float("nan")  # query cube 1, head 1
    op = tilegen.load(SPEC, target=None)
    rest = (args["k"], args["v"], args["topk_idx"], args["vbs"])
    for interp in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interp)
        o, lse = op(q, *rest)
        assert torch.isnan(o[0, 70, 1]).all() and torch.isnan(lse[0, 1, 70])
        assert torch.isfinite(o[0, 64:70, 1]).all() and torch.isfinite(lse[0, 0]).all()


def test_kernel_guards_bad_values_without_reading_out_of_bounds(monkeypatch):
    """The no-sync path: the kernel itself meets a bad index / vbs / count (no eager check, as
    on a GPU), never loads out of bounds, writes NaN into the rows it touched and sets the
    device error word; the other rows are untouched."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = inputs()
    op = tilegen.load(SPEC, target=None)
    rest = (args["q"], args["k"], args["v"])
    good, _ = op.launch(*rest, args["topk_idx"], args["vbs"])
    cases = []
    bad_idx = args["topk_idx"].clone()
    bad_idx[0, 0, 3, 1] = 10**6
    cases.append((bad_idx, args["vbs"], None, (0, 3)))
    bad_vbs = args["vbs"].clone()
    bad_vbs[2] = 0  # cube 2 is read by query cubes 1 and 2
    cases.append((args["topk_idx"], bad_vbs, None, (None, 1)))
    counts = torch.full((1, 2, 4), 2, dtype=torch.int32)
    counts[0, 1, 0] = 7
    cases.append((args["topk_idx"], args["vbs"], counts, (1, 0)))
    for idx, vbs, cnt, (head, cube) in cases:
        op.errors.buffer(torch.device("cpu")).zero_()
        o, _ = op.launch(*rest, idx, vbs, cnt)
        rows = slice(cube * 64, (cube + 1) * 64)
        heads = [head] if head is not None else [0, 1]
        for h in heads:
            assert torch.isnan(o[0, rows, h]).all()
        assert torch.equal(o[0, 3 * 64:, 1 - heads[0]] if head is not None else o[0, :64],
                           good[0, 3 * 64:, 1 - heads[0]] if head is not None else good[0, :64])
        assert int(op.errors.buffer(torch.device("cpu"))) == 1
