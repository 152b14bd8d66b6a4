"""One memory budget for a run: ``--memory-limit`` and every byte slice derived from it.

``convert`` and ``compare`` take ``--memory-limit SIZE`` (``memory_limit`` in their pipeline.toml tables;
``build-engine`` holds nothing mpinfer sizes: TensorRT's builder takes ``--workspace``); without it the limit is
:data:`DEFAULT_SHARE` of the machine's available memory (``MemAvailable`` in ``/proc/meminfo``, at most
:data:`DEFAULT_MAX`). What a run holds beyond the model's weights (which are memory-mapped, never copied) is cut
into the slices of :data:`SHARES`, each a fixed share of the limit, so a smaller limit means smaller calls, fewer
kept tensors and more passes, never a different algorithm. The API functions activate a budget with
:func:`use_budget`; the code that sizes its work reads :func:`current_budget`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from mpinfer.errors import InvalidInputError, format_message

logger = logging.getLogger(__name__)

# The default limit: half of the memory the machine has available when the run starts (the other half is left
# to the weights' page cache, ONNX Runtime's arenas and the other processes).
DEFAULT_SHARE = 0.5
# ... and never more than this: today's slices were tuned at about this much (a 24 GB machine), and slices that
# grow with a 1 TB server's memory would only slow the search (more samples held) without a better plan.
DEFAULT_MAX = 12 * 10**9
# Used when the available memory cannot be read (no /proc/meminfo: macOS, Windows).
FALLBACK_LIMIT = 8 * 10**9
# A limit below this leaves no room for even one ONNX Runtime call's tensors: refused.
MIN_LIMIT = 256 * 2**20

# The slices: each is the limit divided by this (at the 12 GB default cap the figures in brackets are what these
# were when they were constants), the most bytes one thing holds at a time:
SHARES: Final[dict[str, int]] = {
    # tensors one ONNX Runtime call of calibration returns (0.5 GiB: PP-OCRv4's detector peaked at 7.6 GB with a
    # batch of 16 in one call)
    "calibration_call": 24,
    # calibration's captured FP32 tensors of the first batches, kept for the strict search (0.5 GiB)
    "capture": 24,
    # graph outputs of calibration's later batches, kept as the final verification's FP32 reference (256 MiB)
    "capture_outputs": 48,
    # default random calibration data stops once its FP32 tensors come to this many bytes (4 GiB; streamed, so
    # this bounds time more than memory)
    "random_calibration": 3,
    # FP32 tensors of the samples the budget search verifies on (2 GiB: PP-OCRv4's recognizer, 200 MB a sample,
    # peaked at 8.3 GB with 32 samples)
    "search": 6,
    # FP32 tensors of one run of the final verification (consecutive batches joined up to it; 512 MiB)
    "verify_run": 24,
    # the strict emulator's cache of weights rounded to FP16/BF16 (beyond it they are rounded per node as it runs)
    "weight_cache": 8,
    # the ONNX Runtime probe model of the search (a second copy of every converted weight; 0.5 GiB)
    "probe": 24,
    # compare's per-layer divergence: one model run's chunk of tensors (256 MiB)
    "divergence_chunk": 48,
    # compare's If/Loop/Scan body observations of the baseline held per batch (256 MiB)
    "body": 48,
    # the arrays of a data source's files kept in memory between passes (256 MiB): a source that holds more is read
    # from its files again on every pass over it (convert reads its data four or five times)
    "data_files": 48,
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE_HINT = "e.g. 8GB, 6GiB, 512MB, 40% (of the available memory) or a byte count"


def parse_size(text: str | int, what: str = "Size") -> int:
    """Parse a memory size (``4GiB``, ``512MiB``, ``1GB``, ``8G``, ``1048576``) into bytes.

    ``K/M/G/T`` and ``KB/MB/GB/TB`` are powers of 1000, ``KiB/MiB/GiB/TiB`` powers of 1024.

    Raises:
        InvalidInputError: If malformed or not positive.
    """
    if isinstance(text, bool):
        raise InvalidInputError(format_message(what, repr(text), "a size", _SIZE_HINT))
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise InvalidInputError(format_message(what, repr(text), "a number with an optional unit", _SIZE_HINT))
        unit = (m.group(2) or "B").lower()
        binary = 2 ** (10 * "kmgt".index(unit[0]) + 10) if "i" in unit else 0
        scale = 1 if unit == "b" else binary or _SIZE_UNITS[unit[0]]
        value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise InvalidInputError(format_message(what, repr(text), "a positive size"))
    return value


def available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class _Slice:
    """A :class:`MemoryBudget` attribute named for a key of :data:`SHARES`: that slice of the budget's limit."""

    def __set_name__(self, owner: type, name: str) -> None:
        if name not in SHARES:
            raise KeyError(f"MemoryBudget.{name}: no share of that name in SHARES")
        self.name = name

    def __get__(self, budget: MemoryBudget, owner: type | None = None) -> int:
        return budget.slice(self.name)


