"""The user's own metric: ``--metric NAME=FILE.py:FUNCTION`` (convert, compare), ``metrics = {...}``, ``metrics=``.

The file is the user's code, loaded by path as a module; ``FUNCTION(baseline, candidate, inputs)`` is called once
per batch. ``baseline`` and ``candidate`` map each output name to the batch's numpy array (the FP32 reference and
the candidate under the numerics in use); ``inputs`` maps each input name to the batch's feed, plus ``_labels``
when the data holds labels. It returns a float (the batch's value, weighted by its sample count) or a 1-D array
with one value per sample. The metrics core (:class:`mpinfer.userfigures.UserMetricAccumulator`) turns the values into
the figures ``NAME`` (the mean over samples) and, with per-sample values, ``NAME_min`` and ``NAME_max``; checks
read them like any built-in figure (:mod:`mpinfer.checks`).

An exception inside the user's code, a return value of the wrong shape or type, or a NaN is a
:class:`UserMetricError` naming the file, the function and the batch, with the traceback of the user's code only
(mpinfer's own frames left out). The file's sha256 goes into the plan and the report beside the figures.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from mpinfer.checks import ALIASES
from mpinfer.errors import InvalidInputError, MpinferError, format_message
from mpinfer.metrics import is_metric

# A metric's name: what checks read it by (checks are case-insensitive, so one case: lower).
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")
# The figures besides NAME (per-sample values only): the worst sample either way.
SUFFIXES = ("_min", "_max")
# The key under which ``inputs`` holds the batch's labels (as in an .npz of calibration data).
LABELS_KEY = "_labels"
_EXAMPLE = "--metric iou=metrics/boxes.py:box_agreement"


class UserMetricError(MpinferError):
    """The user's metric failed: an exception in its code, a return value of the wrong shape, or a NaN."""


@dataclass(frozen=True)
class UserMetric:
    """One user metric: its name, the function, and where it came from.

    Attributes:
        name: The figure's name (``NAME``; ``NAME_min``/``NAME_max`` with per-sample values).
        function: ``FUNCTION(baseline, candidate, inputs)``.
        path: The file it was loaded from (resolved), or None for a callable without a source file.
        function_name: The function's name in the file (its qualified name for a callable).
        sha256: The file's sha256 (hex), or None without a file.
    """

    name: str
    function: Callable[..., Any] = field(repr=False, compare=False)
    path: str | None = None
    function_name: str = ""
    sha256: str | None = None

    @property
    def figures(self) -> tuple[str, ...]:
        """The figure names this metric can give: ``NAME``, ``NAME_min``, ``NAME_max``."""
        return (self.name, *(self.name + s for s in SUFFIXES))

    @property
    def source(self) -> str:
        """``FILE.py:FUNCTION`` (or the callable's name) for messages."""
        return f"{self.path}:{self.function_name}" if self.path else self.function_name

    def record(self) -> dict[str, Any]:
        """What the plan and the report say about the metric: file, function and the file's sha256."""
        return {"file": self.path, "function": self.function_name, "sha256": self.sha256}

    def evaluate(
        self,
        baseline: Mapping[str, np.ndarray],
        candidate: Mapping[str, np.ndarray],
        inputs: Mapping[str, Any],
        samples: int,
        batch: int,
    ) -> float | np.ndarray:
        """The user's value for one batch of ``samples`` samples: a float, or one float64 value per sample.

        Raises:
            UserMetricError: An exception in the user's code, a value of the wrong type or shape, or a NaN.
        """
        where = f"Metric '{self.name}' ({self.source}) on batch {batch}"
        try:
            value = self.function(baseline, candidate, inputs)
        except Exception as err:  # the user's code: any exception is theirs to fix
            raise UserMetricError(f"{where}: {_user_traceback(err)}") from err
        return _checked_value(value, samples, where)


