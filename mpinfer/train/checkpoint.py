"""Checkpoints: atomic writes, ``weights_only`` loads, RNG state capture for bit-exact resume.

A checkpoint holds only tensors and primitive containers, so ``torch.load(weights_only=True)`` reads it:
``{"model", "optimizer", "amp_scaler", "scheduler", "epoch", "global_step", "rng", "config", "metrics",
"mpinfer_version"}``. ``mpinfer export --weights`` reads ``ckpt["model"]``. An fsdp run's checkpoint has no
``"optimizer"``: ``"shards"`` names the DCP folder (relative to the file) holding the sharded model and optimizer
state, and ``"model"`` is the full FP32 state_dict gathered on rank 0.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.fileio import atomic_path, check_writable_location

logger = logging.getLogger(__name__)

BEST = "best.pt"
LAST = "last.pt"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
OVERFLOW = "overflow.json"
# The DCP folders of an fsdp run (see mpinfer.train.sharded).
SHARDS = "shards"
ARTEFACTS = (BEST, LAST, METRICS, SUMMARY, OVERFLOW, SHARDS)
REQUIRED_KEYS = ("model", "optimizer", "amp_scaler", "scheduler", "epoch", "rng", "config", "metrics")
# An fsdp run's checkpoint keeps the optimizer state in its DCP folder, named by "shards".
SHARDED_REQUIRED_KEYS = tuple(k for k in REQUIRED_KEYS if k != "optimizer") + ("shards",)


def capture_rng() -> dict[str, Any]:
    """Torch, CUDA, numpy and Python RNG states as tensors and lists."""
    import torch

    np_state: Any = np.random.get_state()
    keys, pos, has_gauss, cached = np_state[1:]
    version, pystate, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": int(version), "state": list(pystate), "gauss": gauss},
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng`."""
    import torch

    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    npst = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            npst["keys"].numpy().astype(np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["cached_gaussian"],
        )
    )
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))


@contextlib.contextmanager
def preserved_global_rng() -> Iterator[None]:
    """Save the global RNG states and restore them on exit (the trainer seeds them)."""
    saved = capture_rng()
    try:
        yield
    finally:
        restore_rng(saved)


