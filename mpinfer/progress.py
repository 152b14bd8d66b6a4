"""One way to make progress bars: on stderr, only on a terminal, gone when done.

Bars never touch stdout (``compare --json`` and ``report`` print machine-readable output there) and draw
nothing when stderr is not a terminal (CI logs, pipes), where rich would leave blank lines behind. When
nothing would be drawn, rich is not even imported (it costs ~70 ms, a third of a small conversion).
"""

from __future__ import annotations

import sys
from typing import Any


class _Silent:
    """The part of ``rich.progress.Progress`` mpinfer uses, doing nothing."""

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        return 0

    def advance(self, task: int, advance: float = 1) -> None:
        return None

    def update(self, task: int, **fields: Any) -> None:
        return None

    def remove_task(self, task: int) -> None:
        return None


def progress_bar(label: str | None = None, *, enabled: bool = True, transient: bool = True) -> Any:
    """A ``rich.progress.Progress`` on stderr; a silent stand-in off-terminal or when ``enabled`` is False.

    Args:
        label: With a label: ``label {task}``, a bar, done/total and the time elapsed; without: rich's
            default columns.
        enabled: False for ``--quiet`` / ``progress=False``.
        transient: Remove the bar when it finishes.

    Returns:
        A context manager with ``add_task``/``advance``/``update``/``remove_task``.
    """
    stream = sys.stderr
    if not enabled or stream is None or not stream.isatty():
        return _Silent()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns: list[Any] = []
    if label is not None:
        columns = [
            TextColumn(f"[bold]{label}[/] {{task.description}}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        ]
    console = Console(stderr=True)
    return Progress(*columns, console=console, transient=transient, disable=not console.is_terminal)