def _checked_value(value: Any, samples: int, where: str) -> float | np.ndarray:
    """The returned value as a float or a 1-D float64 array of ``samples`` values, else a clear error."""
    expected = f"a float or a 1-D array of {samples} values (one per sample)"
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise UserMetricError(format_message(where, f"a return value of type {type(value).__name__}", expected,
                                             "return a number per batch or a numpy array per sample")) from err
    if arr.ndim == 0:
        if np.isnan(arr):
            raise UserMetricError(format_message(where, "NaN", expected + ", not NaN",
                                                 "a NaN usually means 0/0 in the metric: handle the empty case"))
        return float(arr)
    if arr.ndim != 1 or len(arr) != samples:
        raise UserMetricError(format_message(
            where, f"an array of shape {tuple(arr.shape)}", expected,
            "reduce every axis but the samples' (axis 0 of the outputs), or return the batch's mean as a float"))
    bad = np.flatnonzero(np.isnan(arr))
    if bad.size:
        raise UserMetricError(format_message(
            where, f"NaN for sample(s) {', '.join(map(str, bad[:5].tolist()))}{' ...' if bad.size > 5 else ''} of "
            "the batch", expected + ", not NaN", "a NaN usually means 0/0 in the metric: handle the empty case"))
    return arr


def _user_traceback(err: BaseException) -> str:
    """The exception with the traceback of the user's code only: the frames below mpinfer's call into it."""
    tb: TracebackType | None = err.__traceback__
    tb = tb.tb_next if tb is not None else None  # drop evaluate()'s own frame
    frames = traceback.format_list(traceback.extract_tb(tb)) if tb is not None else []
    text = "".join(frames) + "".join(traceback.format_exception_only(type(err), err))
    return "the metric's code raised an exception (most recent call last):\n" + text.rstrip()


