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
