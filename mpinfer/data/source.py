"""What every data source yields (:class:`FeedSource`), and reading ``.npz`` files.

Shared by the file and random feeds (:mod:`mpinfer.data.feeds`) and decoded prompts (:mod:`mpinfer.data.decode`).
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.specs import TensorSpec


@dataclass
class FeedSource:
    """An iterable of batches plus what it is, for logs and reports.

    Attributes:
        kind: ``random``, ``npz``, ``npy`` or ``images``.
        description: Human-readable origin.
        specs: The model inputs the batches are for.
        labels: Side data (``_labels`` in an .npz) aligned with samples, when present.
        guessed_dims: Random data only: the symbolic dims sized by the bare default (no --dim, no batch),
            as ``"'h' (input 'x')"``.
    """

    kind: str
    description: str
    specs: Sequence[TensorSpec]
    _factory: object
    num_batches: int
    num_samples: int
    labels: np.ndarray | None = None
    side: dict[str, np.ndarray] = field(default_factory=dict)
    guessed_dims: tuple[str, ...] = ()

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self._factory()  # type: ignore[operator, no-any-return]

    def __len__(self) -> int:
        return self.num_batches

    def first(self) -> dict[str, np.ndarray]:
        """The first batch."""
        return next(iter(self))

    @property
    def is_random(self) -> bool:
        """True for generated data (statistics from it say little about real inputs)."""
        return self.kind == "random"


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file (no pickles), with a clear error for a file that is not one."""
    if not zipfile.is_zipfile(path):  # np.load would call any other file "pickled (object) data"
        raise InvalidInputError(format_message(f"Data file '{path}'", "a file that is not a valid .npz (no zip "
                                               "archive)", "an .npz written by numpy.savez"))
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise InvalidInputError(format_message(f"Data file '{path}'", f"an unreadable .npz ({err})",
                                               "an .npz written by numpy.savez")) from err
