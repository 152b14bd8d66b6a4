"""Labels that are not class indices of the model, and run folders nothing can be written to.

Each is a user mistake: exit 1, one Error: line naming the bad values, and no run folder left behind.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mpinfer.errors import InvalidInputError
from mpinfer.train import AmpConfig, AmpTrainer
from mpinfer.train.data import digits_arrays
from mpinfer.train.labels import num_classes
from tests.conftest import assert_user_error, unwritable_outputs
from tests.train.helpers import plain_mlp


def _npz(tmp_path: Path, name: str, labels_of=lambda y: y) -> Path:
    x, y, _, _ = digits_arrays()
    path = tmp_path / name
    np.savez(path, x=x[:100], _labels=labels_of(y[:100]))
    return path


def _train(invoke, *args):
    return invoke("train", "models/digits_cnn.py:build", "--epochs", "1", "--precision", "fp32", "--quiet", *args)


@pytest.mark.parametrize(
    ("labels_of", "pattern"),
    [
        (lambda y: y + 100, r"Labels of --data '.*big.npz': received _labels from 100 to 109 \(80 of 80 out of"),
        (lambda y: np.where(y == 3, -1, y), r"received _labels from -1 to 9 \(\d+ of 80 out of range\)"),
        (lambda y: y + 1, r"received _labels from 1 to 10 \(\d+ of 80 out of range\)"),
    ],
    ids=["plus100", "negative", "one-based"],
)
def test_labels_outside_the_models_classes(invoke, tmp_path, labels_of, pattern):
    data = _npz(tmp_path, "big.npz", labels_of)
    result = _train(invoke, "--data", data, "-o", tmp_path / "run")
    assert_user_error(result, pattern + r".*expected class indices 0..9 \(the model has 10 outputs\)\. Hint")
    assert not (tmp_path / "run").exists()


def test_eval_labels_outside_the_models_classes(invoke, tmp_path):
    good, bad = _npz(tmp_path, "good.npz"), _npz(tmp_path, "bad.npz", lambda y: y + 10)
    result = _train(invoke, "--data", good, "--eval-data", bad, "-o", tmp_path / "run")
    assert_user_error(result, r"Labels of --eval-data '.*bad.npz': received _labels from 10 to 19")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("labels_of", "pattern"),
    [(lambda y: y.astype(np.float32), r"_labels of shape \(100,\) and dtype float32"),
     (lambda y: np.stack([y, y], 1), r"_labels of shape \(100, 2\) and dtype int64")],
    ids=["float", "2-D"],
)
def test_labels_of_the_wrong_dtype_or_shape(invoke, tmp_path, labels_of, pattern):
    data = _npz(tmp_path, "odd.npz", labels_of)
    result = _train(invoke, "--data", data, "-o", tmp_path / "run")
    assert_user_error(result, pattern + ", expected a 1-D integer _labels array")
    assert not (tmp_path / "run").exists()


def test_dataset_labels_out_of_range_fail_clearly_in_the_loop(tmp_path):
    """A Dataset given through the API is not scanned up front; the loss reports the label it meets."""
    from torch.utils.data import TensorDataset

    x, y, _, _ = digits_arrays()
    data = TensorDataset(torch.from_numpy(x[:64]), torch.from_numpy(y[:64] + 10))
    config = AmpConfig(plain_mlp, tmp_path / "run", data=data, device="cpu", epochs=1, batch_size=32, quiet=True)
    with pytest.raises(InvalidInputError, match=r"Training labels: received a label outside the model's classes "
                                                r"\(Target 1\d is out of bounds.*expected class indices 0..9"):
        AmpTrainer(config).fit()


def test_counting_classes_leaves_the_model_and_rng_as_they_were():
    model = plain_mlp()
    model.train()
    x, y, _, _ = digits_arrays()
    before = torch.get_rng_state()
    assert num_classes(model, [(torch.from_numpy(x[0]), 0)], model) == 10
    assert model.training and torch.equal(before, torch.get_rng_state())
    with pytest.raises(InvalidInputError, match=r"Model on --data: received inputs it cannot run \(one sample of "
                                                r"shape \(3,\)"):  # refused before training, not in the loop
        num_classes(model, [(torch.zeros(3), 0)], model)
    assert model.training and torch.equal(before, torch.get_rng_state())


def test_run_folder_in_an_unwritable_location(invoke, tmp_path):
    for out in unwritable_outputs(tmp_path, "run"):
        result = _train(invoke, "-o", out)
        assert_user_error(result, r"Output '.*run': received a location that cannot be written "
                                  r"\((NotADirectoryError|FileNotFoundError)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]
