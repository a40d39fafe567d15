"""The FP8 pre-pass (`tilegen.quant`, groundwork of issue #13): its PyTorch model (what the CPU
runs; Triton 3.6's interpreter rounds fp8 casts wrongly, so the Triton kernel is checked against
the model on the GPU by bench/experiments/fp8_error_budget.py --check-prepass) zeroes padded
rows, keeps the rounding within half an e4m3 ulp of each cube's amax scale, and the quantized
rule scores as the contract words it."""

from __future__ import annotations

import torch

from tilegen import quant


def _kv(seed: int, S: int = 4 * 64, H: int = 2, D: int = 32):
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(1, S, H, D, generator=gen) * 3 + 5).to(torch.bfloat16)
    v = torch.randn(1, S, H, D, generator=gen).to(torch.bfloat16)
    vbs = torch.tensor([64, 32, 8, 64], dtype=torch.int32)[: S // 64]
    return k, v, vbs


def test_padded_rows_are_zero_and_the_mean_shift_is_per_head():
    k, v, vbs = _kv(0)
    qkv = quant.quantize_kv(k, v, vbs)  # CPU: the PyTorch model of the Triton pre-pass
    assert qkv.k8[0, 64 + 32:128].float().abs().sum() == 0
    assert qkv.v8t[0, :, :, 128 + 8:192].float().abs().sum() == 0
    torch.testing.assert_close(qkv.k_mean, k.float().view(1, 4, 64, 2, 32)[:, :, 0].mean(1))
    assert qkv.k8.shape == k.shape and qkv.v8t.shape == (1, 2, 32, 256)


def test_rounding_error_is_e4m3_sized_and_scales_are_exact_amax():
    k, v, vbs = _kv(2)
    qkv = quant.quantize_kv(k, v, vbs)
    kc = k.float() - qkv.k_mean[:, None]
    back = qkv.k8.float() * qkv.k_scale.permute(0, 2, 1).repeat_interleave(64, 1)[..., None]
    real = slice(0, 64)  # a full cube
    rel = (back[0, real] - kc[0, real]).abs() / kc[0, real].abs().amax()
    assert rel.max() <= 2 ** -4  # half an e4m3 ulp at the top of the range
    assert quant.quantize_kv(k, v, vbs).k8.float().abs().amax() == quant.E4M3_MAX


def test_quant_rule_thresholds():
    ref = torch.randn(1, 128, 2, 16)
    assert quant.quant_rule(ref + 1e-3, ref).passed
    assert not quant.quant_rule(ref + 3e-3, ref).passed  # mean|d| over 2e-3
    bad = ref.clone()
    bad[0, 0, 0, 0] += 0.2
    assert not quant.quant_rule(bad, ref).passed  # max|d| over 0.1
    assert not quant.quant_rule(ref * float("nan"), ref).passed
