from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mpinfer.data import ImagePreprocess, load_feeds, parse_dims
from mpinfer.errors import InvalidInputError
from mpinfer.specs import parse_tensor_spec

X = parse_tensor_spec("x:batchx1x8x8:float32")
IDS = parse_tensor_spec("ids:batchxseq=5:int64:3..7")


def test_random_respects_dtype_range_and_dims():
    src = load_feeds("random:3", [X, IDS], batch_size=4, seed=1)
    batches = list(src)
    assert len(batches) == len(src) == 3 and src.is_random
    for b in batches:
        assert b["x"].shape == (4, 1, 8, 8) and b["x"].dtype == np.float32
        assert b["ids"].shape == (4, 5) and b["ids"].dtype == np.int64
        assert b["ids"].min() >= 3 and b["ids"].max() < 7
    again = list(load_feeds("random:3", [X, IDS], batch_size=4, seed=1))
    np.testing.assert_array_equal(batches[2]["x"], again[2]["x"])
    other = load_feeds(None, [X], batch_size=2, seed=2, dims={"batch": 3}).first()
    assert other["x"].shape == (3, 1, 8, 8)


def test_npz_file_is_split_in_batches_and_labels_are_side_data(tmp_path):
    x = np.random.default_rng(0).random((10, 1, 8, 8), dtype=np.float32)
    np.savez(tmp_path / "d.npz", x=x, _labels=np.arange(10))
    src = load_feeds(tmp_path / "d.npz", [X], batch_size=4)
    sizes = [b["x"].shape[0] for b in src]
    assert sizes == [4, 4, 2] and len(src) == 3 and src.num_samples == 10
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in src]), x)
    np.testing.assert_array_equal(src.labels, np.arange(10))
    assert [b["x"].shape[0] for b in load_feeds(tmp_path / "d.npz", [X], batch_size=4, num_batches=2)] == [4, 4]


def test_small_files_are_read_once_and_large_ones_on_every_pass(tmp_path):
    from mpinfer.memory import MIN_LIMIT, use_budget

    big = parse_tensor_spec("x:batchx1x64x64:float32")
    rng = np.random.default_rng(0)
    small, large = rng.random((10, 1, 8, 8), dtype=np.float32), rng.random((400, 1, 64, 64), dtype=np.float32)
    np.savez(tmp_path / "s.npz", x=small)
    np.savez(tmp_path / "l.npz", x=large)  # 6.6 MB: above the data_files slice of the smallest budget (5.6 MB)
    with use_budget(MIN_LIMIT):
        kept, streamed = load_feeds(tmp_path / "s.npz", [X], batch_size=4), load_feeds(tmp_path / "l.npz", [big])
    first = list(kept)
    np.savez(tmp_path / "s.npz", x=small + 1)  # the files change after the sources were opened
    np.savez(tmp_path / "l.npz", x=large + 1)
    first[0]["x"][0, 0, 0, 0] = 5.0  # a batch is the caller's own: writing to it changes no later pass
    again = list(kept)  # kept: the arrays as first read
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in again]), small)
    np.testing.assert_array_equal(streamed.first()["x"], large[:16] + 1)  # streamed: read again on each pass


def test_fixed_batch_dim_drops_short_tail(tmp_path):
    fixed = parse_tensor_spec("x:4x1x8x8:float32")
    np.savez(tmp_path / "d.npz", x=np.zeros((10, 1, 8, 8), np.float32))
    assert [b["x"].shape[0] for b in load_feeds(tmp_path / "d.npz", [fixed])] == [4, 4]


def test_folder_of_npz_and_npy(tmp_path):
    (tmp_path / "a").mkdir()
    for i in range(3):
        np.savez(tmp_path / "a" / f"{i}.npz", x=np.full((2, 1, 8, 8), i, np.float32))
    src = load_feeds(tmp_path / "a", [X], batch_size=8)
    assert [int(b["x"][0, 0, 0, 0]) for b in src] == [0, 1, 2]
    (tmp_path / "b").mkdir()
    np.save(tmp_path / "b" / "x.npy", np.ones((5, 1, 8, 8), np.float32))
    assert sum(b["x"].shape[0] for b in load_feeds(tmp_path / "b", [X], batch_size=2)) == 5


def test_image_folder_with_preprocessing(tmp_path):
    for i in range(3):
        Image.fromarray(np.full((20, 30, 3), 60 * i, np.uint8)).save(tmp_path / f"{i}.png")
    spec = parse_tensor_spec("img:batchx3x16x16:float32")
    pre = ImagePreprocess.parse("size=16x16,mean=0.5/0.5/0.5,std=0.5/0.5/0.5")
    (batch,) = list(load_feeds(tmp_path, [spec], batch_size=8, image_preprocess=pre))
    assert batch["img"].shape == (3, 3, 16, 16)
    np.testing.assert_allclose(batch["img"][1, :, 0, 0], (60 / 255 - 0.5) / 0.5, rtol=1e-6)


