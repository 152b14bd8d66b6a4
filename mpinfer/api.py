"""The Python API that reads like the CLI: ``mpinfer.convert("m.onnx", "m.fp16.onnx", budget="cosine>=0.999")``.

Each function takes the command's arguments and its options as keyword arguments named like the CLI options
(``--keep-op`` → ``keep_op``, ``--calibration`` → ``calibration``, ``--dim`` → ``dim``), and resolves them in
the same one place as the CLI: the click command's own parameters (types, choices, ranges, callbacks and
defaults), then the command's own code. So an option means the same in a script and in a shell, and an option
added to a command is in the API at once. Nothing is printed (``quiet``); the result object is returned:

    import mpinfer

    mpinfer.export("models/resnet_small.py:build", "out/resnet.onnx", dynamic="batch")
    mpinfer.convert("out/resnet.onnx", "out/resnet.fp16.onnx", calibration="random:32", budget="cosine>=0.999")
    result = mpinfer.compare("out/resnet.onnx", "out/resnet.fp16.onnx", check="cosine>=0.999")
    assert result, result.failed_checks()

The config classes (:class:`~mpinfer.precision.ConvertConfig`, :class:`~mpinfer.compare.CompareConfig`, ...)
stay for the pipeline and for power users.
"""

from __future__ import annotations

import difflib
import importlib
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from mpinfer.errors import InvalidInputError, format_message

# API function → (module, click command attribute) of the CLI command it mirrors.
COMMANDS: dict[str, tuple[str, str]] = {
    "export": ("mpinfer.commands.export", "export"),
    "convert": ("mpinfer.commands.convert", "convert"),
    "compare": ("mpinfer.commands.compare", "compare"),
}


def export(source: str, output: str | Path, **options: Any) -> Any:
    """``mpinfer export SOURCE -o OUTPUT [options]``; returns the :class:`~mpinfer.export.ExportResult`."""
    return _invoke("export", {"source": source, "output": output}, options)


def convert(model: str | Path, output: str | Path, **options: Any) -> Any:
    """``mpinfer convert MODEL -o OUTPUT [options]``; returns the :class:`~mpinfer.precision.ConvertResult`."""
    return _invoke("convert", {"model": model, "output": output}, options)


def compare(baseline: str | Path, *candidates: str | Path, **options: Any) -> Any:
    """``mpinfer compare BASELINE CANDIDATES... [options]``; returns the :class:`~mpinfer.compare.ComparisonResult`.

    A failed check does not raise: ``bool(result)`` is pass/fail, as for :func:`mpinfer.compare_models`.
    """
    return _invoke("compare", {"baseline": baseline, "candidates": candidates}, options)


class CallableModule(types.ModuleType):
    """A stage package that is also its API function: ``mpinfer.compare(...)`` beside ``mpinfer.compare.CompareConfig``.

    ``mpinfer.export`` and ``mpinfer.compare`` are packages, and importing a package sets it as an attribute of
    its parent, which would hide a function of the same name; so the package itself is made callable.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the API function this package stands for."""
        return globals()[self.__name__.rsplit(".", 1)[-1]](*args, **kwargs)


def make_callable(module_name: str) -> None:
    """Make the package ``module_name`` (``mpinfer.export`` / ``mpinfer.compare``) call its API function."""
    sys.modules[module_name].__class__ = CallableModule


def command_options(name: str) -> dict[str, str]:
    """Keyword name → the CLI option it stands for, for the API function ``name`` (``{"keep_op": "--keep-op"}``)."""
    return {key: _flag(param) for key, param in _params(_command(name)).items()}


def _command(name: str) -> click.Command:
    module, attr = COMMANDS[name]
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


def _flag(param: click.Parameter) -> str:
    if isinstance(param, click.Option):
        longs = [o for o in param.opts if o.startswith("--")]
        return longs[0] if longs else param.opts[0]
    return (param.name or "").upper()


def _params(cmd: click.Command) -> dict[str, click.Parameter]:
    """Keyword name → parameter: the option's long name in snake case (``--keep-op`` → ``keep_op``)."""
    out: dict[str, click.Parameter] = {}
    for param in cmd.params:
        key = _flag(param).lstrip("-").replace("-", "_").lower() if isinstance(param, click.Option) else param.name
        if key:
            out[key] = param
    return out


def _invoke(name: str, arguments: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
    cmd = _command(name)
    params = _params(cmd)
    # an option's Python name is its keyword too where it differs (--metric → metrics, as the API writes)
    dests = {p.name: key for key, p in params.items() if p.name and p.name != key and p.name not in params}
    options = {dests.get(k, k): v for k, v in options.items()}
    for key in options:
        if key not in params or key in arguments:
            valid = sorted(k for k in params if k not in arguments)
            close = difflib.get_close_matches(key, valid, n=1)
            raise InvalidInputError(
                format_message(
                    f"mpinfer.{name}() keyword '{key}'",
                    "an unknown option",
                    "one of " + ", ".join(valid),
                    f"did you mean '{close[0]}'?" if close else f"the keywords are `mpinfer {name} --help`'s options",
                )
            )
    given = {**arguments, **options}
    opts = {param.name: _normalize(param, given[key]) for key, param in params.items() if key in given}
    ctx = click.Context(cmd, info_name=name, obj={"quiet": True, "api": True})
    with ctx:
        try:
            for param in cmd.get_params(ctx):  # types, choices, ranges, callbacks and defaults, as on the CLI
                param.handle_parse_result(ctx, opts, [])
        except click.UsageError as err:  # BadParameter, MissingParameter: the CLI's usage errors (exit 2)
            raise InvalidInputError(f"mpinfer.{name}(): {err.format_message()}") from err
        unset = getattr(click.core, "UNSET", object())  # click >= 8.3 marks "not given" so; the CLI passes None
        ctx.params.update({k: None for k, v in ctx.params.items() if v is unset})
        return ctx.invoke(cmd.callback, **ctx.params)  # type: ignore[arg-type]


def _normalize(param: click.Parameter, value: Any) -> Any:
    """Python values a CLI string stands for: a str for a repeatable option is one item; a dict of dims is NAME=N."""
    if value is None:
        return None
    repeatable = param.multiple or (isinstance(param, click.Argument) and param.nargs == -1)
    if isinstance(value, Mapping):
        if repeatable and not all(isinstance(v, (str, int, float, Path)) for v in value.values()):
            return tuple(value.items())  # metrics={"iou": callable}: (name, callable) pairs for the option's type
        items = tuple(f"{k}={v}" for k, v in value.items())
        return items if repeatable else ",".join(items)
    if repeatable and isinstance(value, (str, Path)):
        return (value,)
    if isinstance(value, (list, tuple)) and not repeatable:
        return ",".join(str(v) for v in value)
    return value


__all__ = ["CallableModule", "command_options", "compare", "convert", "export", "make_callable"]
