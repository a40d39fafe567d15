"""The Gluon family's 8-bit kernel (issue #19, `tilegen.backends.gluon.quant`) on a machine
without a GPU: it renders and compiles for sm_90a with the 8-bit wgmma kinds (IGMMA, QGMMA) and
no spills, the targets and families without an 8-bit kernel refuse it with the reason, and the
op refuses what it cannot compute before anything runs. Its values are checked on the H200
(`bench/experiments/h200_quant_op.py`: the quantized rule with check 4)."""

from __future__ import annotations

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


@pytest.mark.parametrize("head_dim,dtype", [(128, "bf16"), (64, "fp16")])
def test_the_8bit_kernel_builds_for_sm_90a_with_igmma_and_qgmma(tmp_path, head_dim, dtype):
    """Compiled in a process without the interpreter, as `tilegen build` does."""
    code = (
        "import json; from pathlib import Path\n"
        "from tilegen import Spec, backends\n"
        "from tilegen.targets import get_target\n"
        f"s = Spec(quant='int8_fp8', head_dim={head_dim}, dtype={dtype!r}, grid=(8, 8, 8),"
        " num_heads=2, topk=3)\n"
        "t = get_target('sm_90'); b = backends.get('gluon'); cfg = b.default_config(s, t)\n"
        "srcs = b.sources(s, cfg, t)\n"
        f"art = b.compile(s, cfg, t, srcs[0], Path({str(tmp_path)!r}))\n"
        "print(json.dumps(dict(n=len(srcs), bad=b.violations(s, t, cfg), ops=art.matrix_ops,"
        " spills=art.spill_bytes, shared=art.shared_bytes)))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["n"] == 1 and out["bad"] == []  # forward only: no backward module
    assert out["ops"].get("IGMMA", 0) > 0 and out["ops"].get("QGMMA", 0) > 0
    assert not out["ops"].get("HGMMA")  # no 16-bit MMA left in the 8-bit kernel
    assert out["spills"] == 0
    target = get_target("sm_90")
    assert 2 * (out["shared"] + target.reserved_shared_per_block) <= target.shared_per_sm


def test_targets_and_families_without_an_8bit_kernel_say_why():
    spec = Spec(quant="int8_fp8", **SMALL)
    gluon = backends.get("gluon")
    (why,) = gluon.spec_violations(spec, get_target("sm_100a"))
    assert "tcgen05" in why and "i8" in why and "f8f6f4" in why
    for name, tname in (("triton", "sm_90"), ("cuda", "sm_90"), ("hip", "gfx942")):
        (why,) = backends.get(name).spec_violations(spec, get_target(tname))
        assert f"the {name} family has no quant='int8_fp8' kernel" in why and "gluon" in why
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


def test_the_op_refuses_what_it_cannot_compute_before_it_runs():
    spec = Spec(quant="int8_fp8", **SMALL)
    with pytest.raises(ValueError, match="needs a target"):
        tilegen.load(spec)  # this machine has no GPU, and no target is named
    op = tilegen.load(spec, target="sm_90")
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