@dataclass(frozen=True)
class MemoryBudget:
    """The most bytes a run holds besides the model's memory-mapped weights, and its slices.

    Attributes:
        limit: The limit in bytes.
        source: Where it came from, for messages (``--memory-limit 8GB``, ``50% of 22.1 GB available``).
    """

    limit: int
    source: str = ""

    def slice(self, name: str) -> int:
        """The bytes of slice ``name`` (a key of :data:`SHARES`): the limit divided by its share."""
        return max(1, self.limit // SHARES[name])

    # One attribute per slice, documented in SHARES: ``budget.search == budget.slice("search")``.
    calibration_call = _Slice()
    capture = _Slice()
    capture_outputs = _Slice()
    random_calibration = _Slice()
    search = _Slice()
    verify_run = _Slice()
    weight_cache = _Slice()
    probe = _Slice()
    divergence_chunk = _Slice()
    body = _Slice()
    data_files = _Slice()

    @classmethod
    def from_setting(cls, setting: str | int | None) -> MemoryBudget:
        """The budget for ``--memory-limit`` (a size, a percentage of the available memory, or None: default).

        Raises:
            InvalidInputError: A malformed size, a percentage outside (0, 100], or a limit below ``MIN_LIMIT``.
        """
        if setting is None:
            return default_budget()
        text = str(setting).strip()
        if isinstance(setting, str) and text.endswith("%"):
            try:
                share = float(text[:-1])
            except ValueError:
                share = -1.0
            if not 0 < share <= 100:
                raise InvalidInputError(format_message("--memory-limit", repr(setting), "a share in (0, 100]%",
                                                       _SIZE_HINT))
            avail = available_memory() or FALLBACK_LIMIT
            budget = cls(int(avail * share / 100), f"{text} of {avail / 1e9:.1f} GB available")
        else:
            budget = cls(parse_size(setting, "--memory-limit"), f"--memory-limit {text}")
        if budget.limit < MIN_LIMIT:
            raise InvalidInputError(
                format_message("--memory-limit", repr(setting), f"at least {MIN_LIMIT // 2**20} MiB", _SIZE_HINT)
            )
        return budget


def default_budget() -> MemoryBudget:
    """``DEFAULT_SHARE`` of the available memory, at most ``DEFAULT_MAX`` (``FALLBACK_LIMIT`` where unknown)."""
    avail = available_memory()
    if avail is None:
        return MemoryBudget(FALLBACK_LIMIT, f"default {FALLBACK_LIMIT / 1e9:.0f} GB (available memory unknown)")
    limit = max(MIN_LIMIT, min(DEFAULT_MAX, int(avail * DEFAULT_SHARE)))
    return MemoryBudget(limit, f"default: {DEFAULT_SHARE:.0%} of {avail / 1e9:.1f} GB available, at most "
                               f"{DEFAULT_MAX / 1e9:.0f} GB")


_ACTIVE: contextvars.ContextVar[MemoryBudget | None] = contextvars.ContextVar("mpinfer_memory_budget", default=None)


def current_budget() -> MemoryBudget:
    """The budget :func:`use_budget` activated, else the default one."""
    return _ACTIVE.get() or default_budget()


@contextlib.contextmanager
def use_budget(setting: MemoryBudget | str | int | None) -> Iterator[MemoryBudget]:
    """Activate a budget (a :class:`MemoryBudget`, a ``--memory-limit`` setting, or None: the default) for a run.

    Raises:
        InvalidInputError: For a bad setting (see :meth:`MemoryBudget.from_setting`).
    """
    budget = setting if isinstance(setting, MemoryBudget) else MemoryBudget.from_setting(setting)
    logger.debug("memory limit %.2f GB (%s)", budget.limit / 1e9, budget.source)
    token = _ACTIVE.set(budget)
    try:
        yield budget
    finally:
        _ACTIVE.reset(token)


__all__ = [
    "DEFAULT_MAX",
    "DEFAULT_SHARE",
    "MIN_LIMIT",
    "SHARES",
    "MemoryBudget",
    "available_memory",
    "budgeted",
    "current_budget",
    "default_budget",
    "frozen_heap",
    "parse_size",
    "release_memory",
    "use_budget",
]


def release_memory() -> None:
    """Free what a finished phase left: reference cycles, and the C heap's free pages given back to the system.

    glibc keeps freed blocks of a process's heap for reuse (its threshold for mapping big blocks on their own grows
    after the first are freed), so converted weights dropped after the rewrite still count in the resident size
    while ONNX Runtime maps the next model; ``malloc_trim`` returns them. A no-op where there is no glibc.
    """
    import gc

    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep the objects alive when a run starts out of the garbage collector's scans while it runs (``gc.freeze``).

    Every full collection walks every object the process holds: in a convert of a 600-node model most are the
    imported modules' (~47,000 objects: numpy, onnx, onnxruntime, mpinfer), and the run's full collections (the two
    :func:`release_memory` calls and those Python starts itself) cost ~0.1 s of its 3 s walking them. The run starts
    with one full collection (what the caller's earlier work left in cycles, e.g. an export's graphs in the same
    process, is freed now, not held through the run), then freezes what is alive: later collections scan what the
    run allocated alone. On the way out the run's own cycles are collected (that scan again) and the heap is
    unfrozen. A no-op where the caller froze the heap itself (the test suite) or disabled the collector: their
    choice stands.
    """
    import gc

    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        gc.unfreeze()


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """The C library's ``malloc_trim`` (glibc), or None; looked up once (``find_library`` runs ldconfig)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None) if libc is not None else None


C = TypeVar("C")
R = TypeVar("R")


def budgeted(fn: Callable[[C], R]) -> Callable[[C], R]:
    """Run an API function ``fn(config)`` under ``config.memory_limit`` (:func:`use_budget`)."""

    @functools.wraps(fn)
    def run(config: C) -> R:
        with use_budget(getattr(config, "memory_limit", None)), frozen_heap():
            return fn(config)

    return run


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask on Linux, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
