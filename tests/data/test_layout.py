"""The batch layout rule (README, Data): one test per layout, and the errors that say how to lay data out."""

from __future__ import annotations

import numpy as np
import pytest

from mpinfer.data import load_feeds
from mpinfer.errors import InvalidInputError
from mpinfer.specs import parse_tensor_spec

RNG = np.random.default_rng(0)


def _f32(*shape):
    return RNG.random(shape, dtype=np.float32)


def test_samples_on_axis_0_are_cut_in_batches(tmp_path):
    x = parse_tensor_spec("x:batchx3:float32")
    ids = parse_tensor_spec("ids:batchx5:int64")
    arrays = {"x": _f32(7, 3), "ids": np.arange(35, dtype=np.int64).reshape(7, 5)}
    np.savez(tmp_path / "d.npz", **arrays)
    src = load_feeds(tmp_path / "d.npz", [x, ids], batch_size=3)
    batches = list(src)
    assert [b["x"].shape[0] for b in batches] == [3, 3, 1] and src.num_samples == 7 and len(src) == 3
    np.testing.assert_array_equal(np.concatenate([b["ids"] for b in batches]), arrays["ids"])


def test_a_static_model_given_arrays_at_exactly_its_shapes_is_one_batch(tmp_path):
    # ONNX's Add test case: x [3,4,5] and y [5] (a broadcast), both fixed; the file is one batch, fed as it is
    x, y = parse_tensor_spec("x:3x4x5:float32"), parse_tensor_spec("y:5:float32")
    arrays = {"x": _f32(3, 4, 5), "y": _f32(5)}
    np.savez(tmp_path / "d.npz", **arrays)
    src = load_feeds(tmp_path / "d.npz", [x, y])
    batches = list(src)
    assert len(batches) == len(src) == 1
    for name, value in arrays.items():
        np.testing.assert_array_equal(batches[0][name], value)


def test_a_fixed_batch_detector_takes_its_size_input_whole(tmp_path):
    # a detector with a fixed [1,3,8,8] image and a [2] image-size input: images are samples, the size is fed whole
    image, size = parse_tensor_spec("image:1x3x8x8:float32"), parse_tensor_spec("size:2:int64")
    images = _f32(3, 3, 8, 8)
    np.savez(tmp_path / "d.npz", image=images, size=np.array([8, 8], np.int64))
    batches = list(load_feeds(tmp_path / "d.npz", [image, size]))
    assert [b["image"].shape for b in batches] == [(1, 3, 8, 8)] * 3
    assert all(b["size"].tolist() == [8, 8] for b in batches)
    np.testing.assert_array_equal(np.concatenate([b["image"] for b in batches]), images)


def test_a_recurrent_state_holds_samples_on_its_batch_named_axis(tmp_path):
    audio, state = parse_tensor_spec("audio:batchx64:float32"), parse_tensor_spec("state:2xbatchx8:float32")
    a, s = _f32(5, 64), _f32(2, 5, 8)
    np.savez(tmp_path / "d.npz", audio=a, state=s)
    batches = list(load_feeds(tmp_path / "d.npz", [audio, state], batch_size=2))
    assert [b["state"].shape for b in batches] == [(2, 2, 8), (2, 2, 8), (2, 1, 8)]
    np.testing.assert_array_equal(np.concatenate([b["state"] for b in batches], axis=1), s)


def test_a_scalar_is_fed_whole_with_every_batch(tmp_path):
    x, rate = parse_tensor_spec("x:batchx4:float32"), parse_tensor_spec("rate::int64")
    np.savez(tmp_path / "d.npz", x=_f32(6, 4), rate=np.array(16000, np.int64))
    batches = list(load_feeds(tmp_path / "d.npz", [x, rate], batch_size=4))
    assert [b["x"].shape[0] for b in batches] == [4, 2]
    assert all(b["rate"].shape == () and int(b["rate"]) == 16000 for b in batches)


def test_disagreeing_sample_counts_say_how_to_lay_the_data_out(tmp_path):
    x, y = parse_tensor_spec("x:3x4x5:float32"), parse_tensor_spec("y:5:float32")
    np.savez(tmp_path / "d.npz", x=_f32(6, 4, 5), y=_f32(5))  # y at its shape: fed whole, fine
    assert [b["x"].shape[0] for b in load_feeds(tmp_path / "d.npz", [x, y])] == [3, 3]
    np.savez(tmp_path / "e.npz", x=_f32(6, 4, 5), y=_f32(10))
    with pytest.raises(InvalidInputError) as info:
        load_feeds(tmp_path / "e.npz", [x, y])
    text = str(info.value)
    assert "y: 10 on axis 0" in text and "x: 6 on axis 0" in text
    assert "one batch, every array exactly its input's shape" in text and "x [3x4x5]: samples on axis 0" in text


def test_an_empty_but_static_input_and_infinities_are_data(tmp_path):
    # ReduceSum with an empty axes input [0], a mask of -inf: both are what a model takes
    from onnx import TensorProto, helper

    from mpinfer.specs import specs_from_onnx

    vis = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
           helper.make_tensor_value_info("axes", TensorProto.INT64, [0])]
    specs = specs_from_onnx(helper.make_model(helper.make_graph([], "g", vis, [])))
    assert [s.shape for s in specs] == [(2, 3), (0,)]
    x = np.array([[0, -np.inf, 1], [2, 3, np.inf]], np.float32)
    np.savez(tmp_path / "d.npz", x=x, axes=np.zeros(0, np.int64))
    [batch] = list(load_feeds(tmp_path / "d.npz", specs))
    assert batch["axes"].shape == (0,) and np.isneginf(batch["x"][0, 1])
    np.savez(tmp_path / "n.npz", x=np.full((2, 3), np.nan, np.float32), axes=np.zeros(0, np.int64))
    with pytest.raises(InvalidInputError, match=r"input 'x': received 6 NaN values"):
        load_feeds(tmp_path / "n.npz", specs)


def test_a_model_without_inputs_runs_once():
    assert list(load_feeds(None, [])) == [{}]


def test_narrower_float_data_is_taken_and_fed_in_the_declared_dtype(tmp_path):
    # FP16 data saved for a model that declared FP16 inputs, fed after convert --force brought it back to FP32
    x = parse_tensor_spec("x:batchx3:float32")
    half = RNG.standard_normal((5, 3)).astype(np.float16)
    np.savez(tmp_path / "d.npz", x=half)
    batches = list(load_feeds(tmp_path / "d.npz", [x], batch_size=2))
    assert all(b["x"].dtype == np.float32 for b in batches)
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), half.astype(np.float32))


def test_float_data_that_would_lose_values_is_refused(tmp_path):
    x = parse_tensor_spec("x:batchx3:float16")
    np.savez(tmp_path / "d.npz", x=_f32(4, 3))
    with pytest.raises(InvalidInputError, match="received dtype float32, expected float16"):
        load_feeds(tmp_path / "d.npz", [x])
