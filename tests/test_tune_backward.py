"""`tilegen tune --backward`: the Triton family's backward kernels (`BackwardConfig`) tuned by the
same Optuna session, gated on dq/dk/dv with the gradient rule against the fp32 reference on
the outlier head, the winner stored under the ``triton_bwd`` kernel set and taken by the op's
backward through the same lookup as the forward's winner. Runs under the Triton interpreter at
a tiny shape with partial cubes (grid 5x6x8: vbs 64, 32, 16, 8) and the test-only timer.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from tilegen.backends.triton.backward import BackwardConfig
from tilegen.config import KernelConfig
from tilegen.spec import Spec
from tilegen.targets import get_target

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SMALL = Spec(grid=(5, 6, 8), num_heads=2, head_dim=64, topk=3, dtype="bf16")
#: 4 points: the two packing switches, everything else pinned (the Triton kernels: the Gluon
#: backward runs on a GPU only)
SPACE = {"dq_stages": (2,), "dkdv_stages": (2,), "dkdv_warps": (4,),
         "dq_pack": (True, False), "dkdv_pack": (True, False), "gluon": (False,),
         "ds_store": (False,), "gluon_dq_stages": (3,)}
BROKEN = BackwardConfig(dq_pack=True, dkdv_pack=False, dq_stages=2)


@pytest.fixture
def tune_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TILEGEN_DB", str(tmp_path / "tuning.sqlite"))
    monkeypatch.setenv("TILEGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


def wrong_dk_for_one(spec: Spec, cfg: KernelConfig, backend: str = "triton_bwd"):
    """The real op, whose dk is off in one element of head 0 for one backward config (`BROKEN`)."""
    from tilegen.ops import load_kernel_set

    op = load_kernel_set(spec, cfg, backend=backend)
    if BackwardConfig.from_kernel_config(cfg) != BROKEN.fit(spec):
        return op
    real = op.backward

    def backward(*args, **kwargs):
        dq, dk, dv = real(*args, **kwargs)
        dk = dk.clone()
        dk[:, 0, 0] += 0.02 * dk.abs().max()  # one element of head 0, 2% of the tensor's scale
        return dq, dk, dv

    op.backward = backward
    return op


def test_backward_space_and_seeds() -> None:
    from tilegen.tune.space import SearchSpace, seed_configs

    target = get_target("sm_90")
    space = SearchSpace.from_target(Spec(), target, backend="triton_bwd")
    assert set(space.names) == set(target.tunable_by_backend["triton_bwd"])
    assert all(d.kind == "render" for d in space.dims)  # options, not forward launch fields
    (label, seed), = seed_configs(space)
    assert label == "target default"
    assert BackwardConfig.from_kernel_config(seed) == BackwardConfig.default_for(target, Spec())
    bad = BackwardConfig(dkdv_pack=True, dkdv_block_m=32).to_kernel_config()
    assert space.violations(bad) == [
        "dkdv_pack packs whole 64-row query tiles: needs dkdv_block_m=64, got 32"]
    with pytest.raises(ValueError, match="not BackwardConfig fields"):
        BackwardConfig.from_kernel_config(KernelConfig(options={"k_stages": 2}))


def test_tune_backward_gates_gradients_and_stores_the_winner(tune_env: Path) -> None:
    """Exhaustive over 4 points: every trial's dq/dk/dv scored on the outlier head; the one
    whose dk is off fails the gate and never wins; the winner is a triton_bwd winner."""
    from tilegen.db import TuningDB
    from tilegen.tune.session import TuneOptions, run_session

    out = io.StringIO()
    res = run_session(TuneOptions(
        spec=SMALL, target="sm_90", backend="triton_bwd", timer="fake-deterministic",
        trials=4, timeout_s=120, seeds=1, space=SPACE,
        op_factory="test_tune_backward:wrong_dk_for_one", progress=io.StringIO(), out=out))
    assert res.trials_counted == 4, out.getvalue()
    assert res.counts == {"pass": 3, "fail_correctness": 1}, out.getvalue()
    (bad,) = [r for r in res.rows if r.status == "fail_correctness"]
    assert BackwardConfig.from_kernel_config(KernelConfig.from_dict(bad.config)) == BROKEN
    assert "dk: finite=True" in bad.message  # scored on dq, dk, dv
    assert res.best is not None and res.best.status == "pass"
    with TuningDB.open() as db:
        (win,) = db.winners(SMALL.hash)
        assert win.config_name == res.best.config_name
        assert win.variant["backend"] == "triton_bwd"


def test_op_backward_takes_the_backward_winner(tune_env: Path) -> None:
    """A real-timer triton_bwd winner in the DB is the op's backward config (same lookup as
    the forward's winner); without one, the target default."""
    from tilegen import backends
    from tilegen.db import TuningDB
    from tilegen.ops import BlockSparseAttention

    target = get_target("sm_90")
    tuned = BackwardConfig(dq_pack=True, dkdv_pack=True, dq_stages=4)
    op = BlockSparseAttention(SMALL, KernelConfig(), target)
    assert op.backward_config == BackwardConfig.default_for(target, SMALL).fit(SMALL)
    cfg = tuned.to_kernel_config()
    key = backends.get("triton_bwd").variant_key(SMALL, cfg, target).to_dict()
    with TuningDB.open() as db:
        db.upsert_workload(SMALL.hash, SMALL.kernel_hash, SMALL.to_dict())
        cid = db.add_candidate(key, cfg.to_dict())
        db.set_winner(SMALL.hash, cid, device_name="cpu", median_ms=1.0, timer="do_bench")
    op = BlockSparseAttention(SMALL, KernelConfig(), target)
    assert op.backward_config == tuned


def test_backward_tuning_refuses_other_encodings(tmp_path: Path, capsys) -> None:
    """The gradient gate builds the LUT's maps: a sliding_tile spec is refused up front."""
    from tilegen.cli import main

    spec = tmp_path / "st.toml"
    spec.write_text('encoding = "sliding_tile"\ngrid = [8, 12, 12]\nwindow = [1, 3, 3]\n')
    assert main(["tune", "--backward", "--spec", str(spec), "--trials", "1"]) == 2
    assert "LUT encoding" in capsys.readouterr().err
