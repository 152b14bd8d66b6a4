"""Run under torchrun by test_fsdp_spawn.py: fp16 under FSDP on 2 processes (gloo), each rank's summary saved."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset


def main(out: Path) -> None:
    from models import digits_cnn
    from mpinfer.train import AmpConfig, AmpTrainer
    from mpinfer.train.data import digits_arrays

    torch.set_num_threads(1)
    xtr, ytr, xte, yte = digits_arrays()
    cfg = AmpConfig(
        lambda: digits_cnn.build(width=8),  # BatchNorm: sharded on its own with FP32 weights
        out / "run",
        data=TensorDataset(torch.from_numpy(xtr[:512]), torch.from_numpy(ytr[:512])),
        eval_data=TensorDataset(torch.from_numpy(xte[:97]), torch.from_numpy(yte[:97])),  # 49 + 48: 4 + 3 batches
        precision="fp16",
        device="cpu",
        epochs=1,
        batch_size=16,
        grad_accum=2,
        clip_grad_norm=1.0,
        init_scale=2.0**24,  # overflows FP16 gradients at first: the scaler halves it until they fit
        overflow_report=True,
        quiet=True,
        strategy="fsdp",
    )
    result = AmpTrainer(cfg).fit()
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result.summary))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