@pytest.mark.parametrize(
    ("arrays", "pattern"),
    [
        ({"y": np.zeros((2, 1, 8, 8), np.float32)}, "missing: x.*not model inputs: y"),
        ({"x": np.zeros((2, 1, 8, 8), np.float64)}, "dtype float64.*expected float32"),
        ({"x": np.zeros((2, 8, 8), np.float32)}, r"shape \(2, 8, 8\)"),
        ({"x": np.zeros((0, 1, 8, 8), np.float32)}, "empty"),
        ({"x": np.full((2, 1, 8, 8), np.nan, np.float32)}, "128 NaN values"),
    ],
)
def test_bad_data_names_the_problem(tmp_path, arrays, pattern):
    np.savez(tmp_path / "d.npz", **arrays)
    with pytest.raises(InvalidInputError, match=pattern):
        load_feeds(tmp_path / "d.npz", [X])


def test_missing_and_wrong_sources(tmp_path):
    with pytest.raises(InvalidInputError, match="no such file"):
        load_feeds(tmp_path / "nope.npz", [X])
    (tmp_path / "d.csv").write_text("1,2")
    with pytest.raises(InvalidInputError, match="'.csv'"):
        load_feeds(tmp_path / "d.csv", [X])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInputError, match="no .npz"):
        load_feeds(tmp_path / "empty", [X])
    with pytest.raises(InvalidInputError, match="name=N"):
        parse_dims(["seq"])
    with pytest.raises(InvalidInputError, match="Image preprocessing"):
        ImagePreprocess.parse("size=big")


def test_shipped_calibration_data_loads():
    from tests.conftest import ROOT

    src = load_feeds(ROOT / "calibration" / "digits.npz", [X], batch_size=64)
    assert src.num_samples == 256 and src.labels is not None and set(np.unique(src.labels)) == set(range(10))
    first = src.first()["x"]
    assert 0.0 <= first.min() and first.max() <= 1.0


# A streaming model's inputs: audio chunks, a recurrent state with the batch on axis 1, a scalar sample rate.
AUDIO = parse_tensor_spec("audio:batchx64:float32")
STATE = parse_tensor_spec("state:2xbatchx8:float32")
RATE = parse_tensor_spec("sr::int64")


def test_npz_batches_follow_each_inputs_sample_axis(tmp_path):
    rng = np.random.default_rng(0)
    audio, state = rng.random((10, 64), dtype=np.float32), rng.random((2, 10, 8), dtype=np.float32)
    np.savez(tmp_path / "d.npz", audio=audio, state=state, sr=np.array(16000, np.int64))
    src = load_feeds(tmp_path / "d.npz", [AUDIO, STATE, RATE], batch_size=4)
    batches = list(src)
    assert [b["audio"].shape[0] for b in batches] == [4, 4, 2] and src.num_samples == 10
    assert [b["state"].shape for b in batches] == [(2, 4, 8), (2, 4, 8), (2, 2, 8)]
    np.testing.assert_array_equal(np.concatenate([b["state"] for b in batches], axis=1), state)
    assert all(b["sr"].shape == () and int(b["sr"]) == 16000 for b in batches)  # fed whole with every batch


@pytest.mark.parametrize(
    ("arrays", "pattern"),
    [
        ({"state": np.zeros((3, 10, 8), np.float32)}, r"state.*shape \(3, 10, 8\).*samples on axis 1"),
        ({"state": np.zeros((2, 9, 8), np.float32)}, r"sample counts \[9, 10\]"),
        ({"sr": np.array([16000], np.int64)}, r"sr.*shape \(1,\).*fed whole"),
    ],
)
def test_npz_inputs_off_the_first_axis_are_checked(tmp_path, arrays, pattern):
    good = {"audio": np.zeros((10, 64), np.float32), "state": np.zeros((2, 10, 8), np.float32),
            "sr": np.array(16000, np.int64)}
    np.savez(tmp_path / "d.npz", **{**good, **arrays})
    with pytest.raises(InvalidInputError, match=pattern):
        load_feeds(tmp_path / "d.npz", [AUDIO, STATE, RATE])


