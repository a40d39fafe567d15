"""Golden snapshots of rendered Triton sources; set TILEGEN_UPDATE_GOLDEN=1 to rewrite them.

The default spec's snapshot is the committed targets/*/generated/ source that `tilegen check`
(tests/test_check.py) compares; the snapshots here cover the other spec traits and the one
render-time option left (store_max_prob: the kernel's arguments). The config's other knobs
(store_lse, interp_bf16, the tile and launch) are constexpr parameters: they leave the text as
it is, and the AOT signatures name every parameter the kernels have."""

import ast
import os
from pathlib import Path

import jinja2
import pytest

from tilegen import KernelConfig, Spec
from tilegen.backends.triton.render import render_triton as _render_triton
from tilegen.render import HEADER, environment, template_set_hash
from tilegen.targets import get_target

TARGET = get_target("sm_90")


def render_triton(spec, cfg):
    return _render_triton(spec, cfg, TARGET)

GOLDEN = Path(__file__).parent / "golden"
SMALL = dict(grid=(5, 6, 8), num_heads=2, topk=3)
CASES = {
    "d64_fp16_bhsd_full": (
        Spec(head_dim=64, dtype="fp16", layout="bhsd", variable_block_sizes=False, **SMALL),
        KernelConfig()),
    "maxprob": (Spec(**SMALL), KernelConfig(store_max_prob=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case):
    spec, cfg = CASES[case]
    src = render_triton(spec, cfg)
    path = GOLDEN / f"{case}.py"
    if os.environ.get("TILEGEN_UPDATE_GOLDEN"):
        path.write_text(src.text)
    assert path.exists(), f"missing golden {path}; run with TILEGEN_UPDATE_GOLDEN=1"
    assert src.text == path.read_text(), f"{case} drifted from {path}"


def test_header_names_template_and_spec_hash():
    spec, cfg = Spec(), KernelConfig()
    first = render_triton(spec, cfg).text.splitlines()[0]
    assert first == "# " + HEADER.format(template="triton/lut_kernel.py.j2",
                                         kernel_hash=spec.kernel_hash, target="sm_90 (sm_90a)")


def test_every_render_sees_its_target():
    """The target reaches every template: each target's sources name it."""
    from tilegen import backends

    for name in ("sm_90", "sm_100a", "gfx942"):
        target = get_target(name)
        for impl in backends.for_target(target):
            src = impl.render(Spec(), impl.default_config(Spec(), target), target)
            assert f"target {name} ({target.arch})" in src.text.splitlines()[0]


def test_deterministic_and_launch_parameters_do_not_change_text():
    spec = Spec()
    a = render_triton(spec, KernelConfig())
    b = render_triton(spec, KernelConfig(block_m=32, block_n=32, num_warps=8, num_stages=1))
    assert a.text == b.text and a.sha256 == b.sha256 and a.name == b.name
    assert "BLOCK_M: tl.constexpr" in a.text


def test_spec_traits_change_text_and_knobs_do_not():
    """Spec traits are module constants of the source (BSHD, HAS_VBS); the config's knobs are
    constexpr parameters with a compile-time `if` (STORE_LSE, INTERP_BF16): one source."""
    spec = Spec()
    base = render_triton(spec, KernelConfig()).text
    for cfg in (KernelConfig(store_lse=False), KernelConfig(interp_bf16=True)):
        assert render_triton(spec, cfg).text == base
        assert render_triton(spec, cfg).name != render_triton(spec, KernelConfig()).name
    texts = {base} | {render_triton(s, KernelConfig()).text
                      for s in (Spec(layout="bhsd"), Spec(variable_block_sizes=False))}
    assert len(texts) == 3
    assert "STORE_LSE: tl.constexpr" in base and "if STORE_LSE:" in base
    assert "BSHD = tl.constexpr(False)" in render_triton(Spec(layout="bhsd"), KernelConfig()).text
    assert "HAS_VBS = tl.constexpr(False)" in render_triton(Spec(variable_block_sizes=False),
                                                           KernelConfig()).text
    # the backward: one source for every BackwardConfig and interp_bf16, its name spells them
    from tilegen.backends.triton.backward import BackwardConfig, render_triton_backward

    plain = render_triton_backward(spec, KernelConfig(), TARGET)
    packed = render_triton_backward(spec, KernelConfig(interp_bf16=True), TARGET,
                                    BackwardConfig(dq_pack=True, dkdv_pack=True))
    assert plain.text == packed.text and plain.name != packed.name


def _kernel_params(text: str) -> dict[str, list[str]]:
    """Each @triton.jit kernel's parameters, in order (helpers' too)."""
    tree = ast.parse(text)
    return {f.name: [a.arg for a in f.args.args] for f in tree.body
            if isinstance(f, ast.FunctionDef)}


@pytest.mark.parametrize("encoding", ["lut", "sliding_tile"])
@pytest.mark.parametrize("max_prob", [False, True])
def test_aot_signatures_name_every_kernel_parameter(encoding, max_prob):
    """The AOT compile passes a value for every parameter of every kernel, in order (pointers
    a config leaves unused are constexpr None), so no constexpr falls back to a default."""
    from tilegen.backends.triton import aot
    from tilegen.backends.triton.backward import (
        BACKWARD_KERNELS,
        BackwardConfig,
        render_triton_backward,
    )

    spec, cfg = Spec(encoding=encoding), KernelConfig(store_max_prob=max_prob)
    params = _kernel_params(render_triton(spec, cfg).text)
    assert list(aot.signature(spec, cfg)) == params["tilegen_block_sparse_attn"]
    consts = aot.forward_constexprs(spec, cfg)
    assert {k for k, v in aot.signature(spec, cfg).items() if v == "constexpr"} == set(consts)
    params = _kernel_params(render_triton_backward(spec, cfg, TARGET).text)
    for bwd in (BackwardConfig(), BackwardConfig(dkdv_pack=True, dq_pack=encoding == "lut")):
        for kernel, sig in aot.backward_signatures(spec, bwd).items():
            assert list(sig) == params[BACKWARD_KERNELS[kernel]], kernel


def test_rendered_source_is_valid_python():
    for spec, cfg in CASES.values():
        compile(render_triton(spec, cfg).text, "<rendered>", "exec")


def test_strict_undefined(tmp_path):
    env = environment()
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ not_defined }}").render()
    with pytest.raises(jinja2.UndefinedError):  # a template missing its context fails loudly
        env.get_template("triton/lut_kernel.py.j2").render(header="# x", spec=Spec())


