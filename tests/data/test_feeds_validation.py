"""load_feeds refuses bad counts, bad ``_labels`` and files that are not .npz, with clear messages."""

from __future__ import annotations

import numpy as np
import pytest

from mpinfer.data import load_feeds
from mpinfer.errors import InvalidInputError
from mpinfer.specs import TensorSpec

X = TensorSpec("x", ("batch", 4), np.dtype(np.float32))


def _npz(path, n=10, **side):
    x = np.random.default_rng(0).random((n, 4), dtype=np.float32)
    np.savez(path, x=x, **side)
    return path


@pytest.mark.parametrize("source", ["random:-1", "random:0"])
def test_random_needs_at_least_one_batch(source):
    with pytest.raises(InvalidInputError, match=r"received 'random:-?\d', expected random:N with N >= 1"):
        load_feeds(source, [X])


@pytest.mark.parametrize("num_batches", [-1, 0])
def test_num_batches_must_be_positive(num_batches, tmp_path):
    for source in (None, _npz(tmp_path / "d.npz")):
        with pytest.raises(InvalidInputError, match=rf"Number of batches: received {num_batches}, expected a positive"):
            load_feeds(source, [X], num_batches=num_batches)


def test_random_n_is_capped_by_num_batches():
    assert len(load_feeds("random:5", [X], num_batches=2)) == 2


def test_a_file_named_random_something_is_not_random_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInputError, match="no such file or folder"):
        load_feeds("random_val.npz", [X])  # was taken for random data
    _npz(tmp_path / "random_val.npz", n=3)
    src = load_feeds("random_val.npz", [X])
    assert src.kind == "npz" and src.num_samples == 3


def test_text_file_named_npz(tmp_path):
    path = tmp_path / "fake.npz"
    path.write_text("hello")
    with pytest.raises(InvalidInputError, match=r"not a valid \.npz") as err:
        load_feeds(path, [X])
    assert "pickled" not in str(err.value)


@pytest.mark.parametrize(
    ("labels", "pattern"),
    [
        (np.zeros((10, 2), np.int64), r"_labels: received shape \(10, 2\), expected a 1-D array of 10 labels"),
        (np.arange(10, dtype=np.float32), r"_labels: received dtype float32, expected integer class indices"),
        (np.arange(4), r"_labels: received 4 labels, expected one per sample \(10\)"),
        (np.arange(-1, 9), r"_labels: received a negative label \(-1\), expected class indices >= 0"),
    ],
)
def test_bad_labels(tmp_path, labels, pattern):
    with pytest.raises(InvalidInputError, match=pattern):
        load_feeds(_npz(tmp_path / "d.npz", _labels=labels), [X])


def test_labels_in_some_files_only(tmp_path):
    _npz(tmp_path / "a.npz", _labels=np.arange(10))
    _npz(tmp_path / "b.npz")
    with pytest.raises(InvalidInputError, match=r"_labels in 1 of 2 files, expected _labels in every file or in none"):
        load_feeds(tmp_path, [X])


def test_good_labels_are_int64_and_aligned(tmp_path):
    _npz(tmp_path / "a.npz", _labels=np.arange(10, dtype=np.uint8))
    _npz(tmp_path / "b.npz", n=3, _labels=np.arange(3, dtype=np.int32))
    src = load_feeds(tmp_path, [X], batch_size=4)
    assert src.labels is not None and src.labels.dtype == np.int64 and len(src.labels) == src.num_samples == 13
