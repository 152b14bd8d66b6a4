"""Build the torch model to train from ``"file.py:factory"`` or a callable."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpinfer.errors import ModelLoadError, format_message
from mpinfer.export.loader import import_factory

# Factory name used when a model source names only the file.
DEFAULT_FACTORY = "build"
_SOURCE_HINT = "write path/to/model.py:factory, e.g. models/digits_cnn.py:build"


def split_source(source: str) -> tuple[Path, str]:
    """Split ``"file.py:factory"`` into the file and the factory name.

    Raises:
        ModelLoadError: If the text does not name a ``.py`` file.
    """
    path_text, sep, factory = source.rpartition(":")
    if not sep or not path_text.endswith(".py"):
        path_text, factory = source, DEFAULT_FACTORY
    if not path_text.endswith(".py") or not factory.isidentifier():
        raise ModelLoadError(
            format_message("Model source", repr(source), "a Python file and a factory", _SOURCE_HINT)
        )
    return Path(path_text), factory


def load_factory(source: str) -> Callable[[], Any]:
    """Import the file of ``source`` and return its factory.

    Args:
        source: ``"file.py:factory"``.

    Returns:
        The factory callable.

    Raises:
        ModelLoadError: For a missing file, an import error or a missing factory.
    """
    path, factory = split_source(source)
    if not path.is_file():
        raise ModelLoadError(
            format_message(f"Model file '{path}'", "no such file", "an existing .py file", _SOURCE_HINT)
        )
    _module, fn = import_factory(path, factory)
    return fn  # type: ignore[no-any-return]


def build_model(model: str | Callable[[], Any]) -> Any:
    """Build the ``nn.Module`` from a source string or a zero-argument callable.

    Raises:
        ModelLoadError: If loading fails or the factory does not return an ``nn.Module``.
    """
    from torch import nn

    factory = load_factory(model) if isinstance(model, str) else model
    try:
        module = factory()
    except Exception as err:  # user code
        raise ModelLoadError(
            format_message(
                f"Model factory {model!r}",
                f"an error ({type(err).__name__}: {err})",
                "a call that returns an nn.Module",
            )
        ) from err
    if not isinstance(module, nn.Module):
        raise ModelLoadError(
            format_message(f"Model factory {model!r}", f"a {type(module).__name__}", "an nn.Module")
        )
    return module


def load_run_data(model: str | Callable[[], Any], data: Any, eval_data: Any) -> tuple[Any, tuple[str, str]]:
    """The run's data sets (``data``, else the model file's ``train_data()``, else digits) and their names.

    Returns:
        The :class:`~mpinfer.train.data.TrainData` and the names of the training and evaluation data for messages.
    """
    from mpinfer.train.data import DIGITS, load_train_data

    data_spec, eval_spec = data, eval_data
    if data_spec is None:
        own = model_train_data(model)
        if own is None:
            data_spec = DIGITS
        else:
            data_spec = own[0]
            eval_spec = own[1] if eval_spec is None else eval_spec
    own_name = f"{TRAIN_DATA_FUNCTION}() of the model file"
    shown = data_spec if data is not None or isinstance(data_spec, str) else own_name
    names = (f"--data '{shown}'", f"--eval-data '{eval_data}'" if eval_data is not None
             else f"the held-out part of --data '{shown}'")
    return load_train_data(data_spec, eval_spec), names


# A model file may define this function, returning ``(train, eval)`` Datasets: the data it trains on when no
# --data is given (a model that does not take the built-in digits images, e.g. one over token ids).
TRAIN_DATA_FUNCTION = "train_data"


def model_train_data(model: str | Callable[[], Any]) -> tuple[Any, Any] | None:
    """The ``(train, eval)`` Datasets of the model file's ``train_data()``, or None when it has none.

    Raises:
        ModelLoadError: If ``train_data()`` fails or returns something else than two Datasets.
    """
    if not isinstance(model, str):
        return None
    path, factory = split_source(model)
    module, _ = import_factory(path, factory)
    fn = getattr(module, TRAIN_DATA_FUNCTION, None)
    if not callable(fn):
        return None
    try:
        data = fn()
    except Exception as err:  # user code
        raise ModelLoadError(
            format_message(f"{path}: {TRAIN_DATA_FUNCTION}()", f"an error ({type(err).__name__}: {err})",
                           "a call that returns (train, eval) Datasets")
        ) from err
    if not (isinstance(data, tuple) and len(data) == 2 and all(hasattr(d, "__len__") for d in data)):
        raise ModelLoadError(
            format_message(f"{path}: {TRAIN_DATA_FUNCTION}()", f"a {type(data).__name__}",
                           "a tuple (train, eval) of Datasets yielding (inputs, label)")
        )
    return data[0], data[1]
