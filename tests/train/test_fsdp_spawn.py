"""--strategy fsdp over 2 gloo processes under torchrun (slow): the issue's command, resume 2 -> 2 bit-exactly,
2 -> 1 and 1 -> 2 along the same loss curve, and each rank's share of the ddp run's state bytes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import pytest
import torch

from tests.tolerances import eps
from tests.train.test_ddp import GLOO_EXIT_ABORT

ROOT = Path(__file__).resolve().parents[2]
MODEL = "models/transformer_small.py:build"
# The done-when bound of the issue: each rank holds at most this share of a ddp rank's parameter + gradient +
# AdamW bytes at 2 processes (half, plus what dim-0 sharding cannot split evenly).
FSDP_SHARE_AT_2 = 0.6
# 2 epochs of 8 optimizer steps; a constant LR without warm-up, so that a run of --epochs 1 resumed with
# --epochs 2 follows the schedule of one run of --epochs 2.
COMMON = ("--precision", "bf16", "--schedule", "constant", "--warmup-steps", "0", "--quiet")
GLOBAL_BATCH = 64


def _run(args: list[str], out: Path, world: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)] if world > 1 else []
    cmd = [sys.executable, *launcher, "-m", "mpinfer", "train", MODEL, *COMMON,
           "--batch-size", str(GLOBAL_BATCH // world), *args, "-o", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and GLOO_EXIT_ABORT in proc.stderr and "(SIGABRT)" in proc.stderr:
        # the exit-time gloo abort test_ddp.py describes: once more, from the same starting point
        if "--resume" not in args:
            shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _ckpt(run: Path) -> dict:
    return torch.load(run / "last.pt", weights_only=True)


@pytest.mark.slow
def test_fsdp_two_processes_train_resume_anywhere_and_hold_half_the_state(tmp_path):
    two = tmp_path / "two"
    proc = _run(["--strategy", "fsdp", "--epochs", "2"], two, 2)
    assert "2 processes, fsdp)" in proc.stdout
    ref = _ckpt(two)
    assert ref["world_size"] == 2 and ref["epoch"] == 2 and ref["metrics"][-1]["eval_accuracy"] is not None
    assert (two / ref["shards"] / "__1_0.distcp").is_file()  # one shard file per rank

    # 2 -> 2: bit-exact; 2 -> 1 and 1 -> 2: the same curve within bf16's rounding
    _run(["--strategy", "fsdp", "--epochs", "1"], tmp_path / "a", 2)
    shutil.copytree(tmp_path / "a", tmp_path / "a2")
    _run(["--strategy", "fsdp", "--epochs", "2", "--resume", str(tmp_path / "a2" / "last.pt")], tmp_path / "a2", 2)
    _run(["--strategy", "fsdp", "--epochs", "2", "--resume", str(tmp_path / "a" / "last.pt")], tmp_path / "a", 1)
    _run(["--strategy", "fsdp", "--epochs", "1"], tmp_path / "b", 1)
    _run(["--strategy", "fsdp", "--epochs", "2", "--resume", str(tmp_path / "b" / "last.pt")], tmp_path / "b", 2)

    same = _ckpt(tmp_path / "a2")
    for key, value in ref["model"].items():
        assert torch.equal(value, same["model"][key]), key
    assert [r["train_loss"] for r in same["metrics"]] == [r["train_loss"] for r in ref["metrics"]]
    # Over 1 and 2 processes the same 64 samples make each step; only the order of the FP32 gradient sums
    # differs, and a parameter whose FP32 value then rounds to another BF16 value changes the forward by one
    # BF16 ulp. The losses (0.8 to 1.3) stay within one BF16 ulp (2**-7) of each other, relative: bench/fsdp.py
    # measured differences up to 9e-4 absolute at 1, 2 and 4 processes over the same 16 steps.
    rtol = eps(ml_dtypes.bfloat16)
    for run in ("a", "b"):
        got = _ckpt(tmp_path / run)
        assert got["world_size"] == (1 if run == "a" else 2) and got["epoch"] == 2
        for mine, theirs in zip(got["metrics"], ref["metrics"], strict=True):
            for key in ("train_loss", "eval_loss"):
                assert mine[key] == pytest.approx(theirs[key], rel=rtol), (run, mine["epoch"], key)

    # per-rank bytes, measured from the local tensors: fsdp against ddp at 2 processes
    _run(["--strategy", "ddp", "--epochs", "1"], tmp_path / "ddp", 2)
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())["rank_state_bytes"]
    fsdp = json.loads((two / "summary.json").read_text())["rank_state_bytes"]
    assert fsdp["total"] <= FSDP_SHARE_AT_2 * ddp["total"], (fsdp, ddp)
    assert ddp["parameters"] == sum(t.numel() * 4 for t in ref["model"].values() if t.is_floating_point())


@pytest.mark.slow
def test_fsdp_fp16_ranks_skip_the_same_steps(tmp_path):
    """Each rank sees the Inf/NaN of its own gradient shard only; the sharded scaler all-reduces the flag, so
    both skip the same steps and keep the same scale (else their shards would update out of step)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).with_name("fsdp_worker.py")), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and GLOO_EXIT_ABORT in proc.stderr and "(SIGABRT)" in proc.stderr:
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s0, s1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert s0["skipped_steps"] == s1["skipped_steps"] > 0 and s0["loss_scale"] == s1["loss_scale"] < 2.0**24
    assert s0["optimizer_steps"] == s1["optimizer_steps"] > 0
    assert s0["eval_accuracy"] == s1["eval_accuracy"]  # uneven evaluation shards (4 and 3 batches), summed
    assert (tmp_path / "run" / "overflow.json").is_file()
