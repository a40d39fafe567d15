"""Golden snapshots of rendered Triton sources; set TILEGEN_UPDATE_GOLDEN=1 to rewrite them."""

import os
from pathlib import Path

import jinja2
import pytest

from tilegen import KernelConfig, Spec
from tilegen.render import HEADER, environment, render_triton, template_set_hash

GOLDEN = Path(__file__).parent / "golden"
SMALL = dict(grid=(5, 6, 8), num_heads=2, topk=3)
CASES = {
    "default": (Spec(), KernelConfig()),
    "d64_fp16_bhsd_full_nolse": (
        Spec(head_dim=64, dtype="fp16", layout="bhsd", variable_block_sizes=False, **SMALL),
        KernelConfig(store_lse=False)),
    "interp_bf16": (Spec(**SMALL), KernelConfig(interp_bf16=True)),
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
    spec, cfg = CASES["default"]
    first = render_triton(spec, cfg).text.splitlines()[0]
    assert first == "# " + HEADER.format(template="triton/lut_kernel.py.j2", spec_hash=spec.hash)


def test_deterministic_and_launch_parameters_do_not_change_text():
    spec = Spec()
    a = render_triton(spec, KernelConfig())
    b = render_triton(spec, KernelConfig(block_m=32, block_n=32, num_warps=8, num_stages=1))
    assert a.text == b.text and a.sha256 == b.sha256 and a.name == b.name
    assert "BLOCK_M: tl.constexpr" in a.text


def test_render_time_options_change_text():
    spec = Spec()
    texts = {render_triton(spec, KernelConfig(store_lse=x)).text for x in (True, False)}
    texts |= {render_triton(s, KernelConfig()).text
              for s in (Spec(layout="bhsd"), Spec(variable_block_sizes=False))}
    assert len(texts) == 4
    assert "tl.store(LSE" not in render_triton(spec, KernelConfig(store_lse=False)).text
    assert "n_valid" not in render_triton(Spec(variable_block_sizes=False), KernelConfig()).text


def test_rendered_source_is_valid_python():
    for spec, cfg in CASES.values():
        compile(render_triton(spec, cfg).text, "<rendered>", "exec")


def test_strict_undefined(tmp_path):
    env = environment()
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ not_defined }}").render()
    with pytest.raises(jinja2.UndefinedError):  # a template missing its context fails loudly
        env.get_template("triton/lut_kernel.py.j2").render(header="# x", spec=Spec())


def test_template_set_hash_is_stable():
    assert template_set_hash() == template_set_hash()
