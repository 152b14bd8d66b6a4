from __future__ import annotations

import numpy as np
import pytest

from mpinfer.engine.config import (
    Backend,
    BuildConfig,
    ShapeProfile,
    check_profiles,
    complete_profiles,
    parse_shape_profile,
    parse_shapes,
    parse_size,
)
from mpinfer.errors import InvalidInputError
from mpinfer.specs import Precision, TensorSpec


def test_parse_min_opt_max():
    p = parse_shape_profile("x:1x3x64x64,8x3x64x64,32x3x64x64")
    assert p == ShapeProfile("x", (1, 3, 64, 64), (8, 3, 64, 64), (32, 3, 64, 64))
    assert str(p) == "x:1x3x64x64,8x3x64x64,32x3x64x64"
    assert p.contains((16, 3, 64, 64)) and not p.contains((33, 3, 64, 64)) and not p.contains((8, 3, 64))


def test_single_shape_fixes_the_input():
    p = parse_shape_profile("x:4x8")
    assert p.min == p.opt == p.max == (4, 8)


def test_several_inputs_by_semicolon_and_repeated_option():
    a = parse_shapes("ids:1x1,2x32,4x128; mask:1x1,2x32,4x128")
    b = parse_shapes(["ids:1x1,2x32,4x128", "mask:1x1,2x32,4x128"])
    assert a == b and [p.name for p in a] == ["ids", "mask"]
    assert parse_shapes(None) == () and parse_shapes([]) == ()


def test_input_names_with_colons_keep_their_prefix():
    assert parse_shape_profile("encoder:x:1x2,1x2,1x2").name == "encoder:x"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("1x3,8x3,32x3", "no input name"),
        ("x:1x3,8x3", "2 shapes"),
        ("x:1x3,8x3x1,32x3", "ranks 2, 3, 2"),
        ("x:8x3,1x3,32x3", "min <= opt <= max"),
        ("x:1xAx3,1x2x3,1x2x3", "positive integers"),
        ("x:0x3,1x3,2x3", "positive integers"),
        ("x:", "positive integers"),
    ],
)
def test_bad_profiles_are_refused(text, match):
    with pytest.raises(InvalidInputError, match=match):
        parse_shape_profile(text)


def test_same_input_twice_is_refused():
    with pytest.raises(InvalidInputError, match="given twice"):
        parse_shapes("x:1x2;x:2x2")


SPECS = [
    TensorSpec("x", ("batch", 3, 64, 64), np.dtype(np.float32)),
    TensorSpec("scale", (1,), np.dtype(np.float32)),
]


def test_profiles_checked_against_model_inputs():
    check_profiles(parse_shapes("x:1x3x64x64,8x3x64x64,32x3x64x64"), SPECS)
    with pytest.raises(InvalidInputError, match="'y'.*one of"):
        check_profiles(parse_shapes("y:1x3,1x3,1x3"), SPECS)
    with pytest.raises(InvalidInputError, match="rank 2.*rank 4"):
        check_profiles(parse_shapes("x:1x3,1x3,1x3"), SPECS)
    with pytest.raises(InvalidInputError, match="dim 1.*fixed in the model"):
        check_profiles(parse_shapes("x:1x4x64x64,1x4x64x64,1x4x64x64"), SPECS)


def test_tensorrt_profiles_default_to_batch_1_to_16():
    given = parse_shapes("x:1x3x64x64,8x3x64x64,32x3x64x64")
    assert complete_profiles(given, SPECS) == (given, None)  # given profiles are kept as they are
    (prof,), note = complete_profiles((), SPECS)
    assert (prof.name, prof.min, prof.opt, prof.max) == ("x", (1, 3, 64, 64), (16, 3, 64, 64), (16, 3, 64, 64))
    assert note is not None and "x:1x3x64x64,16x3x64x64,16x3x64x64" in note and "--shapes" in note


def test_tensorrt_default_profiles_use_the_recorded_sizes():
    """A transformer's batch and sequence dims, shared by two inputs; the export recorded batch 2, seq 128."""
    sizes = {"batch": 2, "seq": 128}
    specs = [TensorSpec(n, ("batch", "seq"), np.dtype(np.int64), dim_sizes=sizes) for n in ("ids", "mask")]
    profiles, note = complete_profiles(parse_shapes("ids:1x8,4x64,8x128"), specs)
    assert [p.name for p in profiles] == ["ids", "mask"]
    mask = profiles[1]
    assert (mask.min, mask.opt, mask.max) == ((1, 128), (16, 128), (16, 128))
    assert note is not None and "mask" in note and "ids" not in note.split(":")[0]
    # a recorded batch larger than 16 is the top of the range
    big = [TensorSpec("x", ("n", 4), np.dtype(np.float32), dim_sizes={"n": 64})]
    (prof,), _ = complete_profiles((), big)
    assert (prof.min, prof.opt, prof.max) == ((1, 4), (64, 4), (64, 4))


def test_tensorrt_refuses_to_guess_a_dim_without_a_recorded_size():
    specs = [TensorSpec("img", ("n", 3, "h", "w"), np.dtype(np.float32), dim_sizes={"h": 224})]
    with pytest.raises(InvalidInputError, match=r"no recorded size for dim\(s\) w.*--shapes \"img:1x3x1x1,8x3x8x8"):
        complete_profiles((), specs)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * 2**30),
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1024", 1024),
        ("1.5 GiB", 3 * 2**29),
        (7, 7),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4 gigs", "", "-1GiB", "0"])
def test_bad_sizes(text):
    with pytest.raises(InvalidInputError, match="Size"):
        parse_size(text)


def test_build_config_from_mapping_parses_strings(tmp_path):
    cfg = BuildConfig.from_mapping(
        {
            "model": str(tmp_path / "m.onnx"),
            "backend": "trt",
            "shapes": "x:1x2,2x2,4x2",
            "workspace": "1GiB",
            "weak_precisions": ["fp16"],
            "opt_level": 5,
        }
    )
    assert cfg.backend is Backend.TENSORRT and cfg.workspace == 2**30
    assert cfg.weak_precisions == (Precision.FP16,) and cfg.shapes[0].max == (4, 2)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"opt_level": 6}, "--opt-level"),
        ({"weak_precisions": ["fp32"]}, "fp16 or bf16"),
        ({"device": "tpu"}, "--device"),
        ({"backend": "openvino"}, "Backend"),
        ({"colour": "red"}, "unknown key"),
    ],
)
def test_build_config_refuses_bad_values(tmp_path, values, match):
    with pytest.raises(InvalidInputError, match=match):
        BuildConfig.from_mapping({"model": str(tmp_path / "m.onnx"), **values})
