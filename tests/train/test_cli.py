"""`mpinfer train` through click: the happy path, and each user mistake (exit 1, one Error: line)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import assert_user_error


@pytest.fixture
def trained_run(invoke, tmp_path):
    out = tmp_path / "runs" / "digits"
    result = invoke(
        "train",
        "models/digits_cnn.py:build",
        "--data",
        "digits",
        "--precision",
        "fp32",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--overflow-report",
        "-o",
        out,
    )
    assert result.exit_code == 0, result.output
    return out, result


def test_train_cli_writes_run_and_summary_line(trained_run):
    out, result = trained_run
    assert sorted(p.name for p in out.iterdir()) == [
        "best.pt",
        "last.pt",
        "metrics.jsonl",
        "overflow.json",
        "summary.json",
    ]
    lines = [line for line in result.output.splitlines() if line.startswith("Trained")]
    assert len(lines) == 1 and "accuracy" in lines[0] and "samples/s" in lines[0], result.output
    assert "Overflow report:" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs_done"] == 1
    # best.pt is named with its own epoch and accuracy (not the last epoch's)
    best = summary["best"]
    assert f"Best: epoch {best['epoch']}, accuracy {best['eval_accuracy']:.4f} -> " in result.output
    assert torch.load(out / "best.pt", weights_only=True)["config"]["batch_size"] == 32


def test_resume_continues_and_force_overwrites(invoke, trained_run):
    out, _ = trained_run
    result = invoke(
        "train",
        "models/digits_cnn.py:build",
        "--precision",
        "fp32",
        "--epochs",
        "2",
        "--batch-size",
        "32",
        "--quiet",
        "--resume",
        out / "last.pt",
        "-o",
        out,
    )
    assert result.exit_code == 0, result.output
    assert [json.loads(x)["epoch"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    result = invoke("train", "models/digits_cnn.py:build", "--epochs", "1", "--quiet", "--force", "-o", out)
    assert result.exit_code == 0, result.output
    assert not (out / "overflow.json").exists()  # stale artefact of the replaced run is gone
    assert torch.load(out / "last.pt", weights_only=True)["config"]["precision"] == "bf16"


def test_missing_model_file(invoke, tmp_path):
    result = invoke("train", "models/nope.py:build", "-o", tmp_path / "out")
    assert_user_error(result, r"Model file 'models/nope.py'.*no such file")
    assert not (tmp_path / "out").exists()


def test_missing_factory(invoke, tmp_path):
    result = invoke("train", "models/digits_cnn.py:make_model", "-o", tmp_path / "out")
    assert_user_error(result, r"factory 'make_model'.*callables defined there: .*build")
    assert not (tmp_path / "out").exists()


def test_unknown_data(invoke, tmp_path):
    result = invoke("train", "models/digits_cnn.py:build", "--data", "cifar10", "-o", tmp_path / "out")
    assert_user_error(result, r"Data 'cifar10'.*unknown data set.*Hint")
    assert not (tmp_path / "out").exists()


def test_existing_run_without_force_or_resume(invoke, trained_run):
    out, _ = trained_run
    before = (out / "last.pt").stat().st_mtime_ns
    result = invoke("train", "models/digits_cnn.py:build", "--epochs", "1", "-o", out)
    assert_user_error(result, r"earlier run \(best.pt, last.pt.*--force.*--resume")
    assert (out / "last.pt").stat().st_mtime_ns == before


def test_resume_from_another_models_checkpoint(invoke, trained_run, tmp_path):
    out, _ = trained_run
    result = invoke(
        "train", "models/resnet_small.py:build", "--resume", out / "last.pt", "-o", tmp_path / "new"
    )
    assert_user_error(result, r"weights of another model \(missing stem.0.weight")
    assert not (tmp_path / "new").exists()


def test_resume_from_a_non_checkpoint(invoke, tmp_path):
    bogus = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, bogus)
    result = invoke("train", "models/digits_cnn.py:build", "--resume", bogus, "-o", tmp_path / "new")
    assert_user_error(result, r"a file without model, optimizer")


def test_resume_of_a_finished_run(invoke, trained_run):
    out, _ = trained_run
    result = invoke(
        "train",
        "models/digits_cnn.py:build",
        "--precision",
        "fp32",
        "--epochs",
        "1",
        "--resume",
        out / "last.pt",
        "-o",
        out,
    )
    assert_user_error(result, r"finished 1 epochs.*larger --epochs")


def test_cuda_requested_without_gpu(invoke, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = invoke("train", "models/digits_cnn.py:build", "--device", "cuda", "-o", tmp_path / "out")
    assert_user_error(result, r"Device 'cuda'.*--device cpu")
    assert not (tmp_path / "out").exists()


def test_resume_into_another_runs_folder_is_refused(invoke, trained_run, tmp_path):
    out, _ = trained_run
    other = tmp_path / "runs" / "other"
    other.mkdir()
    (other / "last.pt").write_bytes((out / "last.pt").read_bytes())
    (other / "metrics.jsonl").write_text("{}\n")
    result = invoke("train", "models/digits_cnn.py:build", "--precision", "fp32", "--epochs", "2", "--resume",
                    out / "last.pt", "-o", other)
    assert_user_error(result, r"artefacts of another run .* than --resume.*-o .*digits continues that run")
    assert (other / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.parametrize(
    ("model", "arrays", "pattern"),
    [
        ("models/mlp.py:build", None, r"Model on --data 'digits'.*mat1 and mat2"),  # 8x8 images into a 64-vector MLP
        ("models/digits_cnn.py:build", {"x": ("f", (20, 64))}, r"one sample of shape \(64,\).*conv2d"),
        ("models/transformer_small.py:build", {"input_ids": ("i", (20, 16))}, r"IndexError: index out of range"),
    ],
)
def test_data_the_model_cannot_run_is_refused_before_the_run_folder(invoke, tmp_path, model, arrays, pattern):
    import numpy as np

    data = "digits"
    if arrays is not None:
        rng = np.random.default_rng(0)
        made = {k: rng.random(shape, dtype=np.float32) if kind == "f" else rng.integers(5000, 6000, shape)
                for k, (kind, shape) in arrays.items()}
        np.savez(tmp_path / "d.npz", **made, _labels=rng.integers(0, 2, 20))
        data = str(tmp_path / "d.npz")
    result = invoke("train", model, "--data", data, "--epochs", "1", "-o", tmp_path / "out")
    assert_user_error(result, pattern)
    assert not (tmp_path / "out").exists()


def test_resume_with_a_new_lr_and_weight_decay_uses_them(invoke, trained_run):
    out, _ = trained_run
    result = invoke("train", "models/digits_cnn.py:build", "--precision", "fp32", "--epochs", "2", "--batch-size",
                    "32", "--lr", "0.01", "--weight-decay", "0.5", "--quiet", "--resume", out / "last.pt", "-o", out)
    assert result.exit_code == 0, result.output
    ckpt = torch.load(out / "last.pt", weights_only=True)
    assert ckpt["config"]["lr"] == 0.01 and ckpt["config"]["weight_decay"] == 0.5
    assert ckpt["scheduler"]["base_lrs"] == [0.01]  # what the checkpoint says is what ran
    assert {g["weight_decay"] for g in ckpt["optimizer"]["param_groups"]} == {0.5}


class _RunsCode:
    def __reduce__(self):
        import os

        return (os.getcwd, ())


def test_resume_from_a_pickle_with_code_says_weights_only_refused_it(invoke, tmp_path):
    torch.save({"model": _RunsCode()}, tmp_path / "evil.pt")
    result = invoke("train", "models/digits_cnn.py:build", "--resume", tmp_path / "evil.pt", "-o", tmp_path / "new")
    assert_user_error(result, r"objects other than tensors and plain data, refused by torch.load\(weights_only=True\)")
    assert not (tmp_path / "new").exists()


@pytest.mark.slow  # five epochs of the digits CNN (~1-2 min on a shared 2-core CPU)
def test_docs_train_resume_example_runs_as_written(tmp_path, monkeypatch, cli_runner):
    """docs/train.md's quick tour: train, then train the finished run further with --resume (was refused)."""
    import shlex

    from mpinfer.cli import main
    from tests.conftest import ROOT

    block = (ROOT / "docs" / "train.md").read_text().split("```bash", 1)[1].split("```", 1)[0]
    lines = [ln.strip() for ln in block.splitlines() if ln.startswith("mpinfer train") and "--device cuda" not in ln]
    assert len(lines) == 2 and "--resume" in lines[1], lines
    (tmp_path / "models").symlink_to(ROOT / "models")
    monkeypatch.chdir(tmp_path)
    for line in lines:
        result = cli_runner.invoke(main, ["-q", *shlex.split(line)[1:]])
        assert result.exit_code == 0, f"{line}\n{result.output}"
    epochs = (tmp_path / "runs" / "digits" / "metrics.jsonl").read_text().splitlines()
    assert len(epochs) == 5, epochs  # 3, then 2 more
