"""`tilegen bench` on the CPU: argument parsing, the plan, FLOP counting, the FlexAttention
BlockMask from a LUT, rows, JSON, table, plot, progress, and the whole loop at a tiny size (the
tilegen ops under Triton's interpreter, a fake timer, eager FlexAttention)."""

from __future__ import annotations

import argparse
import io
import json
import sys
import warnings

import pytest
import torch

from tilegen import bench, captures
from tilegen.cli import BENCH_SWEEP, main
from tilegen.config import reference_config
from tilegen.reference import attention_fp32
from tilegen.spec import Spec

TINY = Spec(dtype="fp16", head_dim=64, grid=(5, 6, 7), num_heads=2, topk=3)  # 8 cubes, S 512


def tiny_capture(topk: int = 3, dtype: torch.dtype = torch.float32) -> dict:
    # grid 5x6x7 with 4x4x4 cubes: 2x2x2 cubes, vbs 64, 48, 32, 24, 16, 12, 8, 6
    return captures.synthesize(seed=0, grid=(5, 6, 7), heads=2, head_dim=64, topk=topk,
                               dtype=dtype)


# ---------------------------------------------------------------------------- parsing


def test_parse_int_list():
    assert bench.parse_int_list("31,78, 125") == [31, 78, 125]
    assert bench.parse_int_list("78,78,31") == [78, 31]
    for bad in ("", "a,3", "0", "-4", "3,,x"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_int_list(bad)


def test_parse_grid():
    assert bench.parse_grid("21,30,52") == (21, 30, 52)
    assert bench.parse_grid("21x30x52") == (21, 30, 52)
    for bad in ("21,30", "21,30,52,1", "a,b,c", "0,3,4"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_grid(bad)


def test_parse_backends():
    assert bench.parse_backends("triton,gluon,cuda") == ["triton", "gluon", "cuda"]
    assert bench.parse_backends("gluon,gluon") == ["gluon"]
    with pytest.raises(argparse.ArgumentTypeError, match="known"):
        bench.parse_backends("triton,thunderkittens")


def test_cli_sweep_help_matches_the_sweep():
    assert BENCH_SWEEP == ",".join(map(str, bench.SWEEP_TOPK))


def test_sweep_topks():
    spec = Spec()
    assert bench.sweep_topks(spec) == ([78], [])
    assert bench.sweep_topks(spec, sweep=True) == ([31, 78, 125, 187, 312], [])
    assert bench.sweep_topks(spec, topk=[5, 9]) == ([5, 9], [])
    small = spec.replace(grid=(8, 8, 8), topk=8)  # 2x2x2 = 8 cubes
    assert bench.sweep_topks(small, topk=[4, 8, 31]) == ([4, 8], [31])
    with pytest.raises(ValueError, match="NKV = 8"):
        bench.sweep_topks(small, sweep=True)


def test_workload_spec_overrides_only_the_workload():
    spec = Spec()
    other = bench.workload_spec(spec, grid=(21, 30, 52), heads=12)
    assert (other.grid, other.num_heads, other.topk) == ((21, 30, 52), 12, 78)
    assert other.kernel_hash == spec.kernel_hash
    small = bench.workload_spec(spec, grid=(8, 8, 8))
    assert small.topk == 8  # clipped to the grid's NKV; the sweep sets TOPK per point
    assert bench.workload_spec(spec) is spec


def test_plan_lists_variants_and_topks(tmp_path):
    plan = bench.make_plan(Spec(), sweep=True, backends=["gluon", "cuda"],
                           json_path=tmp_path / "r.json", quant=["int8_fp8"])
    assert [v.label for v in plan.variants] == ["reference", "default", "quant-int8_fp8",
                                                "gluon", "cuda", "flex", "sdpa-cudnn",
                                                "sdpa-flash"]
    assert [v.kind for v in plan.variants].count("tilegen") == 5
    assert plan.topks == list(bench.SWEEP_TOPK)
    assert plan.plot_path == tmp_path / "r.png"
    text = plan.describe()
    for word in ("312 (50.0%)", "31 (95.0%)", "flex", "sdpa-cudnn", "gluon", "fp32 oracle",
                 "4 * D"):
        assert word in text
    bare = bench.make_plan(Spec(), flex=False, dense=False, config=reference_config(),
                           quant=())
    assert [v.label for v in bare.variants] == ["reference", "config"]
    # "auto": the modes a family computes on the GPU the bench runs on (none here)
    auto = bench.make_plan(Spec(), flex=False, dense=False)
    assert auto.quant_auto and "--quant auto" in auto.describe()
    assert bench.quant_modes_for(Spec()) == []
    with pytest.raises(ValueError, match="not 8-bit modes"):
        bench.make_plan(Spec(), quant=["int4"])
    with pytest.raises(ValueError, match="the 8-bit rows come from --quant"):
        bench.make_plan(Spec(quant="int8_fp8"))


def test_plan_rejects_bad_combinations(tmp_path):
    with pytest.raises(ValueError, match="capture files"):
        bench.make_plan(Spec(), str(tmp_path), topk=[31])
    with pytest.raises(FileNotFoundError):
        bench.make_plan(Spec(), str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="seeds"):
        bench.make_plan(Spec(), seeds=0)


def test_cli_dry_run_prints_the_plan_without_a_gpu(capsys, monkeypatch):
    def no_cuda(*a, **k):
        raise AssertionError("--dry-run touched the GPU")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    monkeypatch.setattr(torch.cuda, "synchronize", no_cuda)
    rc = main(["bench", "--dry-run", "--sweep", "--backends", "gluon", "--heads", "12",
               "--grid", "21,30,52"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "heads 12" in out and "gluon" in out and "187 (70.0%)" in out


def test_cli_rejects_bad_bench_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--dry-run", "--backends", "nope"])
    assert exc.value.code == 2 and "unknown backend" in capsys.readouterr().err


# ---------------------------------------------------------------------------- FLOPs


def test_real_key_flops_counts_vbs_of_selected_cubes():
    vbs = torch.tensor([64, 32, 8], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1], [1, 2]]]], dtype=torch.int32)  # B=1, H=1, NQ=2, TOPK=2
    # query cube 0 attends 64 + 32 keys, cube 1 attends 32 + 8; 64 rows each, D = 128
    assert bench.real_key_flops(idx, vbs, 64, 128) == 4 * 128 * 64 * (96 + 40)
    assert bench.slot_flops(idx, 64, 64, 128) == 4 * 128 * (2 * 64) * 2 * 64
    real, slots = bench.dense_flops(1, 1, 3 * 64, 128, vbs)
    assert real == 4 * 128 * 192 * 104 and slots == 4 * 128 * 192 * 192
    cap = {"topk_idx": idx, "vbs": vbs}
    assert bench.flops_of(cap, Spec()) == bench.real_key_flops(idx, vbs, 64, 128)


