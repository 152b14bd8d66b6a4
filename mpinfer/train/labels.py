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


def num_classes(model: Any, dataset: Any, forward: Callable[[Any], Any], what: str = "--data") -> int | None:
    """The model's number of classes: the logits' size on one sample (eval mode, no grad, RNG untouched).

    The one-sample run is also the check that the data fits the model, before any run folder exists: a
    forward pass that fails (a shape the model does not take, token ids out of its vocabulary, an input it
    has no argument for) or an output that is not logits is refused here, naming the data, instead of a
    traceback from inside the training loop.

    Args:
        model: The ``nn.Module`` (put back in the mode it was in).
        dataset: The training (or evaluation) set; its first sample is used.
        forward: Runs the model on a batch of inputs and returns the logits.
        what: The data as the user named it (``--data 'x.npz'``), for messages.

    Returns:
        The number of classes, or None when it cannot be told (no samples, logits not ``(N, C)``).

    Raises:
        InvalidInputError: The model cannot run on the data's first sample, or returns no tensor of logits.
    """
    import torch
    from torch.utils.data import default_collate

    if len(dataset) == 0:
        return None
    was_training = model.training
    model.eval()
    sample = dataset[0][0]
    try:
        with torch.no_grad(), ck.preserved_global_rng():
            logits = forward(default_collate([sample]))
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError) as err:
        raise InvalidInputError(
            format_message(
                f"Model on {what}",
                f"inputs it cannot run ({_describe(sample)}: {type(err).__name__}: {str(err).splitlines()[0]})",
                "data shaped, typed and named as the model's forward() takes it",
                "check the arrays of the data file (one per forward() argument, samples first) against the model",
            )
        ) from err
    finally:
        model.train(was_training)
    if not isinstance(logits, torch.Tensor):
        raise InvalidInputError(
            format_message(
                f"Model on {what}",
                f"an output of type {type(logits).__name__}",
                "a tensor of logits (or a tuple whose first item is one, or an object with .logits)",
                "return the logits from forward(), or wrap the model so that it does",
            )
        )
    shape = tuple(logits.shape)
    return int(shape[1]) if len(shape) == 2 else None


def check_same_inputs(data: TrainData, classes: int | None, eval_classes: int | None, names: tuple[str, str]) -> None:
    """The evaluation set's samples have the training set's shapes and give as many classes.

    Raises:
        InvalidInputError: Another sample shape (8x8 images against 16x16: a pooling model runs both and
            reports accuracy on inputs it was not trained on) or another number of classes.
    """
    if data.eval is None or len(data.eval) == 0 or len(data.train) == 0:
        return
    train, held = _describe(data.train[0][0]), _describe(data.eval[0][0])
    if train != held or classes != eval_classes:
        got = f"{held}, {eval_classes} classes" if train == held else held
        want = f"{train}, {classes} classes" if train == held else train
        raise InvalidInputError(
            format_message(f"Evaluation data {names[1]}", got, f"the training data's: {want}",
                           f"evaluate on data shaped like {names[0]}")
        )


def _describe(sample: Any) -> str:
    """One sample's inputs as ``shape dtype`` (per name for a dict of inputs)."""
    if isinstance(sample, dict):
        return ", ".join(f"{k} {_describe(v)}" for k, v in sample.items())
    if isinstance(sample, (list, tuple)):
        return ", ".join(_describe(v) for v in sample)
    shape, dtype = getattr(sample, "shape", None), getattr(sample, "dtype", None)
    return f"one sample of shape {tuple(shape)} {dtype}" if shape is not None else type(sample).__name__


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
