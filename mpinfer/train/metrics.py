"""Run metrics: per-epoch JSON lines, peak memory, the end-of-run summary."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

from mpinfer.fileio import write_text_atomic


def peak_memory(device: str) -> tuple[int, str]:
    """Peak memory in bytes and how it was measured.

    CUDA: ``torch.cuda.max_memory_allocated`` (tensors allocated by torch since the last reset). CPU: the
    process's peak resident set size from ``resource.getrusage`` (includes the Python runtime and libraries).
    """
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "cpu_peak_rss"


def write_metrics(path: Path, history: list[dict[str, Any]]) -> Path:
    """Rewrite the JSON-lines file from the full history (atomic; resume-safe)."""
    return write_text_atomic(path, "".join(json.dumps(rec, sort_keys=False) + "\n" for rec in history))


def best_index(history: list[dict[str, Any]]) -> int:
    """Index of the best epoch: highest eval accuracy (ties: lower eval loss), else lowest train loss."""

    def key(i: int) -> tuple[float, float]:
        rec = history[i]
        if rec.get("eval_accuracy") is not None:
            return (-rec["eval_accuracy"], rec["eval_loss"])
        return (rec["train_loss"], 0.0)

    return min(range(len(history)), key=lambda i: (key(i), i))


def summarize(history: list[dict[str, Any]], *, status: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The ``summary.json`` document from the epoch history plus run facts."""
    last = history[-1]
    best = history[best_index(history)]
    return {
        "schema_version": 1,
        "status": status,
        "epochs_done": last["epoch"],
        "optimizer_steps": last["step"] - sum(r["skipped_steps"] for r in history),  # applied updates
        "steps": last["step"],  # applied + skipped by the loss scaler
        "train_loss": last["train_loss"],
        "eval_loss": last.get("eval_loss"),
        "eval_accuracy": last.get("eval_accuracy"),
        "best": {
            "epoch": best["epoch"],
            "eval_accuracy": best.get("eval_accuracy"),
            "eval_loss": best.get("eval_loss"),
            "train_loss": best["train_loss"],
        },
        "loss_scale": last["loss_scale"],
        "skipped_steps": sum(r["skipped_steps"] for r in history),
        "samples_per_s": _mean([r["samples_per_s"] for r in history]),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in history),
        "peak_memory_kind": last["peak_memory_kind"],
        **extra,
    }


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0
