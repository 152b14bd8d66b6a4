"""Evidence on CPU: accuracy on digits, bit-exact resume, overflow diagnostics, checkpoint format."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from mpinfer.train import AmpConfig, AmpTrainer, train_model
from tests.train.helpers import TIMINGS, amplified_mlp, dropout_cnn, plain_mlp

# models/digits_cnn.py reaches ~0.98 on the 400 held-out digits after 3 epochs in fp32 and bf16 on CPU;
# 0.9 leaves room for thread-count and platform differences.
DIGITS_ACCURACY = 0.9


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_digits_cnn_reaches_accuracy(tmp_path, precision):
    result = train_model(
        AmpConfig(
            "models/digits_cnn.py:build",
            tmp_path / "run",
            data="digits",
            precision=precision,
            device="cpu",
            epochs=3,
            quiet=True,
        )
    )
    s = result.summary
    assert s["eval_accuracy"] >= DIGITS_ACCURACY, s
    assert s["status"] == "completed" and s["epochs_done"] == 3 and s["skipped_steps"] == 0
    assert s["samples_per_s"] > 0 and s["peak_memory_bytes"] > 0 and s["peak_memory_kind"] == "cpu_peak_rss"
    records = [json.loads(line) for line in result.metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["eval_accuracy"] == s["eval_accuracy"]
    ckpt = torch.load(result.best, weights_only=True)
    assert {"model", "optimizer", "amp_scaler", "scheduler", "epoch", "rng", "config", "metrics"} <= set(ckpt)
    assert ckpt["config"]["precision"] == precision and ckpt["epoch"] == s["best"]["epoch"]
    from models.digits_cnn import build

    model = build()
    model.load_state_dict(ckpt["model"])  # what `mpinfer export --weights` does


def _state(path):
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_resume_matches_uninterrupted_run_bit_exactly(tmp_path, digits_small, precision):
    train, evl = digits_small

    def cfg(out, **kw):
        return AmpConfig(
            dropout_cnn,
            tmp_path / out,
            data=train,
            eval_data=evl,
            precision=precision,
            device="cpu",
            epochs=3,
            batch_size=48,
            grad_accum=2,
            clip_grad_norm=1.0,
            quiet=True,
            **kw,
        )

    AmpTrainer(cfg("full")).fit()
    partial = AmpTrainer(cfg("split")).fit(stop_after_epoch=1)
    assert partial.summary["status"] == "partial" and partial.summary["epochs_done"] == 1
    torch.manual_seed(123), np.random.seed(7), random.seed(9)  # a fresh process would not share RNG state
    resumed = AmpTrainer(cfg("split", resume=tmp_path / "split" / "last.pt")).fit()
    assert resumed.summary["epochs_done"] == 3
    full, split = _state(tmp_path / "full" / "last.pt"), _state(tmp_path / "split" / "last.pt")
    for key, value in full["model"].items():
        assert torch.equal(value, split["model"][key]), key
    for sid, st in full["optimizer"]["state"].items():
        for name, t in st.items():
            assert torch.equal(t, split["optimizer"]["state"][sid][name]), (sid, name)
    assert full["amp_scaler"] == split["amp_scaler"] and full["scheduler"] == split["scheduler"]
    drop_times = [
        {k: v for k, v in r.items() if k not in TIMINGS}
        for r in full["metrics"]
    ]
    assert drop_times == [
        {k: v for k, v in r.items() if k not in TIMINGS}
        for r in split["metrics"]
    ]
    lines = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [1, 2, 3]


def test_resume_without_restored_rng_would_differ(tmp_path, digits_small):
    """Guards the test above: dropout makes the result depend on the RNG state, so restoring it matters."""
    train, evl = digits_small
    weights = []
    for seed in (0, 1):
        trainer = AmpTrainer(
            AmpConfig(
                dropout_cnn,
                tmp_path / str(seed),
                data=train,
                eval_data=evl,
                precision="fp32",
                device="cpu",
                epochs=1,
                batch_size=64,
                seed=seed,
                quiet=True,
            )
        )
        trainer.fit()
        weights.append(trainer.model.state_dict()["5.weight"])
    assert not torch.equal(*weights)


def test_overflow_report_names_the_overflowing_module(tmp_path, digits_small):
    train, evl = digits_small
    result = train_model(
        AmpConfig(
            amplified_mlp,
            tmp_path / "run",
            data=train,
            eval_data=evl,
            precision="fp32",
            device="cpu",
            epochs=1,
            batch_size=32,
            overflow_report=True,
            overflow_every=2,
            quiet=True,
        )
    )
    assert result.overflow == tmp_path / "run" / "overflow.json"
    report = json.loads(result.overflow.read_text())
    assert report["schema_version"] == 1 and report["precision"] == "fp16" and report["sampled_steps"] == 4
    flagged = {(e["module"], e["kind"]): e for e in report["modules"]}
    amp = flagged[("3", "activation")]
    assert amp["type"] == "Scale" and amp["overflow_frac"] > 0 and amp["absmax"] > 65504 and amp["steps"] == 4
    assert ("5", "activation") not in flagged and ("1", "activation") not in flagged
    observed = {(e["module"], e["kind"]) for e in report["observed"]}
    assert ("5", "gradient") in observed and ("1", "activation") in observed
    assert set(report["modules"][0]) == {
        "module",
        "type",
        "kind",
        "overflow_frac",
        "underflow_frac",
        "absmax",
        "steps",
    }


def test_trainer_restores_global_rng(tmp_path, digits_small):
    train, evl = digits_small
    torch.manual_seed(42)
    before = torch.get_rng_state()
    AmpTrainer(
        AmpConfig(dropout_cnn, tmp_path / "r", data=train, eval_data=evl, device="cpu", epochs=1, quiet=True)
    ).fit()
    assert torch.equal(before, torch.get_rng_state())


def test_grad_accumulation_equals_the_large_batch(tmp_path, digits_small):
    train, evl = digits_small
    weights = []
    for batch, accum in ((64, 1), (32, 2), (16, 4)):
        trainer = AmpTrainer(
            AmpConfig(
                plain_mlp,
                tmp_path / f"b{batch}",
                data=train,
                eval_data=evl,
                precision="fp32",
                device="cpu",
                epochs=2,
                batch_size=batch,
                grad_accum=accum,
                quiet=True,
            )
        )
        s = trainer.fit().summary
        assert s["optimizer_steps"] == 8
        weights.append(trainer.model.state_dict())
    for other in weights[1:]:
        for key, value in weights[0].items():
            torch.testing.assert_close(other[key], value, atol=1e-5, rtol=1e-4)


def test_nan_loss_without_scaler_stops_with_a_hint(tmp_path, digits_small):
    from torch import nn

    from mpinfer.train import TrainingDivergedError

    def factory():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10), nn.Softplus(), nn.Linear(10, 10, bias=False))
        with torch.no_grad():
            model[3].weight.fill_(float("inf"))
        return model

    train, evl = digits_small
    with pytest.raises(TrainingDivergedError, match=r"NaN/Inf.*--clip-grad-norm"):
        AmpTrainer(
            AmpConfig(
                factory,
                tmp_path / "run",
                data=train,
                eval_data=evl,
                precision="bf16",
                device="cpu",
                epochs=1,
                batch_size=32,
                quiet=True,
            )
        ).fit()


def test_npz_with_two_named_inputs_feeds_keyword_arguments(tmp_path):
    from torch import nn

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 3)
            self.b = nn.Linear(2, 3)

        def forward(self, left, right):
            return self.a(left) + self.b(right)

    rng = np.random.default_rng(0)
    left, right = rng.normal(size=(200, 4)), rng.normal(size=(200, 2))
    labels = (left[:, 0] > 0).astype(np.int64) + (right[:, 0] > 0)
    np.savez(tmp_path / "two.npz", left=left, right=right, _labels=labels)
    result = train_model(
        AmpConfig(
            TwoInputs,
            tmp_path / "run",
            data=str(tmp_path / "two.npz"),
            precision="fp32",
            device="cpu",
            epochs=5,
            batch_size=8,
            lr=0.05,
            quiet=True,
        )
    )
    assert result.summary["eval_accuracy"] >= 0.8
    assert "160 train / 40 held out" in result.summary["data"]


def test_a_run_whose_every_step_was_skipped_says_so(tmp_path, digits_small, caplog):
    # A loss scale no gradient survives: the scaler skips every step, and the summary used to count them as
    # optimizer steps of a trained model.
    train, evl = digits_small
    cfg = AmpConfig(plain_mlp, tmp_path / "r", data=train, eval_data=evl, precision="fp16", device="cpu",
                    epochs=1, batch_size=64, init_scale=1e38, quiet=True)
    with caplog.at_level("WARNING"):
        s = AmpTrainer(cfg).fit().summary
    # (halving from 1e38 needs ~110 skipped steps to reach FP16's range; one small epoch has far fewer)
    assert s["skipped_steps"] == s["steps"] and s["optimizer_steps"] == 0 and s["steps"] > 0
    assert "Every optimizer step was skipped" in caplog.text
