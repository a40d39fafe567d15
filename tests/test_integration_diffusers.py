"""`tilegen.integrations.diffusers` on a tiny random diffusers WanTransformer3DModel, on the CPU:
2 layers, 2 heads of 64, a latent of 8x16x16 with patch (1, 2, 2), so the grid is 8x8x8 (8 cubes
of 64 tokens). The references are diffusers' own processors (SDPA)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tilegen.integrations import diffusers as tgd  # noqa: E402

CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4,
              out_channels=4, text_dim=32, freq_dim=32, ffn_dim=256, num_layers=2,
              rope_max_seq_len=64)


def tiny(dtype=torch.float32, seed=0, **overrides):
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(**{**CONFIG, **overrides}).eval()
    return model.to(dtype)


def call(seed=1, latent=(8, 16, 16), timestep=500.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 4, *latent, generator=g).to(dtype),
                timestep=torch.tensor([timestep]),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=g).to(dtype))


def run(model, kwargs):
    with torch.no_grad():
        return model(**kwargs, return_dict=False)[0].float()


def rel_l1(a, b):
    return float((a - b).abs().sum() / b.abs().sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("latent", [(8, 16, 16), (6, 14, 18)], ids=["whole", "partial"])
def test_every_cube_reproduces_sdpa(dtype, latent):
    """sparsity=0 keeps every cube: the transformer's output is the SDPA model's within bf16
    tolerance, whole-cube and partial-edge grids (6x7x9: cubes of 4x4x4 cut at every face)."""
    model, kwargs = tiny(dtype), call(latent=latent, dtype=dtype)
    ref = run(model, kwargs)
    tgd.enable_block_sparse(model, sparsity=0.0)
    assert all(isinstance(b.attn1.processor, tgd.BlockSparseWanAttnProcessor)
               for b in model.blocks)
    assert all(not isinstance(b.attn2.processor, tgd.BlockSparseWanAttnProcessor)
               for b in model.blocks)
    out = run(model, kwargs)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel_l1(out, ref) < 1e-2, rel_l1(out, ref)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
    tgd.enable_block_sparse(model, topk=10_000)  # clamped to the cube count: the same call
    torch.testing.assert_close(run(model, kwargs), out, atol=0, rtol=0)


def test_sparse_is_finite_differs_and_disable_restores_bit_for_bit():
    model, kwargs = tiny(), call()
    ref = run(model, kwargs)
    originals = [b.attn1.processor for b in model.blocks]
    tgd.enable_block_sparse(model)  # 87.5% of 8 cubes: one KV cube per query cube
    sparse = run(model, kwargs)
    assert torch.isfinite(sparse).all()
    assert 0 < rel_l1(sparse, ref) < 1
    tgd.disable_block_sparse(model)
    assert [b.attn1.processor for b in model.blocks] == originals
    assert torch.equal(run(model, kwargs), ref)
    assert not model._forward_pre_hooks  # the grid hook is gone too


def test_per_layer_rel_l1_is_reported_at_87_5_percent():
    model = tiny()
    plan = tgd.calibrate(model, [call(1), call(2, timestep=300.0)], rel_l1=1.0)
    assert [layer.index for layer in plan.layers] == [0, 1]
    for layer in plan.layers:
        assert layer.sparsity == 0.875 and layer.topk == 1
        assert 0 < layer.rel_l1 < 1 and 0 < layer.cosine < 1
    assert plan.grid == (8, 8, 8) and plan.calibration_calls == 2
    # calibration leaves diffusers' processors in place
    assert not any(isinstance(b.attn1.processor, tgd.BlockSparseWanAttnProcessor)
                   for b in model.blocks)


def test_calibration_keeps_a_failing_layer_dense_and_takes_the_sparsest_passing():
    model = tiny()
    plan = tgd.calibrate(model, call(), rel_l1=1.0, sparsity=[0.875, 0.5],
                         layer_gates={1: 0.0})
    assert plan.layers[0].sparsity == 0.875 and not plan.layers[0].dense
    assert plan.layers[1].dense and plan.layers[1].topk is None
    # the least sparse candidate is what a dense layer reports: 50% keeps 4 of 8 cubes
    assert plan.layers[1].rel_l1 > 0
    tgd.enable_block_sparse(model, plan=plan)
    procs = [b.attn1.processor for b in model.blocks]
    assert isinstance(procs[0], tgd.BlockSparseWanAttnProcessor) and procs[0].sparsity == 0.875
    assert not isinstance(procs[1], tgd.BlockSparseWanAttnProcessor)


def test_plan_round_trips_and_refuses_another_config(tmp_path):
    model = tiny()
    plan = tgd.calibrate(model, call(), rel_l1=1.0, sparsity=[0.875, 0.5])
    path = plan.save(tmp_path / "plan.json")
    loaded = tgd.SparsityPlan.load(path)
    assert loaded == plan
    data = json.loads(path.read_text())
    assert data["model"] == "WanTransformer3DModel" and data["grid"] == [8, 8, 8]
    assert data["tilegen_version"] and data["config"]["num_attention_heads"] == 2
    tgd.enable_block_sparse(model, plan=path)  # a path works too
    out = run(model, call())
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="another transformer config.*ffn_dim"):
        tgd.enable_block_sparse(tiny(ffn_dim=128), plan=plan)
    with pytest.raises(ValueError, match="not both"):
        tgd.enable_block_sparse(model, plan=plan, sparsity=0.5)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a tilegen sparsity plan"):
        tgd.SparsityPlan.load(tmp_path / "bad.json")


def test_dense_layers_and_dense_steps():
    model, kwargs = tiny(), call()
    ref = run(model, kwargs)
    tgd.enable_block_sparse(model, dense_layers=(-1,), dense_steps={0})
    assert isinstance(model.blocks[0].attn1.processor, tgd.BlockSparseWanAttnProcessor)
    assert not isinstance(model.blocks[1].attn1.processor, tgd.BlockSparseWanAttnProcessor)
    # step 0 (the first timestep, twice as CFG calls it) runs dense: diffusers' output exactly
    assert torch.equal(run(model, kwargs), ref)
    assert torch.equal(run(model, kwargs), ref)
    later = run(model, {**kwargs, "timestep": torch.tensor([400.0])})  # step 1: sparse
    tgd.disable_block_sparse(model)
    dense_later = run(model, {**kwargs, "timestep": torch.tensor([400.0])})
    assert not torch.equal(later, dense_later)
    tgd.enable_block_sparse(model, dense_steps={0})
    run(model, {**kwargs, "timestep": torch.tensor([400.0])})
    # a timestep above the last one starts a new generation at step 0
    assert torch.equal(run(model, kwargs), ref)


def test_gradients_reach_the_weights():
    model, kwargs = tiny(), call()
    tgd.enable_block_sparse(model)
    out = model(**kwargs, return_dict=False)[0]
    out.square().mean().backward()
    grads = [model.blocks[i].attn1.to_q.weight.grad for i in range(2)]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_compile_has_no_graph_break():
    """torch.compile of the whole transformer with tilegen's processors: one graph
    (fullgraph=True raises on any break) and the eager output."""
    from torch._dynamo.utils import counters

    model, kwargs = tiny(), call()
    tgd.enable_block_sparse(model)
    eager = run(model, kwargs)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = compiled(**kwargs, return_dict=False)[0].float()
    assert not counters["graph_break"]
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_record_inputs_and_errors():
    model = tiny()
    with tgd.record_inputs(model, max_calls=2) as calls:
        for seed in (1, 2, 3):
            run(model, call(seed))
    assert len(calls) == 2 and set(calls[0]) == {"hidden_states", "timestep",
                                                 "encoder_hidden_states"}
    assert not model._forward_pre_hooks
    with pytest.raises(NotImplementedError, match=r"quant='int8': no kernel computes this"):
        tgd.enable_block_sparse(model, quant="int8")
    with pytest.raises(ValueError, match="quant='int4' is not allowed"):
        tgd.enable_block_sparse(model, quant="int4")
    with pytest.raises(ValueError, match="selector"):
        tgd.enable_block_sparse(model, selector="cosine")
    with pytest.raises(ValueError, match="sparsity must be"):
        tgd.enable_block_sparse(model, sparsity=1.0)
    with pytest.raises(ValueError, match="not both"):
        tgd.enable_block_sparse(model, sparsity=0.5, topk=2)
    with pytest.raises(ValueError, match="dense_layers"):
        tgd.enable_block_sparse(model, dense_layers=(2,))
    with pytest.raises(TypeError, match="WanTransformer3DModel"):
        tgd.enable_block_sparse(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="64-token cubes"):
        tgd.enable_block_sparse(model, cube=(2, 4, 4))
    assert not hasattr(model, tgd._STATE_ATTR)  # nothing half-installed by a refused call
    tgd.enable_block_sparse(model)
    with pytest.raises(RuntimeError, match="grid is unknown"):
        model.blocks[0](torch.randn(1, 512, 128), torch.randn(1, 8, 128),
                        torch.randn(1, 6, 128), None)


def test_topk_for():
    assert tgd.topk_for(0.875, 624) == 78
    assert tgd.topk_for(0.0, 8) == 8
    assert tgd.topk_for(0.999, 8) == 1


def test_calibrate_command(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path / "model")
    torch.save([call(1), call(2, timestep=250.0)], tmp_path / "calls.pt")
    out = tmp_path / "plan.json"
    res = subprocess.run(
        [sys.executable, "-m", "tilegen.cli", "calibrate", str(tmp_path / "model"),
         "--inputs", str(tmp_path / "calls.pt"), "--out", str(out), "--dtype", "fp32",
         "--rel-l1", "1.0", "--sparsity", "0.875", "--sparsity", "0.5"],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "call 2/2" in res.stderr
    assert "rel-L1 (worst)" in res.stdout and "2/2 layers sparse" in res.stdout
    plan = tgd.SparsityPlan.load(out)
    assert [layer.sparsity for layer in plan.layers] == [0.875, 0.875]
    tgd.enable_block_sparse(model, plan=out)
    bad = subprocess.run([sys.executable, "-m", "tilegen.cli", "calibrate", str(tmp_path),
                          "--inputs", str(tmp_path / "calls.pt"), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "cannot load a WanTransformer3DModel" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_a_plan_brings_its_cube_and_refuses_another(tmp_path):
    model = tiny()
    plan = tgd.calibrate(model, call(), rel_l1=1.0, cube=(2, 4, 8))
    assert plan.cube == (2, 4, 8)
    tgd.enable_block_sparse(model, plan=plan)
    assert getattr(model, tgd._STATE_ATTR).cube == (2, 4, 8)
    assert torch.isfinite(run(model, call())).all()
    with pytest.raises(ValueError, match="calibrated on cubes"):
        tgd.enable_block_sparse(model, plan=plan, cube=(4, 4, 4))
    with pytest.raises(ValueError, match="64-token cubes"):
        tgd.calibrate(model, call(), cube=(2, 2, 2))
    bad = plan.to_dict()
    bad["layers"][1]["sparsity"] = 1.7
    with pytest.raises(ValueError, match="plan layer 1's sparsity"):
        tgd.SparsityPlan.from_dict(bad)


def test_a_quantized_copy_takes_the_same_plan():
    model = tiny()
    plan = tgd.calibrate(model, call(), rel_l1=1.0)
    quantized = tiny()
    quantized.register_to_config(quantization_config=object())  # e.g. a BitsAndBytesConfig
    plan.check_applies_to(quantized)
    assert "quantization_config" not in tgd._model_config(quantized)


def test_recorded_calls_are_copies():
    model = tiny()
    kwargs = call()
    with tgd.record_inputs(model) as calls:
        run(model, kwargs)
    kwargs["hidden_states"].zero_()
    assert calls[0]["hidden_states"].abs().sum() > 0


def test_the_8bit_processor_runs_where_its_kernel_does_and_says_why_elsewhere():
    """``quant="int8_fp8"`` routes the sparse layers to `block_sparse_attention_8bit`: on this
    CPU its Hopper kernel cannot load, and the call says so in one line (no silent fallback to
    the bf16 op); disabling restores diffusers' output bit for bit. (The H200 runs it:
    bench/experiments/h200_quant_op.py and the 8-bit op's checks.)"""
    model = tiny()
    want = run(model, call())
    tgd.enable_block_sparse(model, quant="int8_fp8", sparsity=0.5)
    with pytest.raises(ValueError, match="quant='int8_fp8': the 8-bit kernel needs a target "
                                         "with Hopper's wgmma"):
        run(model, call())
    tgd.disable_block_sparse(model)
    assert torch.equal(run(model, call()), want)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_prologue_is_diffusers_norm_and_rotation(dtype, monkeypatch):
    """Without gradients, a bf16/fp16 layer's q/k norm and rotation run through
    `tilegen.prologue` (the custom op); its q, k equal diffusers' modules' within one ulp, the
    transformer's output stays within the model's tolerance, and recording gradients (or an fp32
    model) takes diffusers' modules."""
    from tilegen import prologue

    model, kwargs = tiny(dtype), call(dtype=dtype)
    model.rope.float()  # as from_pretrained(torch_dtype=...) keeps it: fp32 tables
    tgd.enable_block_sparse(model, sparsity=0.0)
    calls = []
    inner = prologue.rms_norm_rope
    monkeypatch.setattr(prologue, "rms_norm_rope", lambda *a: calls.append(1) or inner(*a))
    fused = run(model, kwargs)
    assert len(calls) == len(model.blocks)
    monkeypatch.setattr(tgd, "_fused_prologue_applies", lambda *a: False)
    unfused = run(model, kwargs)
    assert len(calls) == len(model.blocks)
    torch.testing.assert_close(fused, unfused, atol=2e-2, rtol=2e-2)
    monkeypatch.undo()

    attn = model.blocks[0].attn1
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, 64, attn.inner_dim, generator=g).to(dtype)
    rotary = model.rope(kwargs["hidden_states"][:, :, :1, :16, :16])
    with torch.no_grad():
        assert tgd._fused_prologue_applies(attn, attn.to_q(hidden), rotary)
        q, k, v, none = tgd._project(attn, hidden, rotary)
        # deferred (the 8-bit layers): the projections and the prologue as data, which gives
        # the same q and k
        qr, kr, vr, norm_rope = tgd._project(attn, hidden, rotary, defer_prologue=True)
        assert none is None and torch.equal(vr, v)
        assert torch.equal(qr, attn.to_q(hidden).unflatten(2, (attn.heads, -1)))
        for a, b in zip(norm_rope.apply_torch(qr, kr), (q, k), strict=True):
            assert torch.equal(a, b)
        monkeypatch.setattr(tgd, "_fused_prologue_applies", lambda *a: False)
        q0, k0, v0, none = tgd._project(attn, hidden, rotary, defer_prologue=True)
        assert none is None
    assert torch.equal(v, v0)
    for a, b in ((q, q0), (k, k0)):
        diff = (a.float() - b.float()).abs()
        assert float((diff > 0).float().mean()) < 0.02
        torch.testing.assert_close(a.float(), b.float(), atol=0, rtol=2 ** -7)
    monkeypatch.undo()
    assert not tgd._fused_prologue_applies(attn, attn.to_q(hidden), rotary)  # gradients
    with torch.no_grad():
        assert not tgd._fused_prologue_applies(attn, attn.to_q(hidden).float(), rotary)
        assert not tgd._fused_prologue_applies(attn, attn.to_q(hidden),
                                               tuple(t.to(dtype) for t in rotary))
        assert not tgd._fused_prologue_applies(attn, attn.to_q(hidden), None)
