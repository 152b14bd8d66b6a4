"""Progress bars: silent (and rich not imported) off-terminal; a real bar on a terminal."""

from __future__ import annotations

import subprocess
import sys

SNIPPET = """
import sys
from mpinfer.progress import progress_bar
with progress_bar("work", enabled=True) as bar:
    task = bar.add_task("items", total=2)
    bar.advance(task)
    bar.update(task, total=3)
    bar.remove_task(task)
print(type(bar).__name__, "rich" in sys.modules)
"""


def test_off_terminal_bars_are_silent_and_skip_importing_rich():
    out = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["_Silent", "False"]
    assert out.stderr == ""


def test_disabled_bars_are_silent_on_a_terminal_too(monkeypatch):
    from mpinfer import progress

    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True, raising=False)
    assert type(progress.progress_bar("x", enabled=False)).__name__ == "_Silent"
    assert type(progress.progress_bar("x", enabled=True)).__name__ == "Progress"
