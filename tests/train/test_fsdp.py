"""--strategy fsdp in one process (fast, CI): FSDP2 over a one-process gloo group, DCP checkpoints, resume
across strategies, the refusals. The multi-process cases are in test_fsdp_spawn.py (slow)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mpinfer.errors import InvalidInputError
from mpinfer.train import AmpConfig, AmpTrainer
from tests.conftest import assert_user_error
from tests.tolerances import eps
from tests.train.helpers import TIMINGS, dropout_cnn, plain_mlp


def _cfg(tmp_path, out, data, model=dropout_cnn, **kw):
    from torch.utils.data import Subset

    train, evl = Subset(data[0], range(144)), Subset(data[1], range(64))  # 3 optimizer steps per epoch
    base = {"precision": "bf16", "epochs": 2, "batch_size": 48, "grad_accum": 2, "clip_grad_norm": 1.0}
    return AmpConfig(model, tmp_path / out, data=train, eval_data=evl, device="cpu", quiet=True, **{**base, **kw})


def _load(path):
    return torch.load(path, weights_only=True)


def _records(ckpt):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in ckpt["metrics"]]


def test_fsdp_in_one_process_resumes_bit_exactly_and_leaves_the_full_fp32_model(tmp_path, digits_small):
    """bf16 + clipping + accumulation + dropout: the sharded checkpoint restores everything a resume needs."""
    AmpTrainer(_cfg(tmp_path, "full", digits_small, strategy="fsdp")).fit()
    AmpTrainer(_cfg(tmp_path, "split", digits_small, strategy="fsdp")).fit(stop_after_epoch=1)
    torch.manual_seed(123), np.random.seed(7), random.seed(9)  # a fresh process would not share RNG state
    resumed = AmpTrainer(_cfg(tmp_path, "split", digits_small, strategy="fsdp",
                              resume=tmp_path / "split" / "last.pt")).fit()
    assert resumed.summary["strategy"] == "fsdp" and resumed.summary["epochs_done"] == 2
    full, split = _load(tmp_path / "full" / "last.pt"), _load(tmp_path / "split" / "last.pt")
    assert full["shards"] == split["shards"] == "shards/epoch-2" and "optimizer" not in full
    for key, value in full["model"].items():
        assert torch.equal(value, split["model"][key]), key
    assert _records(full) == _records(split)
    assert full["amp_scaler"] == split["amp_scaler"] and full["scheduler"] == split["scheduler"]
    # what export reads: the whole model, plain FP32 tensors under the unwrapped model's names
    best = _load(tmp_path / "split" / "best.pt")
    reference = dropout_cnn().state_dict()
    assert best["model"].keys() == reference.keys()
    assert all(type(t) is torch.Tensor and t.shape == reference[k].shape for k, t in best["model"].items())
    assert all(t.dtype == reference[k].dtype for k, t in best["model"].items())
    # one DCP folder per checkpoint kept (last and best), each with its metadata
    kept = {p.name for p in (tmp_path / "split" / "shards").iterdir()}
    assert kept == {full["shards"].split("/")[1], best["shards"].split("/")[1]}
    assert (tmp_path / "split" / full["shards"] / ".metadata").is_file()
    # the metrics carry this rank's parameter + gradient + AdamW bytes (nothing sharded in one process)
    held = full["metrics"][-1]["rank_state_bytes"]
    params = list(dropout_cnn().parameters())
    n_bytes, steps = sum(t.numel() * 4 for t in params), 4 * len(params)
    # AdamW: exp_avg and exp_avg_sq like the parameter, and a float32 step count per tensor
    assert held == {"parameters": n_bytes, "gradients": n_bytes, "optimizer": 2 * n_bytes + steps,
                    "total": 4 * n_bytes + steps}


def test_checkpoints_move_between_fsdp_and_unsharded_runs(tmp_path, digits_small):
    """An fsdp checkpoint resumes without FSDP (DCP reshards to whole tensors), a single-process checkpoint
    resumes under FSDP (its index-keyed optimizer state is renamed and sharded); in fp32 both continue as the
    uninterrupted run does."""
    kw = {"model": plain_mlp, "precision": "fp32", "clip_grad_norm": None}
    AmpTrainer(_cfg(tmp_path, "full", digits_small, **kw)).fit()
    AmpTrainer(_cfg(tmp_path, "a", digits_small, strategy="fsdp", **kw)).fit(stop_after_epoch=1)
    AmpTrainer(_cfg(tmp_path, "a", digits_small, resume=tmp_path / "a" / "last.pt", **kw)).fit()
    AmpTrainer(_cfg(tmp_path, "b", digits_small, **kw)).fit(stop_after_epoch=1)
    AmpTrainer(_cfg(tmp_path, "b", digits_small, strategy="fsdp", resume=tmp_path / "b" / "last.pt", **kw)).fit()
    full = _load(tmp_path / "full" / "last.pt")
    # the same arithmetic in the same order, except the FSDP gradient reduction (a copy over one process):
    # 4 optimizer steps of AdamW at lr 3e-3 move a weight by at most ~1.2e-2; a rounding difference per step
    # leaves them within a few float32 ulps of their magnitude (< 1); a resume that dropped the optimizer state
    # or the schedule would differ by ~lr
    atol = 64 * eps(np.float32)
    for run in ("a", "b"):
        got = _load(tmp_path / run / "last.pt")
        for key, value in full["model"].items():
            torch.testing.assert_close(got["model"][key], value, atol=atol, rtol=0, msg=f"{run}: {key}")
        assert got["metrics"][-1]["step"] == full["metrics"][-1]["step"]


def test_fsdp_refuses_a_model_without_parameters_and_unknown_blocks(tmp_path, digits_small):
    from torch import nn

    with pytest.raises(InvalidInputError, match="no trainable parameters"):
        AmpTrainer(_cfg(tmp_path, "none", digits_small, model=lambda: nn.Sequential(nn.Flatten()),
                        strategy="fsdp")).fit()

    def named_wrong():
        model = plain_mlp()
        model.fsdp_blocks = ["1", "blocks.0"]
        return model

    with pytest.raises(InvalidInputError, match=r"fsdp_blocks.*blocks\.0"):
        AmpTrainer(_cfg(tmp_path, "wrong", digits_small, model=named_wrong, strategy="fsdp")).fit()
    assert not (tmp_path / "none").exists() and not (tmp_path / "wrong").exists()
    with pytest.raises(InvalidInputError, match="Strategy.*'zero3'.*ddp, fsdp"):
        AmpConfig(plain_mlp, tmp_path / "x", strategy="zero3")


def test_blocks_are_the_children_holding_parameters_or_the_named_ones():
    from torch import nn

    from mpinfer.train.sharded import find_blocks

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(4, 2)
            self.act = nn.ReLU()
            self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
            self.head = nn.Linear(2, 2)

    assert find_blocks(Net()) == ["emb", "blocks.0", "blocks.1", "head"]
    net = Net()
    net.fsdp_blocks = ["blocks"]
    assert find_blocks(net) == ["blocks.0", "blocks.1"]


def test_cli_fsdp_without_torchrun_says_nothing_is_sharded(invoke, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    x = np.random.default_rng(0).random((40, 1, 8, 8), dtype=np.float32)
    np.savez(tmp_path / "d.npz", x=x, _labels=np.arange(40) % 10)
    result = invoke("train", "models/digits_cnn.py:build", "--data", tmp_path / "d.npz", "--strategy", "fsdp",
                    "--epochs", "1", "--batch-size", "16", "--quiet", "-o", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "one-process group, so nothing is sharded" in result.output
    assert "1 process, fsdp)" in result.output
    bad = invoke("train", "models/digits_cnn.py:build", "--strategy", "zero3", "-o", tmp_path / "run2")
    assert bad.exit_code == 2 and "zero3" in bad.output


def test_resuming_an_fsdp_run_whose_shards_are_gone_says_how_to_fix_it(invoke, tmp_path):
    import shutil

    x = np.random.default_rng(0).random((40, 1, 8, 8), dtype=np.float32)
    np.savez(tmp_path / "d.npz", x=x, _labels=np.arange(40) % 10)
    args = ["train", "models/digits_cnn.py:build", "--data", tmp_path / "d.npz", "--strategy", "fsdp",
            "--batch-size", "16", "--quiet"]
    assert invoke(*args, "--epochs", "1", "-o", tmp_path / "run").exit_code == 0
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(tmp_path / "run" / "last.pt", moved / "last.pt")  # without shards/
    result = invoke(*args, "--epochs", "2", "--resume", moved / "last.pt", "-o", moved)
    assert_user_error(result, r"folder .*moved/shards/epoch-1. is missing.*copy that folder whole")


def test_fsdp_fp16_scales_the_loss_clips_unscaled_and_reports_overflow(tmp_path, digits_small, monkeypatch):
    """fp16 under FSDP: the sharded grad scaler skips overflowing steps and stops at the minimum scale (with
    the overflow report written first), and clipping sees the unscaled norm of the DTensor gradients."""
    from mpinfer.train import LossScaleCollapseError
    from tests.train.helpers import amplified_mlp

    with pytest.raises(LossScaleCollapseError, match=r"optimizer step 3: received scale 0.5 after 4 skipped"):
        AmpTrainer(_cfg(tmp_path, "collapse", digits_small, model=amplified_mlp, precision="fp16", epochs=1,
                        batch_size=32, grad_accum=1, init_scale=8.0, overflow_report=True, overflow_every=1,
                        strategy="fsdp")).fit()
    report = (tmp_path / "collapse" / "overflow.json").read_text()
    assert '"module": "3"' in report and not (tmp_path / "collapse" / "last.pt").exists()

    real_clip = torch.nn.utils.clip_grad_norm_
    norms: dict[str, list[float]] = {"fp16": [], "fp32": []}
    for precision, seen in norms.items():

        def spy(params, max_norm, *args, _seen=seen, **kwargs):
            total = real_clip(params, max_norm, *args, **kwargs)
            _seen.append(float(total.full_tensor() if hasattr(total, "full_tensor") else total))
            return total

        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
        run = AmpTrainer(_cfg(tmp_path, precision, digits_small, model=plain_mlp, precision=precision, epochs=1,
                              batch_size=64, grad_accum=1, clip_grad_norm=0.5, init_scale=2.0**10,
                              strategy="fsdp")).fit()
        assert run.summary["skipped_steps"] == 0
    assert len(norms["fp16"]) == len(norms["fp32"]) == 3
    # fp16 weights and activations change the gradient by a few fp16 ulps (2**-10) of the norm, not 2**10 x
    assert norms["fp16"][0] == pytest.approx(norms["fp32"][0], rel=0.05)


def test_only_the_shards_of_last_and_best_are_kept_and_a_carried_best_brings_its_own(tmp_path):
    from mpinfer.train.sharded import copy_shards, prune_shards, shard_dir

    run = tmp_path / "run"
    for epoch in (1, 2, 3):
        (run / shard_dir(epoch)).mkdir(parents=True)
        (run / shard_dir(epoch) / ".metadata").write_text(str(epoch))
    prune_shards(run, [shard_dir(3), shard_dir(1)])
    assert sorted(p.name for p in (run / "shards").iterdir()) == ["epoch-1", "epoch-3"]
    new = tmp_path / "new"
    new.mkdir()
    copy_shards(run / "last.pt", shard_dir(1), new)  # resumed elsewhere: best.pt is epoch 1's, copied along
    assert (new / shard_dir(1) / ".metadata").read_text() == "1"
    assert sorted(p.name for p in (new / "shards").iterdir()) == ["epoch-1"]  # no partial folder left