def test_template_set_hash_follows_the_templates(tmp_path):
    """Per-backend hashes: a CUDA template edit changes the CUDA and the overall hash but not the
    Triton one (Triton winners stay current); a Triton edit changes the Triton hash."""
    import shutil
    import subprocess
    import sys

    from tilegen.paths import ROOT

    shutil.copytree(ROOT / "templates", tmp_path / "templates")
    code = ("from tilegen.render import template_set_hash as h; "
            "print(h(), h('triton'), h('cuda'))")

    def hashes():
        env = {**__import__("os").environ, "TILEGEN_ROOT": str(tmp_path)}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, check=True).stdout.split()
        return dict(zip(("all", "triton", "cuda"), out, strict=True))

    base = hashes()
    assert base["triton"] == template_set_hash("triton")
    cu = tmp_path / "templates" / "cuda" / "lut_kernel.cu.j2"
    cu.write_text(cu.read_text() + "\n")
    after_cuda = hashes()
    assert after_cuda["triton"] == base["triton"]
    assert after_cuda["cuda"] != base["cuda"] and after_cuda["all"] != base["all"]
    tr = tmp_path / "templates" / "triton" / "attention_macros.j2"
    tr.write_text(tr.read_text() + "\n")
    assert hashes()["triton"] != base["triton"]


def test_workload_fields_do_not_change_any_source():
    """A kernel's source depends on its kernel fields only: the same variant key names it for
    every workload (grid, heads, topk, batch), on every family."""
    from tilegen import backends

    other = Spec(grid=(21, 45, 80), num_heads=12, topk=31, batch=2)
    for name in ("sm_90", "sm_100a", "gfx942"):
        target = get_target(name)
        for impl in backends.for_target(target):
            cfg = impl.default_config(Spec(), target)
            assert (impl.render(Spec(), cfg, target).sha256
                    == impl.render(other, cfg, target).sha256), (name, impl.name)