def test_random_data_warns_about_dims_it_had_to_guess(caplog):
    seq = parse_tensor_spec("x:batchxseq:float32")
    with caplog.at_level("WARNING", logger="mpinfer.data.feeds"):
        src = load_feeds("random:1", [seq], batch_size=3)
    assert src.first()["x"].shape == (3, 2) and src.guessed_dims == ("'seq' (input 'x')",)
    assert "--dim NAME=N" in caplog.text and "'seq'" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mpinfer.data.feeds"):
        src = load_feeds("random:1", [seq], batch_size=3, dims={"seq": 7})
    assert src.first()["x"].shape == (3, 7) and src.guessed_dims == () and not caplog.text


def test_unnamed_dims_are_named_per_input():
    from onnx import helper

    from mpinfer.specs import specs_from_onnx

    vi = helper.make_tensor_value_info  # None: a dim with neither a size nor a name
    graph = helper.make_graph([], "g", [vi("input", 1, [None, None]), vi("state", 1, [2, None, 128])], [])
    specs = specs_from_onnx(helper.make_model(graph))
    # the two inputs' unnamed second dims are unrelated sizes (audio samples vs. batch): never one name
    assert [s.shape for s in specs] == [("input.dim0", "input.dim1"), (2, "state.dim1", 128)]


def test_paddles_question_mark_dims_get_a_name_each():
    from onnx import helper

    from mpinfer.specs import specs_from_onnx

    # Paddle names every dynamic dim '?': batch, height and width would otherwise be one dim of one size
    x = helper.make_tensor_value_info("x", 1, ["?", 3, "?", "?"])
    [spec] = specs_from_onnx(helper.make_model(helper.make_graph([], "g", [x], [])))
    assert spec.shape == ("x.dim0", 3, "x.dim2", "x.dim3")
    src = load_feeds("random:1", [spec], batch_size=2, dims={"x.dim2": 48, "x.dim3": 192})
    assert src.first()["x"].shape == (2, 3, 48, 192)


def test_a_dim_name_the_model_does_not_have_is_refused():
    spec = parse_tensor_spec("x:batchx3xheightxwidth:float32")
    with pytest.raises(InvalidInputError, match=r"received 'hieght'.*expected one of 'batch', 'height', 'width'"):
        load_feeds("random:1", [spec], dims={"hieght": 48, "width": 64})
    with pytest.raises(InvalidInputError, match=r"received '\?'.*Hint: '\?' is not a name"):
        load_feeds("random:1", [spec], dims={"?": 48})


def test_an_unnamed_state_holds_samples_where_the_data_says(tmp_path):
    # silero-vad: input [?, ?], state [2, ?, 128], both unnamed: the state's samples are on its one unnamed dim
    # whose size is the input's sample count; a state whose unnamed dims could both be it is fed whole
    from onnx import helper

    from mpinfer.specs import specs_from_onnx

    def specs(*inputs):
        vis = [helper.make_tensor_value_info(n, 1, shape) for n, shape in inputs]
        return specs_from_onnx(helper.make_model(helper.make_graph([], "g", vis, [])))

    audio, state = specs(("input", [None, None]), ("state", [2, None, 8]))
    rng = np.random.default_rng(0)
    a, s = rng.random((10, 64), dtype=np.float32), rng.random((2, 10, 8), dtype=np.float32)
    np.savez(tmp_path / "d.npz", input=a, state=s, sr=np.array(16000, np.int64))
    batches = list(load_feeds(tmp_path / "d.npz", [audio, state, RATE], batch_size=4))
    assert [b["state"].shape for b in batches] == [(2, 4, 8), (2, 4, 8), (2, 2, 8)]
    np.testing.assert_array_equal(np.concatenate([b["state"] for b in batches], axis=1), s)
    two = specs(("state", [2, None, None]))[0]
    np.savez(tmp_path / "e.npz", input=a, state=rng.random((2, 10, 10), dtype=np.float32))
    batches = list(load_feeds(tmp_path / "e.npz", [audio, two], batch_size=4))
    assert [b["state"].shape for b in batches] == [(2, 10, 10)] * 3  # ambiguous: whole, never a guess


def test_a_one_channel_model_reads_images_as_grayscale(tmp_path):
    # no mode given: an RGB image file for a [N, 1, H, W] input is read as L (it was read as RGB: 3 channels)
    for i in range(3):
        Image.fromarray(np.full((8, 8, 3), 50 * i, np.uint8)).save(tmp_path / f"{i}.png")
    spec = parse_tensor_spec("x:batchx1x8x8:float32")
    x = load_feeds(tmp_path, [spec]).first()["x"]
    assert x.shape == (3, 1, 8, 8)
    np.testing.assert_allclose(x[:, 0, 0, 0], [0, 50 / 255, 100 / 255], rtol=1e-6)
    rgb = parse_tensor_spec("x:batchx3x8x8:float32")
    assert load_feeds(tmp_path, [rgb]).first()["x"].shape == (3, 3, 8, 8)
