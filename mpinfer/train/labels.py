"""Labels: integer class indices checked against the model's number of classes before training starts.

A label outside ``0 .. classes - 1`` makes ``cross_entropy`` fail mid-epoch (an ``IndexError`` on CPU, a
device-side assert on CUDA, silently ignored for -100), so sets whose labels are known up front are checked
before the run folder is created.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.train import checkpoint as ck
from mpinfer.train.data import ArrayDataset, TrainData

logger = logging.getLogger(__name__)


def num_classes(model: Any, dataset: Any, forward: Callable[[Any], Any]) -> int | None:
    """The model's number of classes: the logits' size on one sample (eval mode, no grad, RNG untouched).

    Args:
        model: The ``nn.Module`` (put back in the mode it was in).
        dataset: The training set; its first sample is used.
        forward: Runs the model on a batch of inputs and returns the logits.

    Returns:
        The number of classes, or None when it cannot be told (no samples, logits not ``(N, C)``, or the
        forward pass fails: the training loop then reports that failure where it happens).
    """
    import torch
    from torch.utils.data import default_collate

    if len(dataset) == 0:
        return None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), ck.preserved_global_rng():
            logits = forward(default_collate([dataset[0][0]]))
    except Exception:  # user model code: leave the failure to the training loop, which reports it
        logger.debug("could not run the model on one sample to count its classes", exc_info=True)
        return None
    finally:
        model.train(was_training)
    shape = tuple(getattr(logits, "shape", ()))
    return int(shape[1]) if len(shape) == 2 else None


def cross_entropy(logits: Any, labels: Any, **kwargs: Any) -> Any:
    """``cross_entropy`` with a clear error for labels that are not class indices (seen on CPU)."""
    import torch

    try:
        return torch.nn.functional.cross_entropy(logits, labels, **kwargs)
    except IndexError as err:  # "Target 12 is out of bounds."
        raise InvalidInputError(
            format_message(
                "Training labels",
                f"a label outside the model's classes ({err})",
                f"class indices 0..{logits.shape[-1] - 1}",
                "labels must be 0-based class indices; remap them or give the model more outputs",
            )
        ) from err


def check_labels(data: TrainData, classes: int | None, names: tuple[str, str]) -> None:
    """Refuse labels that are not class indices ``0 .. classes - 1``.

    Only sets whose labels are known without iterating (``ArrayDataset``: digits, ``.npz``) are checked.

    Args:
        data: The training and evaluation sets.
        classes: The model's number of classes (see :func:`num_classes`); None checks only for negatives.
        names: What the training and the evaluation sets are, for the message (``"--data 'x.npz'"``).

    Raises:
        InvalidInputError: Naming the set, the bad label range and the expected one.
    """
    for ds, name in ((data.train, names[0]), (data.eval, names[1])):
        if not isinstance(ds, ArrayDataset) or len(ds) == 0:
            continue
        labels = ds.labels
        bad = (labels < 0) if classes is None else (labels < 0) | (labels >= classes)
        n_bad = int(bad.sum())
        if n_bad == 0:
            continue
        expected = "class indices >= 0" if classes is None else (
            f"class indices 0..{classes - 1} (the model has {classes} outputs)")
        raise InvalidInputError(
            format_message(
                f"Labels of {name}",
                f"_labels from {int(labels.min())} to {int(labels.max())} ({n_bad} of {len(ds)} out of range)",
                expected,
                "_labels must be 0-based class indices; shift or remap them, or give the model more outputs",
            )
        )
