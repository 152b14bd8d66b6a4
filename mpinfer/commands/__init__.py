"""Click subcommands, one module each, imported lazily by :mod:`mpinfer.cli`.

Each command parses options into one config object and calls one public API function.
"""

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def memory_limit_option(f: F) -> F:
    """``--memory-limit SIZE`` (:mod:`mpinfer.memory`), shared by convert and compare."""
    import click

    return click.option(  # type: ignore[no-any-return]
        "--memory-limit",
        metavar="SIZE",
        help="Most memory the run holds besides the memory-mapped weights, e.g. 8GB, 6GiB or 40% (of the "
        "available memory); every batch, chunk and cache is sized from it. Default: 50% of the available "
        "memory, at most 12 GB.",
    )(f)


def input_range_option(f: F) -> F:
    """``--input-range NAME=LO..HI`` (:func:`mpinfer.data.feeds.parse_input_ranges`), shared by convert and compare."""
    import click

    return click.option(  # type: ignore[no-any-return]
        "--input-range",
        "input_ranges",
        multiple=True,
        metavar="NAME=LO..HI",
        help="Value range of an input's random data, e.g. input_ids=0..30522 (integers: LO to HI-1).",
    )(f)


def class_outputs_option(f: F) -> F:
    """``--class-outputs NAMES`` (:func:`mpinfer.metrics.parse_class_outputs`), shared by convert and compare."""
    import click

    from mpinfer.metrics import parse_class_outputs

    return click.option(  # type: ignore[no-any-return]
        "--class-outputs",
        callback=lambda _ctx, _param, value: parse_class_outputs(value),
        metavar="NAMES",
        help="Comma-separated outputs that hold class scores (top-k applies to them alone); 'none' for none "
        "(default: guessed, see docs/compare.md).",
    )(f)


def metric_option(f: F) -> F:
    """``--metric NAME=FILE.py:FUNCTION`` (:mod:`mpinfer.usermetric`, repeatable), shared by convert and compare.

    Its values are loaded as they are parsed; the API passes ``metrics={"NAME": callable}`` through the same type.
    """
    import click

    from mpinfer.usermetric import as_metrics

    class MetricType(click.ParamType):
        """``NAME=FILE.py:FUNCTION``, or from the API a ``(NAME, callable)`` pair, into a loaded UserMetric."""

        name = "NAME=FILE.py:FUNCTION"

        def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
            return value  # loaded with its siblings in the callback (clashes between them refused there)

    return click.option(  # type: ignore[no-any-return]
        "--metric",
        "metrics",
        multiple=True,
        type=MetricType(),
        callback=lambda _ctx, _param, value: as_metrics(value),
        metavar="NAME=FILE.py:FUNCTION",
        help="A metric of your own (repeatable): FUNCTION(baseline, candidate, inputs) in FILE.py, called per batch "
        "with dicts of numpy arrays (inputs holds _labels when the data has them), returns a float or one value per "
        "sample. Its figures NAME (mean), NAME_min and NAME_max (worst sample either way) go wherever built-in "
        "metrics go (--budget, --check, the plan, the report). See docs/compare.md.",
    )(f)