def test_default_workload_flops_scale():
    """Dense attention over the default grid: 4 * D * (B*H*S) * real keys (32,760)."""
    spec = Spec()
    vbs = torch.tensor([64] * 624, dtype=torch.int32)
    from tilegen import layout

    _, vbs = layout.to_cubes(torch.zeros(1, 21 * 30 * 52, 1, 1), spec.grid, spec.cube)
    assert int(vbs.sum()) == 32760
    real, slots = bench.dense_flops(1, 40, spec.seq_len, 128, vbs)
    assert real == pytest.approx(4 * 128 * 40 * 39936 * 32760)
    assert slots / real == pytest.approx(39936 / 32760)


# ---------------------------------------------------------------------------- FlexAttention


def test_lut_block_tensors_split_full_and_partial_cubes():
    vbs = torch.tensor([64, 32, 64, 8], dtype=torch.int32)
    idx = torch.tensor([[[[2, 1], [3, 0]], [[0, 2], [1, 3]]]], dtype=torch.int32)  # (1,2,2,2)
    kv_num, kv_idx, full_num, full_idx = bench.lut_block_tensors(idx, vbs, 64)
    assert kv_num.dtype == kv_idx.dtype == full_num.dtype == torch.int32
    assert kv_num.shape == (1, 2, 2) and kv_idx.shape == (1, 2, 2, 4)
    assert kv_num.tolist() == [[[1, 1], [0, 2]]]  # partial cubes (1, 3) per row
    assert full_num.tolist() == [[[1, 1], [2, 0]]]  # full cubes (0, 2) per row
    for h in range(2):
        for i in range(2):
            part = kv_idx[0, h, i, :kv_num[0, h, i]].tolist()
            full = full_idx[0, h, i, :full_num[0, h, i]].tolist()
            assert part == sorted(part) and full == sorted(full)
            assert sorted(part + full) == sorted(idx[0, h, i].tolist())
            assert all(vbs[c] < 64 for c in part) and all(vbs[c] == 64 for c in full)
            # each row is a permutation of all cubes: FlexAttention reads past the count
            assert sorted(kv_idx[0, h, i].tolist()) == list(range(4))


