"""`tilegen doctor` on the CPU: every check runs (the GPU-only ones SKIP with their reason), a
broken op turns its checks FAIL and the exit status 1."""

from __future__ import annotations

import json

import pytest

import tilegen
from tilegen import doctor
from tilegen.cli import main


@pytest.fixture
def pytorch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU op's PyTorch path


def test_doctor_on_the_cpu_passes_and_skips_the_gpu_checks(pytorch_path, tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "every check passed" in text
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    for name in ("load", "fp32 oracle", "reference variant", "custom op", "gradients",
                 "bad index"):
        assert rows[name]["status"] == "PASS", rows[name]
    for name in ("no host sync", "CUDA graph", "timing"):
        assert rows[name]["status"] == "SKIP" and "GPU only" in rows[name]["detail"]
    assert "outlier head" in rows["workload"]["detail"]


class _ShiftedHead:
    """The real op, with one head's output moved by 0.05: the kind of bug doctor must see."""

    def __init__(self, op) -> None:
        self.op, self.spec = op, op.spec

    def __call__(self, q, k, v, *args, **kwargs):
        o = self.op(q, k, v, *args, **kwargs)
        o = (o[0] if isinstance(o, tuple) else o).clone()
        o[:, :, 0] += 0.05
        return o


def test_doctor_fails_a_wrong_op(pytorch_path, monkeypatch, capsys):
    real_load = tilegen.load

    def load(spec, config=None, **kw):
        op = real_load(spec, config, **kw)
        return op if config is not None else _ShiftedHead(op)  # the reference stays right

    monkeypatch.setattr(tilegen, "load", load)
    checks = {c.name: c for c in doctor.run_doctor(tilegen.Spec())}
    assert checks["fp32 oracle"].status == "FAIL"
    assert checks["reference variant"].status == "FAIL" and "-> FAIL" in checks[
        "reference variant"].detail
    assert checks["custom op"].status == "FAIL"  # block_sparse_attention is the real op
    assert "3 check(s) failed: fp32 oracle, reference variant, custom op" in \
        doctor.format_checks(list(checks.values()))


def test_doctor_refuses_a_non_lut_spec_in_one_line(pytorch_path, tmp_path, capsys):
    spec = tmp_path / "sta.toml"
    spec.write_text(tilegen.Spec(encoding="sliding_tile", grid=(12, 12, 12)).to_toml())
    assert main(["doctor", "--spec", str(spec)]) == 1
    err = capsys.readouterr().err
    assert "tilegen doctor checks the lut encoding" in err and "Traceback" not in err