def _import_traceback(err: BaseException, path: str) -> str:
    """An exception raised while the user's file ran on import: the frames in user code (no importlib)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not _is_machinery(f.filename)]
    text = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(type(err), err))
    return text.rstrip()


def _is_machinery(filename: str) -> bool:
    """True for frames of importlib and of mpinfer itself (not the user's code)."""
    here = str(Path(__file__).resolve().parent)
    return filename.startswith("<frozen") or str(Path(filename).resolve()).startswith(here + "/")


def file_sha256(path: str | Path) -> str:
    """The sha256 (hex) of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_name(name: str, what: str) -> None:
    """Refuse a metric name that is malformed or clashes with a built-in metric.

    Raises:
        InvalidInputError: Not ``[a-z][a-z0-9_]*``, or a clash (the name, an alias, or NAME_min/NAME_max).
    """
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise InvalidInputError(format_message(
            what, f"the metric name {name!r}", "lower-case letters, digits and _, starting with a letter",
            f"e.g. {_EXAMPLE}"))
    clash = next((f for f in (name, *(name + s for s in SUFFIXES)) if is_metric(f) or f in ALIASES), None)
    if clash is not None:
        raise InvalidInputError(format_message(
            what, f"the metric name '{name}', whose figure '{clash}' is a built-in metric",
            "a name of its own (figures NAME, NAME_min, NAME_max)",
            f"rename it, e.g. my_{name}; docs/compare.md lists the built-in metrics"))


def check_names(metrics: Sequence[UserMetric], what: str = "--metric") -> None:
    """Refuse clashes among the user's metrics (the same name twice, or ``a`` beside ``a_min``).

    Raises:
        InvalidInputError: Naming the two.
    """
    seen: dict[str, str] = {}
    for m in metrics:
        for fig in m.figures:
            if fig in seen:
                raise InvalidInputError(format_message(
                    what, f"metrics '{seen[fig]}' and '{m.name}' that both give the figure '{fig}'",
                    "metric names whose figures (NAME, NAME_min, NAME_max) differ", "rename one of them"))
            seen[fig] = m.name


def parse_metric(text: str, base: str | Path | None = None, what: str = "--metric") -> UserMetric:
    """``NAME=PATH.py:FUNCTION`` → the loaded metric (a relative path is relative to ``base``, else the cwd).

    Raises:
        InvalidInputError: Malformed, a clashing name, a missing file or function.
        UserMetricError: The file raised on import.
    """
    name, eq, spec = str(text).partition("=")
    if not eq or not name.strip() or not spec.strip():
        raise InvalidInputError(format_message(what, repr(text), "NAME=PATH.py:FUNCTION", f"e.g. {_EXAMPLE}"))
    return load_metric(name.strip(), spec.strip(), base, what)


def load_metric(name: str, spec: str, base: str | Path | None = None, what: str = "--metric") -> UserMetric:
    """Load ``FUNCTION`` from ``PATH.py`` (``spec`` is ``PATH.py:FUNCTION``) as the metric ``name``.

    Raises:
        InvalidInputError: A clashing name, a malformed spec, a missing file or function.
        UserMetricError: The file raised on import.
    """
    label = f"{what} {name}={spec}"
    check_name(name, label)
    path_text, colon, func = spec.rpartition(":")
    if not colon or not path_text or not func.isidentifier():
        raise InvalidInputError(format_message(label, repr(spec), "PATH.py:FUNCTION", f"e.g. {_EXAMPLE}"))
    path = Path(path_text).expanduser()
    if base is not None and not path.is_absolute():
        path = Path(base) / path
    if not path.is_file():
        raise InvalidInputError(format_message(label, f"'{path}', which is not a file", "a Python file",
                                               "paths in pipeline.toml are relative to its folder"))
    path = path.resolve()
    sha = file_sha256(path)
    module = _load_module(path, sha, label)
    fn = getattr(module, func, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise InvalidInputError(format_message(
            label, f"no function '{func}' in '{path}'", "a function FUNCTION(baseline, candidate, inputs)",
            "functions there: " + (", ".join(found) or "none")))
    return UserMetric(name, fn, str(path), func, sha)


def _load_module(path: Path, sha: str, label: str) -> Any:
    """Run the user's file as a module of its own (named from its path and content: two files never mix)."""
    module_name = "mpinfer_user_metric_" + hashlib.sha256(f"{path}\0{sha}".encode()).hexdigest()[:16]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise InvalidInputError(format_message(label, f"'{path}'", "a Python source file (.py)"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling inside it look themselves up there
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's code: any exception is theirs to fix
        del sys.modules[module_name]
        raise UserMetricError(f"{label}: loading '{path}' raised an exception (most recent call last):\n"
                              + _import_traceback(err, str(path))) from err
    return module


def from_callable(name: str, value: Any, what: str = "metrics") -> UserMetric:
    """A metric from the API: a callable (recorded with its source file's sha256) or ``"PATH.py:FUNCTION"``.

    Raises:
        InvalidInputError: A clashing name, or a value that is neither.
    """
    if isinstance(value, UserMetric):
        return value
    if isinstance(value, (str, Path)):
        return load_metric(name, str(value), None, what)
    label = f"{what}={{{name!r}: ...}}"
    check_name(name, label)
    if not callable(value):
        raise InvalidInputError(format_message(
            label, f"a {type(value).__name__}",
            "a callable FUNCTION(baseline, candidate, inputs) or 'PATH.py:FUNCTION'"))
    try:
        source = inspect.getsourcefile(value)
    except TypeError:
        source = None
    path = str(Path(source).resolve()) if source and Path(source).is_file() else None
    qualname = getattr(value, "__qualname__", None) or type(value).__name__
    return UserMetric(name, value, path, qualname, file_sha256(path) if path else None)


def as_metrics(given: Any, base: str | Path | None = None, what: str = "--metric") -> tuple[UserMetric, ...]:
    """The user metrics of an option, a pipeline table or an API keyword, loaded and checked for clashes.

    Accepts ``NAME=PATH.py:FUNCTION`` strings, ``(NAME, callable-or-spec)`` pairs, a mapping of them, or
    :class:`UserMetric` objects.

    Raises:
        InvalidInputError: Malformed entries or clashing names.
        UserMetricError: A file raised on import.
    """
    if not given:
        return ()
    items: Iterable[Any] = given.items() if isinstance(given, Mapping) else given
    if isinstance(given, str):
        items = (given,)
    out: list[UserMetric] = []
    for item in items:
        if isinstance(item, UserMetric):
            out.append(item)
        elif isinstance(item, str):
            out.append(parse_metric(item, base, what))
        elif isinstance(item, tuple) and len(item) == 2:
            name, value = item
            if isinstance(value, (str, Path)):
                out.append(load_metric(str(name), str(value), base, what))
            else:
                out.append(from_callable(str(name), value, what))
        else:
            raise InvalidInputError(format_message(what, repr(item), "NAME=PATH.py:FUNCTION", f"e.g. {_EXAMPLE}"))
    check_names(out, what)
    return tuple(out)


def metric_names(metrics: Iterable[UserMetric]) -> tuple[str, ...]:
    """The names of ``metrics`` (what :func:`mpinfer.checks.parse_checks` takes as ``user``)."""
    return tuple(m.name for m in metrics)


def inputs_with_labels(batch: Mapping[str, Any], labels: Any) -> dict[str, Any]:
    """The ``inputs`` the user's function gets: the batch's feeds, plus ``_labels`` when the data holds them."""
    inputs = dict(batch)
    if labels is not None:
        inputs[LABELS_KEY] = np.asarray(labels)
    return inputs
