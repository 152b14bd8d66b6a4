from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mpinfer.errors import InvalidInputError, ModelLoadError
from mpinfer.specs import Precision
from mpinfer.train import AmpConfig
from mpinfer.train.data import digits_arrays, load_train_data
from mpinfer.train.source import build_model, split_source
from mpinfer.train.trainer import lr_lambda

ROOT = Path(__file__).resolve().parents[2]


def test_config_parses_and_serialises(tmp_path):
    cfg = AmpConfig("models/digits_cnn.py:build", tmp_path, precision="bf16")
    assert cfg.precision is Precision.BF16
    d = cfg.to_dict()
    assert d["precision"] == "bf16" and d["output"] == str(tmp_path) and d["resume"] is None
    assert all(v is None or isinstance(v, (str, int, float, bool)) for v in d.values())


@pytest.mark.parametrize(
    "kw, pattern",
    [
        ({"epochs": 0}, "epochs"),
        ({"batch_size": -1}, "batch_size"),
        ({"grad_accum": 0}, "grad_accum"),
        ({"lr": float("nan")}, "lr"),
        ({"device": "tpu"}, "Device"),
        ({"precision": "int8"}, "Precision"),
        ({"min_loss_scale": 2.0**20, "precision": "fp16"}, "Minimum loss scale"),
        ({"clip_grad_norm": 0.0}, "clip_grad_norm"),
        ({"schedule": "step"}, "schedule"),
    ],
)
def test_config_rejects_bad_values(tmp_path, kw, pattern):
    with pytest.raises(InvalidInputError, match=pattern):
        AmpConfig("models/digits_cnn.py:build", tmp_path, **kw)


def test_digits_split_matches_shipped_calibration_files():
    xtr, ytr, xte, yte = digits_arrays()
    assert xtr.shape == (1397, 1, 8, 8) and xte.shape == (400, 1, 8, 8) and xtr.dtype == np.float32
    with np.load(ROOT / "calibration/digits_val.npz") as z:
        np.testing.assert_array_equal(z["x"], xte)
        np.testing.assert_array_equal(z["_labels"], yte)
    with np.load(ROOT / "calibration/digits.npz") as z:
        np.testing.assert_array_equal(z["x"], xtr[: len(z["x"])])
    assert 0.0 <= xtr.min() and xtr.max() <= 1.0


def test_npz_data_with_labels_and_holdout(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.random.default_rng(0).random((50, 4)), _labels=np.arange(50) % 3)
    data = load_train_data(str(path))
    assert len(data.train) == 40 and len(data.eval) == 10
    x, y = data.train[0]
    assert x.dtype.is_floating_point and x.shape == (4,) and int(y) in (0, 1, 2)


def test_npz_data_errors(tmp_path):
    no_labels = tmp_path / "a.npz"
    np.savez(no_labels, x=np.zeros((4, 2), np.float32))
    with pytest.raises(InvalidInputError, match="_labels"):
        load_train_data(str(no_labels))
    with pytest.raises(InvalidInputError, match="no such file"):
        load_train_data(str(tmp_path / "missing.npz"))
    with pytest.raises(InvalidInputError, match="unknown data set 'mnist'"):
        load_train_data("mnist")


def test_model_source_errors():
    with pytest.raises(ModelLoadError, match="no such file"):
        build_model("models/none.py:build")
    with pytest.raises(ModelLoadError, match="callables defined there: .*build"):
        build_model(str(ROOT / "models/digits_cnn.py") + ":nope")
    assert split_source("models/mlp.py") == (Path("models/mlp.py"), "build")
    assert type(build_model(str(ROOT / "models/mlp.py:build"))).__name__ == "MLP"


def test_lr_schedule_warmup_then_cosine_to_zero():
    fn = lr_lambda("cosine", 4, 20)
    values = [fn(s) for s in range(21)]
    assert values[:4] == sorted(values[:4]) and values[3] < 1.0
    assert values[4] == pytest.approx(1.0) and values[20] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(values[4:], values[5:], strict=False))
    assert lr_lambda("constant", 0, 10)(7) == 1.0


def test_carry_best_copies_the_resumed_runs_best(tmp_path, caplog):
    import torch

    from mpinfer.train.checkpoint import carry_best

    old = tmp_path / "old"
    old.mkdir()
    torch.save({"epoch": 1}, old / "best.pt")
    dest = carry_best(old / "last.pt", tmp_path / "new" / "best.pt", {"epoch": 3})
    assert dest.read_bytes() == (old / "best.pt").read_bytes()
    (old / "best.pt").unlink()
    dest = carry_best(old / "last.pt", tmp_path / "new2" / "best.pt", {"epoch": 3})
    assert torch.load(dest, weights_only=True) == {"epoch": 3} and "instead of the best" in caplog.text


def test_a_last_training_batch_of_one_sample_is_skipped():
    # BatchNorm in training mode cannot normalise one sample; 9 samples in batches of 4 leave one over
    import torch
    from torch.utils.data import TensorDataset

    from mpinfer.train.data import make_loader

    ds = TensorDataset(torch.arange(9.0), torch.zeros(9, dtype=torch.long))
    loader = make_loader(ds, batch_size=4, shuffle=True, seed=0, rank=0, world=1)
    assert [len(b[0]) for b in loader] == [4, 4]
    loader = make_loader(TensorDataset(torch.arange(10.0), torch.zeros(10, dtype=torch.long)), batch_size=4,
                         shuffle=True, seed=0, rank=0, world=1)
    assert [len(b[0]) for b in loader] == [4, 4, 2]  # other remainders are kept


def test_without_data_a_model_file_trains_on_its_own_train_data_else_digits(tmp_path):
    from mpinfer.train.source import load_run_data

    data, names = load_run_data(str(ROOT / "models/transformer_small.py:build"), None, None)
    x, y = data.train[0]
    assert x.dtype.is_floating_point is False and x.shape == (16,) and 0 <= int(y) < 4
    assert len(data.train) == 512 and len(data.eval) == 128 and "train_data()" in names[0]
    digits, names = load_run_data(str(ROOT / "models/digits_cnn.py:build"), None, None)
    assert "digits" in digits.description and names[0] == "--data 'digits'"
    (tmp_path / "bad.py").write_text("import torch\ndef build():\n    return torch.nn.Linear(2, 2)\n"
                                     "def train_data():\n    return [1, 2, 3]\n")
    with pytest.raises(ModelLoadError, match=r"train_data\(\).*a list.*a tuple \(train, eval\)"):
        load_run_data(f"{tmp_path / 'bad.py'}:build", None, None)


def test_a_resume_at_another_world_size_names_the_batch_size_that_keeps_the_samples_per_step(caplog):
    from mpinfer.train.checkpoint import check_samples_per_step

    assert check_samples_per_step(32, 2, 64, 1) == []
    assert check_samples_per_step(32, 2, 32, 1) == ["samples per step (--batch-size x processes): 64 -> 32"]
    assert "pass --batch-size 64 to keep them" in caplog.text
    check_samples_per_step(32, 2, 32, 3)
    assert "no --batch-size keeps them over 3 process(es)" in caplog.text