def seed_everything(seed: int) -> None:
    """Seed torch (all devices), numpy and Python's ``random``."""
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def save_checkpoint(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` with ``torch.save`` atomically (temp file + rename)."""
    import torch

    with atomic_path(path) as tmp:
        torch.save(payload, tmp)
    return path


def carry_best(resume: Path | None, dest: Path, fallback: dict[str, Any]) -> Path:
    """Give a resumed run in a new folder its ``best.pt``: the resumed run's own, else the current state.

    The best epoch may predate the resume; its weights then exist only next to the checkpoint resumed from.
    """
    import shutil

    src = resume.parent / BEST if resume is not None else None
    if src is not None and src.is_file():
        with atomic_path(dest) as tmp:
            shutil.copyfile(src, tmp)
        return dest
    logger.warning("No best.pt next to %s; %s holds the latest epoch instead of the best one.", resume, dest)
    return save_checkpoint(dest, fallback)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a trainer checkpoint with ``weights_only=True`` on CPU.

    Raises:
        InvalidInputError: For a missing, unreadable or non-trainer checkpoint.
    """
    import torch

    if not path.is_file():
        raise InvalidInputError(
            format_message(
                f"Checkpoint '{path}'", "no such file", "a last.pt or best.pt written by mpinfer train"
            )
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for a corrupt or unsafe pickle
        unsafe = "Weights only load failed" in str(err)  # a pickle that holds more than tensors and plain data
        raise InvalidInputError(
            format_message(
                f"Checkpoint '{path}'",
                "a pickle holding objects other than tensors and plain data, refused by "
                "torch.load(weights_only=True)" if unsafe else f"an unreadable file ({type(err).__name__})",
                "a checkpoint written by mpinfer train",
                "checkpoints written by mpinfer train hold only tensors and plain data: this file was not "
                "written by it (and may run code when unpickled)" if unsafe
                else "it may be truncated or not a torch checkpoint",
            )
        ) from err
    required = SHARDED_REQUIRED_KEYS if isinstance(ckpt, dict) and "shards" in ckpt else REQUIRED_KEYS
    missing = [k for k in required if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise InvalidInputError(
            format_message(
                f"Checkpoint '{path}'",
                f"a file without {', '.join(missing)}",
                "a checkpoint written by mpinfer train",
                "a bare state_dict cannot be resumed; start a new run",
            )
        )
    return ckpt  # type: ignore[no-any-return]


def check_same_model(model_state: dict[str, Any], ckpt_state: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint whose parameters do not match the model's names and shapes.

    Raises:
        InvalidInputError: Naming the first differences.
    """
    ours = {k: tuple(v.shape) for k, v in model_state.items()}
    theirs = {k: tuple(v.shape) for k, v in ckpt_state.items()}
    problems = [f"missing {k}" for k in ours if k not in theirs][:3]
    problems += [f"unexpected {k}" for k in theirs if k not in ours][:3]
    problems += [f"{k}: {theirs[k]} vs {s}" for k, s in ours.items() if k in theirs and theirs[k] != s][:3]
    if problems:
        raise InvalidInputError(
            format_message(
                f"Checkpoint '{path}'",
                f"weights of another model ({'; '.join(problems)})",
                "the parameters of the model being trained",
                "resume with the same model source it was trained with, or start a new run with --force",
            )
        )


def check_samples_per_step(batch_then: int, world_then: int, batch_now: int, world_now: int) -> list[str]:
    """Warn when a resume at another world size changes the samples per optimizer step.

    Returns:
        The change, as an entry for the "changed settings" warning (empty when the samples per step are kept).
    """
    then, now = batch_then * world_then, batch_now * world_now
    if then == now:
        return []
    fix = (f"pass --batch-size {then // world_now} to keep them" if then % world_now == 0
           else f"no --batch-size keeps them over {world_now} process(es)")
    logger.warning("Resuming a %d-process run of %d samples per optimizer step in %d process(es) with %d: %s.",
                   world_then, then, world_now, now, fix)
    return [f"samples per step (--batch-size x processes): {then} -> {now}"]


def check_run_dir(output: Path, *, force: bool, resume: Path | None) -> list[Path]:
    """Check the run folder; return the artefacts of an earlier run that ``force`` allows replacing.

    Raises:
        InvalidInputError: If ``output`` is a file or cannot be created or written (a file in its path,
            a read-only or virtual file system), or holds checkpoints and neither force nor resume is set.
    """
    if output.exists() and not output.is_dir():
        raise InvalidInputError(
            format_message(
                f"Output folder '{output}'", "an existing file", "a folder", "choose another -o/--output"
            )
        )
    check_writable_location(output, output)
    found = [output / name for name in ARTEFACTS if (output / name).exists()]
    has_ckpt = any(p.name in (BEST, LAST) for p in found)
    continues = resume is not None and Path(resume).resolve().parent == output.resolve()  # that run's own folder
    if has_ckpt and not force and resume is not None and not continues:
        # resuming run A into the folder of run B would replace B's checkpoints and metrics
        raise InvalidInputError(
            format_message(
                f"Output folder '{output}'",
                f"the artefacts of another run ({', '.join(p.name for p in found)}) than --resume '{resume}'",
                f"a new or empty folder, or the folder of the resumed run ('{Path(resume).parent}')",
                f"-o {Path(resume).parent} continues that run; pass --force to replace the artefacts here",
            )
        )
    if has_ckpt and not force and resume is None:
        names = ", ".join(p.name for p in found)
        raise InvalidInputError(
            format_message(
                f"Output folder '{output}'",
                f"the artefacts of an earlier run ({names})",
                "a new or empty folder",
                f"pass --force to overwrite them, or --resume {output / LAST} to continue that run",
            )
        )
    return found if force and not continues else []