def test_flex_block_mask_covers_the_lut():
    cap = tiny_capture()
    bm = bench.flex_block_mask(cap["topk_idx"], cap["vbs"], 64)
    from tilegen import sparsity

    assert bm.BLOCK_SIZE == (64, 64) and bm.seq_lengths == (512, 512)
    assert torch.equal(bm.to_dense().bool(), sparsity.lut_to_mask(cap["topk_idx"], 8))
    mm = bench.padding_mask_mod(cap["vbs"], 64)
    kv = torch.arange(512)
    real = mm(0, 0, 0, kv)
    assert int(real.sum()) == int(cap["vbs"].sum())
    assert bool(real[:64].all()) and not bool(real[64 + 48:128].any())  # vbs[1] = 48


def test_eager_flex_with_the_exact_mask_matches_the_oracle():
    cap = tiny_capture()
    args = [cap[k] for k in ("q", "k", "v", "topk_idx", "vbs")]
    o32, _ = attention_fp32(*args)
    peer = bench.FlexPeer(compile=False)
    bm = peer.block_mask(cap["topk_idx"], cap["vbs"], 64)
    q, k, v = (t.transpose(1, 2).contiguous() for t in args[:3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        o = peer.call(q, k, v, bm, 64 ** -0.5, 64).transpose(1, 2)
    assert (o - o32).abs().max() < 1e-4


def test_flex_peer_keeps_one_mask_mod_per_shape():
    peer = bench.FlexPeer(compile=True)
    vbs = torch.tensor([64, 32], dtype=torch.int32)
    first = peer.mask_mod(vbs, 64)
    assert peer.mask_mod(vbs.clone(), 64) is first  # no new closure: no recompile
    assert peer.mask_mod(torch.tensor([64, 16, 8], dtype=torch.int32), 64) is not first


# ---------------------------------------------------------------------------- rows, JSON, table


def make_row(variant: str, ms: float | None, kind: str = "tilegen", **kw) -> bench.Row:
    row = bench.Row(capture="synthetic_seed0_topk78", variant=variant, kind=kind,
                    backend="triton", config="cfg", topk=78, num_kv_blocks=624,
                    sparsity=1 - 78 / 624, grid=[21, 30, 52], heads=40, batch=1,
                    seq_len=39936, head_dim=128, seed=0, ms_op=ms, **kw)
    row.set_flops(3.32e12, 4.0e12)
    return row


def test_rows_speedup_rates_and_exit_status():
    ref = make_row("reference", 10.0, ms_bare=9.5, passed=True)
    fast = make_row("default", 6.0, ms_bare=5.9, passed=True)
    flex = make_row("flex", 12.0, kind="peer", passed=False)
    dense = make_row("sdpa-cudnn", 50.0, kind="peer")
    rows = [ref, fast, flex, dense]
    bench.fill_speedups(rows)
    assert ref.speedup == 1.0 and fast.speedup == pytest.approx(10 / 6)
    assert fast.speedup_bare == pytest.approx(9.5 / 5.9) and flex.speedup_bare is None
    assert fast.tflops == pytest.approx(3.32e12 / 6.0 / 1e9)
    assert fast.tflops_bare == pytest.approx(3.32e12 / 5.9 / 1e9)
    assert all(r.ok for r in rows)  # a failing peer never fails the bench
    broken = make_row("gluon", None)
    broken.fail(RuntimeError("out of resources"))
    assert broken.passed is False and not broken.ok and "RuntimeError" in broken.error
    skipped = make_row("sdpa-flash", None, kind="peer")
    skipped.fail("no kernel")
    assert skipped.passed is None and skipped.ok


def test_json_document_has_every_row_field(tmp_path):
    plan = bench.make_plan(Spec(), json_path=tmp_path / "out" / "r.json")
    env = {"device": "NVIDIA H200", "torch": "2.x", "triton": "3.6.0", "tilegen": "0.1.0",
           "date": "2025-01-01T00:00:00+00:00"}
    rows = [make_row("reference", 10.0, passed=True), make_row("default", 6.0, passed=True)]
    bench.fill_speedups(rows)
    path = bench.write_json(plan.json_path, bench.results_json(plan, rows, env, "tilegen bench"))
    doc = json.loads(path.read_text())
    assert doc["schema"] == "tilegen.bench/1" and doc["device"] == "NVIDIA H200"
    assert doc["flops_formula"] == bench.FLOPS_FORMULA and doc["topks"] == [78]
    assert doc["timing"]["return_mode"] == "median" and doc["passed"] is True
    for key in ("capture", "topk", "sparsity", "variant", "backend", "config", "ms_op", "ms_bare",
                "ms_custom_op", "tflops", "speedup", "passed", "finite", "min_head_cos",
                "max_abs", "mean_abs", "error", "device", "torch", "triton", "date"):
        assert key in doc["rows"][0]
    assert doc["rows"][1]["speedup"] == pytest.approx(10 / 6)


def test_tables_plain_and_rich(monkeypatch):
    ok = make_row("reference", 10.0, passed=True)
    bad = make_row("default", 6.0)
    bad.set_score(captures.Score(True, 0.99, 0.5, 1e-2, False, torch.ones(1, 1)), "reference")
    err = make_row("gluon", None)
    err.fail(ValueError("the gluon backend needs a target with wgmma"))
    text = bench.format_table([ok, bad, err])
    assert "PASS" in text and "FAIL cos 0.990000" in text and "ERROR ValueError" in text
    assert "seed0" in text and "10.000" in text
    buf = io.StringIO()
    bench.print_table([ok, bad, err], file=buf)
    assert "FAIL" in buf.getvalue()
    monkeypatch.setitem(sys.modules, "rich.console", None)  # rich missing: plain text
    buf = io.StringIO()
    bench.print_table([ok], file=buf)
    assert buf.getvalue().startswith("capture")


def test_plot_two_panels_or_a_message(tmp_path, monkeypatch):
    rows = []
    for topk, ms in ((31, 3.0), (78, 6.0)):
        for variant, scale in (("reference", 1.5), ("default", 1.0)):
            r = make_row(variant, ms * scale)
            r.topk, r.sparsity = topk, 1 - topk / 624
            rows.append(r)
    series = bench.plot_series(rows)
    assert [p[1] for p in series["default"]] == [6.0, 3.0]  # sorted by sparsity
    pytest.importorskip("matplotlib")
    msg = bench.plot(rows, tmp_path / "p.png", title="t")
    assert msg.endswith("p.png") and (tmp_path / "p.png").stat().st_size > 1000
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert "skipped" in bench.plot(rows, tmp_path / "q.png")
    assert not (tmp_path / "q.png").exists()


def test_reporter_plain_and_rich():
    buf = io.StringIO()
    with bench.Reporter(2, plain=True, file=buf) as rep:
        rep.status("working")
        rep.step("one")
        rep.log("note")
        rep.step("two")
    assert buf.getvalue().splitlines() == ["[1/2] one", "note", "[2/2] two"]
    pytest.importorskip("rich")
    buf = io.StringIO()
    with bench.Reporter(1, plain=False, file=buf) as rep:
        rep.status("working")
        rep.step("done step")
    assert not rep.plain and "done step" in buf.getvalue()


def test_oracle_heads_include_the_outlier():
    assert bench.oracle_heads(40, [17]) == [0, 17, 20, 39]
    assert bench.oracle_heads(2, []) == [0, 1]


# ---------------------------------------------------------------------------- the whole loop


def test_run_bench_end_to_end_on_the_cpu(tmp_path, interpreter):
    """The command's flow at a tiny size: the tilegen ops under Triton's interpreter (bare
    launch included), eager FlexAttention, dense SDPA (cuDNN unavailable: recorded, not fatal),
    a fake timer; then the table, the JSON and the exit status."""
    plan = bench.make_plan(TINY, topk=[2], json_path=tmp_path / "bench.json")
    buf = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = bench.run_bench(plan, command="test", device="cpu", timer=lambda fn: (fn(), 2.0)[1],
                             file=buf)
    out = buf.getvalue()
    doc = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert rc == 0, out
    assert list(rows) == ["reference", "reference-vs-fp32", "default", "flex", "sdpa-cudnn",
                          "sdpa-flash"]
    for name in ("reference", "default"):
        r = rows[name]
        assert r["passed"] is True and r["error"] is None
        assert r["ms_op"] == 2.0 and r["ms_bare"] == 2.0 and r["speedup"] == 1.0
        assert r["tflops"] == pytest.approx(r["flops"] / 2.0 / 1e9)
    assert rows["default"]["ms_custom_op"] == 2.0
    assert rows["reference-vs-fp32"]["passed"] is True
    assert rows["reference-vs-fp32"]["heads_checked"] == [0, 1]
    assert rows["flex"]["ms_op"] == 2.0 and rows["flex"]["min_head_cos"] > 0.999
    assert rows["sdpa-cudnn"]["error"] and rows["sdpa-cudnn"]["passed"] is None
    assert "tilegen bench plan" in out and "[1/7]" in out and "[7/7]" in out
    assert "json: wrote" in out


# ---------------------------------------------------------------------------- --backward

BWD_TINY = Spec(dtype="fp16", head_dim=64, grid=(4, 8, 8), num_heads=2, topk=2)  # 4 cubes


def test_cli_backward_flag_reaches_the_plan(monkeypatch):
    seen = {}
    monkeypatch.setattr(bench, "run_bench", lambda plan, **kw: seen.setdefault("plan", plan)
                        and 0)
    assert main(["bench", "--backward", "--topk", "78"]) == 0
    assert seen["plan"].backward
    seen.clear()
    assert main(["bench", "--topk", "78"]) == 0
    assert not seen["plan"].backward and seen["plan"].backward_variants == []


def test_plan_lists_backward_rows_only_with_the_flag():
    plain = bench.make_plan(Spec())
    assert not plain.backward and "backward" not in plain.describe()
    assert bench.steps_per_point(plain) == len(plain.variants) + 2
    plan = bench.make_plan(Spec(), backward=True)
    labels = [v.label for v in plan.backward_variants]
    assert labels == ["fwd+bwd", "fwd (grad)", "reference fwd+bwd", "bwd kernels",
                      "inverse map", "flex fwd+bwd"]
    assert {v.kind for v in plan.backward_variants} == {"backward"}
    assert bench.steps_per_point(plan) == len(plan.variants) + 2 + 6
    text = plan.describe()
    assert "launch_backward" in text and "backward_maps" in text and "2.5 * forward" in text
    no_flex = bench.make_plan(Spec(), backward=True, flex=False)
    assert [v.label for v in no_flex.backward_variants] == [
        "fwd+bwd", "fwd (grad)", "reference fwd+bwd", "bwd kernels", "inverse map"]


def test_cli_dry_run_shows_the_backward_plan(capsys, monkeypatch):
    def no_cuda(*a, **k):
        raise AssertionError("--dry-run touched the GPU")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    assert main(["bench", "--dry-run", "--backward", "--sweep"]) == 0
    out = capsys.readouterr().out
    assert "backward (6 rows" in out and "bwd kernels" in out and "flex fwd+bwd" in out
    assert "reference fwd+bwd" in out and "+ 6 backward row(s)" in out


def test_backward_flops_formula():
    assert bench.backward_flops(10.0) == 25.0
    assert bench.backward_flops(10.0, "bwd kernels") == 25.0
    assert bench.backward_flops(10.0, "fwd+bwd") == 35.0
    assert bench.backward_flops(10.0, "flex fwd+bwd") == 35.0
    assert bench.backward_flops(10.0, "inverse map") is None
    assert "2.5 * forward FLOPs" in bench.BACKWARD_FLOPS_FORMULA


def test_backward_rows_exit_status_and_plot(tmp_path):
    spec = BWD_TINY
    pt = bench.Point("p", spec, seed=0)

    def row(label, backend="triton", **kw):
        r = bench.new_row(pt, spec, {}, label, "backward", backend)
        for k, v in kw.items():
            setattr(r, k, v)
        return r

    assert row("inverse map", ms_op=1.0).ok  # timed only
    assert row("bwd kernels", passed=True).ok and not row("bwd kernels", passed=False).ok
    failed = row("bwd kernels")
    failed.fail("boom")
    assert not failed.ok and failed.passed is False
    flex = row("flex fwd+bwd", backend="flex")
    flex.fail("NoValidChoicesError")
    assert flex.ok and flex.passed is None  # a peer
    assert bench.plot_series([row("bwd kernels", ms_op=1.0)]) == {}
    assert bench.backward_heads(40, [17]) == [0, 17, 39]


def test_run_bench_backward_end_to_end_on_the_cpu(tmp_path, interpreter):
    """--backward at a tiny size: the Triton backward kernels under the interpreter, eager
    FlexAttention's backward, the fp32 reference gradients, a fake timer."""
    plan = bench.make_plan(BWD_TINY, topk=[2], dense=False, backward=True,
                           json_path=tmp_path / "bench.json")
    buf = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = bench.run_bench(plan, command="test", device="cpu", timer=lambda fn: (fn(), 2.0)[1],
                             file=buf)
    out = buf.getvalue()
    doc = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert rc == 0, out
    assert list(rows) == ["reference", "reference-vs-fp32", "default", "flex", "fwd+bwd",
                          "fwd (grad)", "reference fwd+bwd", "bwd kernels", "inverse map",
                          "flex fwd+bwd"]
    assert doc["backward_flops_formula"] == bench.BACKWARD_FLOPS_FORMULA
    fwd_flops = rows["reference"]["flops"]
    for name in ("fwd+bwd", "reference fwd+bwd", "bwd kernels"):
        r = rows[name]
        assert r["kind"] == "backward" and r["error"] is None, r
        assert r["passed"] is True and r["min_head_cos"] >= 0.9999, r["score"]
        assert r["heads_checked"] == [0, 1] and r["ms_op"] == 2.0 and r["speedup"] is None
    assert rows["bwd kernels"]["flops"] == pytest.approx(2.5 * fwd_flops)
    assert rows["fwd+bwd"]["flops"] == pytest.approx(3.5 * fwd_flops)
    assert rows["reference fwd+bwd"]["flops"] == pytest.approx(3.5 * fwd_flops)
    assert rows["fwd (grad)"]["ms_op"] == 2.0 and rows["fwd (grad)"]["passed"] is None
    assert rows["bwd kernels"]["tflops"] == pytest.approx(2.5 * fwd_flops / 2.0 / 1e9)
    assert rows["inverse map"]["ms_op"] == 2.0 and rows["inverse map"]["passed"] is None
    flex = rows["flex fwd+bwd"]
    assert flex["error"] or flex["passed"] is True, flex
    assert "[11/11]" in out and "bwd kernels" in out


def test_cli_backward_without_a_gpu_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--backward", "--topk", "78"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
