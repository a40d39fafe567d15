import json

import pytest

from tilegen import Spec


def test_default_is_the_contract_workload():
    s = Spec()
    assert (s.encoding, s.block_q, s.block_kv, s.head_dim, s.dtype, s.layout) == (
        "lut", 64, 64, 128, "bf16", "bshd")
    assert s.num_cubes == 624 and s.seq_len == 39936 and s.topk == 78 and s.num_heads == 40


def test_hash_is_stable_and_content_based():
    # A literal: the hash must not change across processes, Python versions or hosts.
    assert Spec().hash == "a191009482b4ce6c35dfb8d428762c8e963e9e5689a7084fbb8515701f6a6a81"
    assert Spec(head_dim=64).hash != Spec().hash
    assert Spec(cube=[4, 4, 4]) == Spec() and hash(Spec(cube=[4, 4, 4])) == hash(Spec())
    assert len({Spec(), Spec(), Spec(layout="bhsd")}) == 2


@pytest.mark.parametrize("spec", [Spec(), Spec(head_dim=64, dtype="fp16", layout="bhsd",
                                               variable_block_sizes=False, grid=(5, 6, 8),
                                               num_heads=2, topk=3)])
def test_round_trips(spec, tmp_path):
    assert Spec.from_toml(spec.to_toml()) == spec
    assert Spec.from_json(spec.to_json()) == spec
    (tmp_path / "s.toml").write_text(spec.to_toml())
    (tmp_path / "s.json").write_text(spec.to_json())
    assert Spec.from_file(tmp_path / "s.toml") == spec == Spec.from_file(tmp_path / "s.json")
    assert Spec.from_toml("[spec]\n" + spec.to_toml()) == spec


@pytest.mark.parametrize("field,value,allowed", [
    ("head_dim", 96, "[64, 128]"),
    ("head_dim", 128.0, "[64, 128]"),
    ("dtype", "fp32", "['bf16', 'fp16']"),
    ("layout", "sbhd", "['bshd', 'bhsd']"),
    ("encoding", "csr", "['lut', 'mask', 'sliding_tile']"),
    ("block_q", 48, "[16, 32, 64, 128, 256, 384]"),
])
def test_invalid_choices_name_field_and_allowed_values(field, value, allowed):
    with pytest.raises(ValueError) as err:
        Spec(**{field: value})
    assert f"Spec.{field}" in str(err.value) and allowed in str(err.value)


@pytest.mark.parametrize("kwargs,needle", [
    ({"encoding": "mask", "window": (3, 3, 3)}, "Spec.window applies to encoding 'sliding_tile'"),
    ({"cube": (4, 4)}, "Spec.cube"),
    ({"cube": (4, 4, 2)}, "Spec.block_kv"),
    ({"block_q": 32, "block_kv": 64}, "Spec.block_q"),
    ({"topk": 625}, "Spec.topk"),
    ({"num_heads": 0}, "Spec.num_heads"),
    ({"variable_block_sizes": 1}, "Spec.variable_block_sizes"),
    ({"grid": (21, 30, -1)}, "Spec.grid"),
    ({"cube": (4, 4, 4.5)}, "Spec.cube"),  # never truncated to 4
    ({"grid": (21, 30, 52.0)}, "Spec.grid"),
    ({"windows": (3, 3, 3)}, "unknown Spec field"),  # a ValueError naming it, not a TypeError
])
def test_invalid_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        Spec(**kwargs)


def test_unknown_field_in_file_is_an_error():
    with pytest.raises(ValueError, match="unknown Spec field"):
        Spec.from_json(json.dumps({"head_dims": 64}))


def test_frozen():
    with pytest.raises(AttributeError):
        Spec().head_dim = 64  # type: ignore[misc]


# ------------------------------------------------------------------------------ broken spec files


BROKEN_FILES = [
    ("empty.toml", b"", ["empty"]),
    ("empty.json", b"", ["empty"]),
    ("blank.toml", b"\n  \n# only a comment\n", ["no Spec fields"]),
    ("blank.json", b"  \n", ["empty"]),
    ("list.json", b"[1, 2, 3]\n", ["object", "list"]),
    ("number.json", b"64\n", ["object", "int"]),
    ("binary.json", bytes(range(256)) * 4, ["UTF-8"]),
    ("binary.toml", b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", ["UTF-8"]),
    ("bad.json", b'{\n  "head_dim": 64,\n  "dtype": fp16\n}\n', ["line 3"]),
    ("bad.toml", b'head_dim = 64\ndtype = fp16\n', ["line 2"]),
    ("table.toml", b'spec = 5\n', ["[spec]", "table"]),
    ("emptytable.toml", b'[spec]\n', ["no Spec fields"]),
    ("emptyobject.json", b'{}', ["no Spec fields"]),
]


@pytest.mark.parametrize("name,content,needles", BROKEN_FILES, ids=[c[0] for c in BROKEN_FILES])
def test_broken_spec_files_are_value_errors_naming_the_file(tmp_path, name, content, needles):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        Spec.from_file(path)
    msg = str(err.value)
    assert str(path) in msg, msg
    for needle in needles:
        assert needle in msg, msg


def test_bad_field_in_file_names_the_file(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("head_dim = 96\n")
    with pytest.raises(ValueError, match=r"Spec\.head_dim") as err:
        Spec.from_file(path)
    assert str(path) in str(err.value)
    with pytest.raises(FileNotFoundError):
        Spec.from_file(tmp_path / "missing.toml")


def test_spec_text_parse_errors_are_value_errors():
    with pytest.raises(ValueError, match="line 1"):
        Spec.from_json("[1]x")
    with pytest.raises(ValueError, match="object"):
        Spec.from_json("[1, 2]")
    with pytest.raises(ValueError, match="line 1"):
        Spec.from_toml("head_dim = = 3")
