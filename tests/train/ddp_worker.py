"""Run under torchrun by test_ddp.py: train through the API on 2 processes (gloo), save this rank's state."""

from __future__ import annotations

import json
import logging
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
    train = TensorDataset(torch.from_numpy(xtr[:320]), torch.from_numpy(ytr[:320]))
    evl = TensorDataset(torch.from_numpy(xte[:101]), torch.from_numpy(yte[:101]))
    cfg = AmpConfig(
        lambda: digits_cnn.build(width=8),
        out / "run",
        data=train,
        eval_data=evl,
        precision="bf16",
        device="cpu",
        epochs=2,
        batch_size=16,
        grad_accum=2,  # exercises DDP's no_sync on the first micro-batch
        clip_grad_norm=1.0,
        quiet=True,
    )
    teardown = _Records()
    logging.getLogger("mpinfer.train.distributed").addHandler(teardown)
    logging.getLogger("mpinfer.train.distributed").setLevel(logging.DEBUG)
    trainer = AmpTrainer(cfg)
    result = trainer.fit()
    rank = int(os.environ["RANK"])
    torch.save(trainer.model.state_dict(), out / f"rank{rank}.pt")
    summary = {**result.summary, "teardown_log": teardown.messages}
    (out / f"rank{rank}.json").write_text(json.dumps(summary))


class _Records(logging.Handler):
    """Keeps the messages logged, to show whether the process group outlived the trainer's teardown."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
