"""ddp vs fsdp: per-rank parameter + gradient + optimizer bytes, step time and loss curve, through the CLI.

Runs ``mpinfer train`` (under ``torchrun`` for several processes) on ``models/transformer_small.py:build`` and
its own ``train_data()``, with the same samples per optimizer step everywhere (``--batch-size`` = global batch /
processes), a constant LR without warm-up, bf16:

* one process (the reference loss curve),
* ``--strategy ddp`` and ``--strategy fsdp`` at each process count asked for (default 2 and 4).

From each run's ``summary.json`` and ``metrics.jsonl``: ``rank_state_bytes`` (the largest rank's bytes of
parameters, gradients and AdamW state, measured by the trainer from the local tensors, a DTensor's
``to_local()`` under fsdp, after the epoch's first optimizer step), the mean step time of the last epoch,
the per-epoch train and eval loss against the single-process run, and the peak memory (CUDA:
``max_memory_allocated`` of rank 0; CPU: peak RSS of rank 0, which counts the Python runtime too).

Usage::

    python bench/fsdp.py                                 # CPU (gloo): 1, 2 and 4 processes, 2 epochs
    python bench/fsdp.py --procs 2 --epochs 1 --json out/fsdp.json
    python bench/fsdp.py --device cuda --procs 2         # one process per GPU (NCCL)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = "models/transformer_small.py:build"
# Samples per optimizer step in every run: divisible by 1, 2 and 4 processes.
GLOBAL_BATCH = 64


def run(out: Path, procs: int, strategy: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """One training run through the CLI; its summary and epoch records."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    env.pop("WORLD_SIZE", None)
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)] if procs > 1 else []
    cmd = [sys.executable, *launch, "-m", "mpinfer", "train", MODEL, "--precision", args.precision,
           "--device", args.device, "--epochs", str(args.epochs), "--batch-size", str(GLOBAL_BATCH // procs),
           "--schedule", "constant", "--warmup-steps", "0", "--quiet", "-o", str(out)]
    if strategy is not None:
        cmd += ["--strategy", strategy]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"procs": procs, "strategy": strategy or "none", "summary": summary, "records": records}


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table of the runs."""
    ref = results[0]["records"]
    ddp = {r["procs"]: r["summary"]["rank_state_bytes"]["total"] for r in results if r["strategy"] == "ddp"}
    lines = [
        "| strategy | procs | params / grads / optim per rank (KiB) | total (KiB) | vs ddp | step time (s) | "
        "train loss per epoch | max abs diff vs 1 process (train / eval) | peak memory rank 0 (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        b = r["summary"]["rank_state_bytes"]
        recs = r["records"]
        share = f"{b['total'] / ddp[r['procs']]:.2f}" if r["procs"] in ddp else "-"
        dtrain = max(abs(a["train_loss"] - c["train_loss"]) for a, c in zip(recs, ref, strict=True))
        deval = max(abs(a["eval_loss"] - c["eval_loss"]) for a, c in zip(recs, ref, strict=True))
        curve = " / ".join(f"{x['train_loss']:.4f}" for x in recs)
        lines.append(
            f"| {r['strategy']} | {r['procs']} | {b['parameters'] / 1024:.1f} / {b['gradients'] / 1024:.1f} / "
            f"{b['optimizer'] / 1024:.1f} | {b['total'] / 1024:.1f} | {share} | {recs[-1]['step_time_s']:.3f} | "
            f"{curve} | {dtrain:.2g} / {deval:.2g} | "
            f"{r['summary']['peak_memory_bytes'] / 2**20:.0f} ({r['summary']['peak_memory_kind']}) |"
        )
    return "\n".join(lines)


def main() -> None:
    """Run the comparison and print the table (and write JSON when asked)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        results.append(run(Path(tmp) / "single", 1, None, args))
        for procs in args.procs:
            for strategy in ("ddp", "fsdp"):
                results.append(run(Path(tmp) / f"{strategy}{procs}", procs, strategy, args))
                print(f"done: {strategy} x{procs}", file=sys.stderr)
    import torch

    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{args.precision}, {args.epochs} epochs, {GLOBAL_BATCH} samples per step")
    print(table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
