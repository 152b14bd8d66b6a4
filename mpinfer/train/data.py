"""Training data: the built-in digits set, ``.npz`` feeds with ``_labels``, or any torch Dataset.

Every sample is ``(inputs, label)``; ``inputs`` is a tensor (one model input) or a dict of tensors keyed by
the model's argument names (several inputs). Loaders shard with ``DistributedSampler`` whether or not the
run is distributed (one replica when it is not), so shuffling is a pure function of ``(seed, epoch)`` and a
resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.data.source import read_npz
from mpinfer.errors import InvalidInputError, format_message

logger = logging.getLogger(__name__)

DIGITS = "digits"
# The digits split every part shares (calibration/digits*.npz): a fixed permutation, the last 400 for test.
DIGITS_SPLIT_SEED = 0
DIGITS_TEST_SIZE = 400
# Share of an .npz held out for evaluation when no eval data is given.
NPZ_HOLDOUT_FRACTION = 0.2
_DATA_HINT = (
    "pass --data digits, an .npz with input arrays and an integer _labels array, or a Dataset via the API"
)


@dataclass
class TrainData:
    """Training and evaluation sets plus where they came from."""

    train: Any
    eval: Any | None
    description: str


def digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The built-in digits split: ``(x_train, y_train, x_test, y_test)``, x as Nx1x8x8 float32 in [0, 1]."""
    with resources.files("mpinfer.data").joinpath("digits.npz").open("rb") as f, np.load(f) as z:
        images, labels = z["images"], z["labels"]
    x = images[:, None].astype(np.float32) / 16
    perm = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(images))
    test, train = perm[-DIGITS_TEST_SIZE:], perm[:-DIGITS_TEST_SIZE]
    return x[train], labels[train].astype(np.int64), x[test], labels[test].astype(np.int64)


class ArrayDataset:
    """A map-style dataset over named arrays (samples on axis 0) and integer labels."""

    def __init__(self, arrays: dict[str, np.ndarray], labels: np.ndarray) -> None:
        import torch

        self._tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
        self._labels = torch.from_numpy(np.ascontiguousarray(labels.astype(np.int64)))
        self._single = next(iter(self._tensors)) if len(self._tensors) == 1 else None

    def __len__(self) -> int:
        return int(self._labels.shape[0])

    @property
    def labels(self) -> Any:
        """The labels, as an int64 tensor."""
        return self._labels

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        if self._single is not None:
            return self._tensors[self._single][i], self._labels[i]
        return {k: t[i] for k, t in self._tensors.items()}, self._labels[i]


def _read_npz(path: Path) -> tuple[dict[str, np.ndarray], np.ndarray]:

    arrays = read_npz(path)
    labels = arrays.pop("_labels", None)
    inputs = {k: v for k, v in arrays.items() if not k.startswith("_")}
    if labels is None or labels.ndim != 1 or labels.dtype.kind not in "iu":
        got = (
            "no _labels array"
            if labels is None
            else f"_labels of shape {labels.shape} and dtype {labels.dtype}"
        )
        raise InvalidInputError(
            format_message(f"Data file '{path}'", got, "a 1-D integer _labels array", _DATA_HINT)
        )
    if not inputs:
        raise InvalidInputError(
            format_message(f"Data file '{path}'", "no input arrays", "one array per model input", _DATA_HINT)
        )
    for name, arr in inputs.items():
        if arr.ndim == 0 or arr.shape[0] != labels.shape[0]:
            raise InvalidInputError(
                format_message(
                    f"Data file '{path}': input '{name}'",
                    f"shape {arr.shape}",
                    f"{labels.shape[0]} samples on axis 0",
                )
            )
        if arr.dtype.kind == "f":
            inputs[name] = arr.astype(np.float32)
            if not np.all(np.isfinite(inputs[name])):
                raise InvalidInputError(
                    format_message(f"Data file '{path}': input '{name}'", "NaN/Inf values", "finite values")
                )
    return inputs, labels


