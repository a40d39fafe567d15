"""KernelConfig names and the validity predicates, checked against the real compiler."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tilegen import KernelConfig, Spec
from tilegen.config import PREDICATES, default_config, shared_memory_estimate, violations
from tilegen.targets import TARGET_NAMES, get_target

GRID = [(bm, bn, st) for bm in (32, 64) for bn in (32, 64) for st in (1, 2, 3, 5)]


def test_name_spells_every_trait():
    cfg = KernelConfig(64, 32, 8, 2, store_lse=False)
    assert cfg.name == "bm64_bn32_w8_s2_nolse"
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown KernelConfig field"):
        KernelConfig.from_dict({"block_q": 64})


@pytest.mark.parametrize("kwargs,needle", [
    ({"block_m": 64.0}, "KernelConfig.block_m must be a positive int"),
    ({"block_n": "64"}, "KernelConfig.block_n must be a positive int"),
    ({"num_stages": 0}, "KernelConfig.num_stages must be a positive int"),
    ({"store_lse": 1}, "KernelConfig.store_lse must be a bool"),
])
def test_config_fields_are_typed(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        KernelConfig(**kwargs)


def test_default_config_fits_small_cubes():
    spec = Spec(block_q=32, block_kv=32, cube=(2, 4, 4))
    for name in TARGET_NAMES:
        target = get_target(name)
        cfg = default_config(target, spec)
        assert (cfg.block_m, cfg.block_n) == (32, 32) and violations(spec, target, cfg) == []


def test_every_predicate_says_which_rule_it_mirrors():
    for pred in PREDICATES:
        assert pred.__doc__ and len(pred.__doc__.split()) > 8, pred.__name__


@pytest.mark.parametrize("target_name", TARGET_NAMES)
def test_target_defaults_are_valid(target_name):
    target = get_target(target_name)
    assert violations(Spec(), target, default_config(target)) == []


def compiled_shared_bytes(target: str, head_dim: int, out: Path) -> dict[str, int]:
    """Shared memory Triton reports for every GRID config, compiled ahead of time in a fresh
    process (this test session imported triton in interpreter mode)."""
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from tilegen import KernelConfig, Spec\n"
        "from tilegen.backends.triton.aot import compile_triton\n"
        "from tilegen.targets import get_target\n"
        f"grid = {GRID!r}\n"
        f"target, spec = get_target({target!r}), Spec(head_dim={head_dim})\n"
        "res = {}\n"
        "for bm, bn, st in grid:\n"
        "    cfg = KernelConfig(bm, bn, 4, st)\n"
        f"    res[cfg.name] = compile_triton(spec, cfg, target, Path({str(out)!r})).shared_bytes\n"
        "print(json.dumps(res))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("target_name", ["sm_90", "gfx942", "sm_89"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_shared_memory_estimate_bounds_the_compiler(tmp_path: Path, target_name, head_dim):
    """The pruning estimate is never below what Triton allocates (no false 'fits'), and never
    prunes a config that the compiler fits in the target's budget."""
    target = get_target(target_name)
    spec = Spec(head_dim=head_dim)
    real_bytes = compiled_shared_bytes(target_name, head_dim, tmp_path)
    for bm, bn, st in GRID:
        cfg = KernelConfig(bm, bn, 4, st)
        real = real_bytes[cfg.name]
        est = shared_memory_estimate(spec, cfg, target)
        assert est >= real, (cfg.name, est, real)
        if real <= target.max_shared_bytes:  # never prunes what the compiler fits
            assert est <= target.max_shared_bytes, (cfg.name, est, real)


def test_tunable_space_on_sm_90_is_not_pruned_by_the_estimate():
    target = get_target("sm_90")
    for bm in target.tunable["block_m"]:
        for bn in target.tunable["block_n"]:
            for st in target.tunable["num_stages"]:
                cfg = KernelConfig(bm, bn, 4, st)
                assert shared_memory_estimate(Spec(), cfg, target) <= target.max_shared_bytes
