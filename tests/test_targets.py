"""The mma.sync targets (sm_80, sm_89, sm_120): their defaults, their builds, and how a GPU
finds its target by compute capability."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import known_spills
import pytest

from tilegen import KernelConfig, Spec
from tilegen import targets as targets_mod
from tilegen.backends.cuda.nvcc import STATIC_SMEM_BYTES, shared_memory_bytes
from tilegen.config import default_config, violations
from tilegen.targets import get_target, target_for_capability

MMA_SYNC_TARGETS = ["sm_80", "sm_89", "sm_120"]


@pytest.mark.parametrize("name", MMA_SYNC_TARGETS)
def test_mma_sync_target_facts(name):
    """HMMA only (no Gluon family), the capability in the name, the Triton arch from it."""
    target = get_target(name)
    assert [m.kind for m in target.mma] == ["mma_sync"]
    assert target.backends == ("triton", "cuda")
    assert target.compute_capability == int(name.removeprefix("sm_"))
    assert target.triton_arch == target.compute_capability
    assert target.max_shared_bytes == target.shared_per_sm - target.reserved_shared_per_block


@pytest.mark.parametrize("name", MMA_SYNC_TARGETS)
def test_default_takes_the_most_stages_that_fit(name):
    """The default's stages: the most of the tunable range whose tiles fit a block's shared
    memory in the CUDA C++ family's count (the larger of the two families' needs)."""
    target = get_target(name)
    spec = Spec()
    cfg = default_config(target, spec)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (64, 64, 4)

    def fits(stages: int) -> bool:
        c = KernelConfig(64, 64, 4, stages)
        return shared_memory_bytes(spec, c) + STATIC_SMEM_BYTES <= target.max_shared_bytes

    assert cfg.num_stages == max(s for s in target.tunable["num_stages"] if fits(s))
    assert violations(spec, target, cfg) == []


def test_capability_finds_its_target_or_the_closest_lower_one_of_its_major(caplog):
    from tilegen.backends.cuda import runtime

    targets_mod._FALLBACK_NOTED.clear()
    for cc, name in [(80, "sm_80"), (89, "sm_89"), (90, "sm_90"), (100, "sm_100a"),
                     (120, "sm_120")]:
        assert target_for_capability(cc).name == name
    with caplog.at_level(logging.INFO, logger="tilegen"):
        assert target_for_capability(87, 166912).name == "sm_80"  # Orin: 163 KiB per block
        assert target_for_capability(87, 166912).name == "sm_80"
        assert target_for_capability(121, 101376).name == "sm_120"
        assert runtime.target_for_capability(8, 7, 166912).name == "sm_80"  # CUDA family too
    lines = [r.getMessage() for r in caplog.records]
    assert sum("8.7; using sm_80" in ln for ln in lines) == 2, lines  # once per family
    assert any("12.1; using sm_120" in ln for ln in lines), lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tilegen"):
        assert target_for_capability(86, 101376) is None  # sm_80's 163 KiB exceed its 99
        assert target_for_capability(87) is None  # the GPU's limit unknown: no guess
        assert target_for_capability(103, 232448) is None  # sm_100a code runs on 10.0 only
        assert target_for_capability(110, 232448) is None  # no 11.x target
        assert target_for_capability(75, 65536) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5 and all("untuned reference config" in ln for ln in lines), lines
    targets_mod._FALLBACK_NOTED.clear()


@pytest.mark.parametrize("name", MMA_SYNC_TARGETS)
def test_build_counts_hmma_and_spills_nothing(tmp_path: Path, name):
    """`tilegen build --target` cross-compiles both families (Triton AOT and nvcc) with the
    target's default config: every cubin has HMMA (the preprocess kernel none) and no spills
    but `known_spills`' (the backward kernels', and sm_120's forward, measured 2026-12-04)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tilegen.cli", "build", "--target", name,
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    arts = manifest["artifacts"]
    assert {a["backend"] for a in arts} == {"triton", "cuda"}
    for art in arts:
        assert art["arch"] == name, art["path"]
        assert art["spill_bytes"] <= known_spills.allowed(name, art["path"]), \
            (art["path"], art["spill_bytes"])
        assert art["shared_bytes"] <= get_target(name).max_shared_bytes, art["path"]
        if "preprocess" not in art["path"]:
            assert art["matrix_ops"].get("HMMA", 0) > 0, (art["path"], art["matrix_ops"])
            assert set(art["matrix_ops"]) == {"HMMA"}, art["matrix_ops"]


def test_untuned_backend_is_one_of_the_targets_families():
    """`untuned_backend` (what a GPU with no tuned winner gets) defaults to the Triton family
    and must name one of the target's backends."""
    from tilegen.targets import TARGET_NAMES, _untuned_backend, get_target

    for name in TARGET_NAMES:
        t = get_target(name)
        assert t.untuned_backend in t.backends
    assert get_target("sm_90").untuned_backend == "cuda"
    raw = {"name": "x", "backends": ["triton"]}
    assert _untuned_backend(raw) == "triton"
    with pytest.raises(ValueError, match="untuned_backend 'gluon' is not one of its backends"):
        _untuned_backend({**raw, "untuned_backend": "gluon"})
