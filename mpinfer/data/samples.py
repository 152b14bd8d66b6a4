"""Feed iteration by samples, batch slicing along each input's sample axis, and data fingerprints.

:class:`BatchSlicer` cuts a model's batches into slices of samples (calibration, verification and ``mpinfer
compare``'s divergence all use it); :func:`iter_samples` reads feeds up to a number of samples; the fingerprint
(:func:`fingerprint_update`, :func:`fingerprint_digest`, :class:`FingerprintedFeeds`) is what a plan and a
comparison record of the data they were measured on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from mpinfer.data.feeds import sample_axes, take_samples
from mpinfer.specs import specs_from_onnx


class BatchSlicer:
    """Cuts a model's batches into slices of samples along each input's sample axis.

    See :func:`mpinfer.data.feeds.sample_axes`.
    """

    def __init__(self, model: Any) -> None:
        specs = specs_from_onnx(model)
        axes = sample_axes(specs)
        # only symbolic sample dims can take another count (a fixed batch of 4 is fed 4 at a time), and only when
        # no input but scalars is fed whole: a state [2, ?, 128] whose batch dim has no name may be the batch
        self._axes = {s.name: a for s in specs if (a := axes[s.name]) is not None and isinstance(s.shape[a], str)}
        if any(axes[s.name] is None and s.shape for s in specs):
            self._axes = {}

    @property
    def axis0(self) -> bool:
        """True when every input that holds samples holds them on axis 0 (and some do)."""
        return bool(self._axes) and all(a == 0 for a in self._axes.values())

    def rows(self, batch: Mapping[str, np.ndarray]) -> int:
        """Samples in ``batch``; 1 when it cannot be cut (no sample axis, or inputs that disagree)."""
        counts = {np.shape(batch[n])[a] for n, a in self._axes.items() if n in batch}
        return counts.pop() if len(counts) == 1 else 1

    def slice(self, batch: Mapping[str, np.ndarray], start: int, stop: int) -> dict[str, np.ndarray]:
        """Samples ``start:stop`` of every input that has a sample axis; the others whole."""
        return {name: take_samples(value, self._axes.get(name), start, stop) for name, value in batch.items()}


def fingerprint_update(hashers: dict[str, Any], batch: Mapping[str, np.ndarray]) -> None:
    """Add one batch to per-input sha256 hashers (the bytes of each input, in order, batch after batch)."""
    for name, value in batch.items():
        arr = np.ascontiguousarray(value)
        if name not in hashers:
            hashers[name] = (hashlib.sha256(), str(arr.dtype), tuple(arr.shape[1:]))
        hashers[name][0].update(arr.data.cast("B") if arr.size else b"")


def fingerprint_digest(hashers: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of the inputs' names, dtypes, per-sample shapes and byte digests (batching-independent)."""
    top = hashlib.sha256()
    for name in sorted(hashers):
        h, dtype, shape = hashers[name]
        top.update(f"{name}|{dtype}|{shape}|{h.hexdigest()}\n".encode())
    return "sha256:" + top.hexdigest()


class FingerprintedFeeds:
    """Feeds that fingerprint the batches read through them (``mpinfer compare`` records the data it compared on).

    Everything else (``labels``, ``description``, ``len``...) is the wrapped feeds'.
    """

    def __init__(self, feeds: Any) -> None:
        self._feeds = feeds
        self._hashers: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._feeds, name)

    def __len__(self) -> int:
        return len(self._feeds)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self._hashers = {}
        for batch in self._feeds:
            fingerprint_update(self._hashers, batch)
            yield batch

    def fingerprint(self) -> str:
        """``sha256:<hex>`` of the batches of the last pass (same as the plan's for the same samples)."""
        return fingerprint_digest(self._hashers)


def iter_samples(feeds: Any, model: Any, limit: int | None) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """The batches of ``feeds`` up to ``limit`` samples (the last one cut), each with its sample count."""
    slicer = BatchSlicer(model)
    seen = 0
    for batch in feeds:
        if limit is not None and seen >= limit:
            return
        rows = slicer.rows(batch)
        if limit is not None and seen + rows > limit:
            batch, rows = slicer.slice(batch, 0, limit - seen), limit - seen
        yield batch, rows
        seen += rows
