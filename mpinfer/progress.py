"""One way to make progress bars: on stderr, only on a terminal, gone when done.

Bars never touch stdout (``compare --json`` and ``report`` print machine-readable output there) and draw
nothing when stderr is not a terminal (CI logs, pipes), where rich would leave blank lines behind.
"""

from __future__ import annotations

from typing import Any


def progress_bar(*columns: Any, enabled: bool = True, transient: bool = True) -> Any:
    """A ``rich.progress.Progress`` on stderr, disabled off-terminal or when ``enabled`` is False.

    Args:
        columns: rich progress columns (rich's default set when empty).
        enabled: False for ``--quiet`` / ``progress=False``.
        transient: Remove the bar when it finishes.

    Returns:
        The Progress (a context manager).
    """
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    return Progress(*columns, console=console, transient=transient,
                    disable=not enabled or not console.is_terminal)