def _from_spec(spec: Any) -> Any:
    """A Dataset from a Dataset (returned as is) or an .npz path."""
    if hasattr(spec, "__getitem__") and hasattr(spec, "__len__") and not isinstance(spec, (str, Path)):
        return spec
    return ArrayDataset(*_read_npz(_checked_npz(spec)))


def load_train_data(data: Any, eval_data: Any = None) -> TrainData:
    """Resolve the config's ``data``/``eval_data`` into datasets.

    Args:
        data: ``"digits"``, an ``.npz`` path, or a Dataset.
        eval_data: Same kinds, or None for the default split.

    Returns:
        The datasets and a description.

    Raises:
        InvalidInputError: For unknown names, missing or malformed files, empty data.
    """
    evl: Any = None
    if isinstance(data, str) and data == DIGITS:
        xtr, ytr, xte, yte = digits_arrays()
        train, evl = ArrayDataset({"x": xtr}, ytr), ArrayDataset({"x": xte}, yte)
        desc = f"digits ({len(ytr)} train / {len(yte)} test, built in)"
    elif isinstance(data, (str, Path)) and eval_data is None:
        inputs, labels = _read_npz(_checked_npz(data))
        perm = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(labels))
        n_eval = int(round(len(labels) * NPZ_HOLDOUT_FRACTION))
        if n_eval == 0 or n_eval == len(labels):
            raise InvalidInputError(
                format_message(
                    f"Data file '{data}'",
                    f"{len(labels)} samples",
                    "at least 3 (20% are held out for evaluation)",
                )
            )
        tr, te = perm[:-n_eval], perm[-n_eval:]
        train = ArrayDataset({k: v[tr] for k, v in inputs.items()}, labels[tr])
        evl = ArrayDataset({k: v[te] for k, v in inputs.items()}, labels[te])
        desc = f"{data} ({len(tr)} train / {n_eval} held out)"
    else:
        train = _from_spec(data)
        desc = f"{data if isinstance(data, (str, Path)) else type(train).__name__} ({len(train)} samples)"
    if eval_data is not None:
        evl = _from_spec(eval_data)
        desc += f", eval {len(evl)} samples"
    if len(train) == 0:
        raise InvalidInputError(format_message("Training data", "0 samples", "at least one sample"))
    return TrainData(train, evl, desc)


def _checked_npz(data: str | Path) -> Path:
    path = Path(data)
    if path.suffix != ".npz" or not path.is_file():
        received = "no such file" if path.suffix == ".npz" else f"an unknown data set {str(data)!r}"
        raise InvalidInputError(
            format_message(f"Data '{data}'", received, "'digits' or an existing .npz file", _DATA_HINT)
        )
    return path


def make_loader(
    dataset: Any, *, batch_size: int, shuffle: bool, seed: int, rank: int, world: int, num_workers: int = 0
) -> Any:
    """A DataLoader whose order depends only on ``(seed, epoch)``; call ``loader.sampler.set_epoch``.

    Training loaders shard with ``DistributedSampler`` (padding the last shard, as DDP needs equal step
    counts); evaluation loaders take every ``world``-th sample from ``rank`` without padding, so summed
    metrics count each sample once.
    """
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    if shuffle:
        # No private generator: the loader draws its worker base seed from the global torch RNG, whose
        # state the checkpoint carries, so worker-side randomness also resumes exactly.
        sampler: Any = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        # A last batch of one sample breaks BatchNorm in training mode ("Expected more than 1 value per
        # channel"): that sample is left out of the epoch (another one each epoch: the order is reshuffled).
        drop_last = len(sampler) % batch_size == 1 and len(sampler) > 1
        if drop_last:
            logger.info("training: %d samples per rank leave a last batch of 1; it is skipped", len(sampler))
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            drop_last=drop_last,
        )
    shard = dataset if world == 1 else Subset(dataset, range(rank, len(dataset), world))
    return DataLoader(shard, batch_size=batch_size, shuffle=False, num_workers=num_workers)
