"""Console report: rich tables."""

from __future__ import annotations

import os
from typing import Any

from mpinfer.compare.result import ComparisonResult
from mpinfer.report import tables
from mpinfer.report.plan_check import HEADERS as PLAN_HEADERS
from mpinfer.report.plan_check import plan_check


def _table(title: str, headers: list[str], rows: list[list[str]]) -> Any:
    from rich.markup import escape
    from rich.table import Table

    # headers and titles carry output names and devices: text, never markup ("[/x]" is a valid output name)
    t = Table(title=escape(title), title_justify="left", show_lines=False)
    for i, h in enumerate(headers):
        t.add_column(escape(h), justify="left" if i == 0 else "right", overflow="fold")
    for row in rows:
        t.add_row(*[_style(c) for c in row])
    return t


# Width when stdout is not a terminal (a log file, a pipe): rich's default 80 columns fold node and file names
# into 6-character slivers there, and a file does not wrap.
FILE_WIDTH = 160
# Node names longer than this are shown by their last path segments ("…/layer.2/attention/self/query/Add");
# the report's JSON, Markdown and HTML keep them whole.
NODE_NAME_MAX = 44


def _tail(name: str, limit: int = NODE_NAME_MAX) -> str:
    if len(name) <= limit:
        return name
    tail = name[len(name) - limit + 1 :]
    cut = tail.find("/")
    return "…" + (tail[cut:] if cut > 0 else tail)


# Up to this many outputs, the console shows metrics as rows and outputs as columns: 12 metric columns do not
# fit an 80-column terminal, a handful of outputs does.
TRANSPOSE_MAX_OUTPUTS = 4


def _accuracy_table(headers: list[str], rows: list[list[str]]) -> Any:
    """Accuracy per output; transposed (a column per output) when there are few outputs."""
    if not rows or len(rows) > TRANSPOSE_MAX_OUTPUTS:
        return _table("Accuracy vs baseline", headers, rows)
    transposed = [[metric] + [row[i] for row in rows] for i, metric in enumerate(headers) if i > 0]
    return _table("Accuracy vs baseline", ["metric"] + [row[0] for row in rows], transposed)


def _style(cell: str) -> str:
    from rich.markup import escape

    if cell == "PASS":
        return "[green]PASS[/]"
    if cell == "FAIL":
        return "[bold red]FAIL[/]"
    return escape(cell)


def render_console(result: ComparisonResult, console: Any = None) -> None:
    """Print the report to a rich console (stdout by default)."""
    from rich.console import Console
    from rich.markup import escape

    if console is None:
        console = Console()
        if not console.is_terminal and "COLUMNS" not in os.environ:
            console = Console(width=FILE_WIDTH)
    color = "green" if result else "bold red"
    console.print(
        f"[bold]mpinfer compare[/] baseline [cyan]{escape(result.baseline['name'])}[/] "
        f"({escape(tables.runner_line(result.baseline['runner']))}) on "
        f"{escape(str(result.data.get('description')))}: [{color}]{tables.verdict(result)}[/]"
    )
    for note in result.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    for cand in result.candidates:
        console.print()
        console.print(
            f"[bold]Candidate[/] [cyan]{escape(cand.name)}[/] ({escape(tables.runner_line(cand.runner))})"
        )
        if cand.size_bytes is not None:
            console.print("Size: " + escape(tables.size_line(result, cand)))
        console.print(_accuracy_table(tables.accuracy_headers(cand), tables.accuracy_rows(cand)))
        labels = tables.label_rows(cand)
        if labels:
            console.print(_table("Accuracy vs labels", ["output", "baseline", "candidate", "drop"], labels))
        mine = tables.user_metric_rows(result, cand)
        if mine:
            console.print(_table("Metrics of your own", tables.USER_HEADERS, mine))
        console.print(_table("Checks", ["check", "output", "value", "result"], tables.check_rows(cand)))
        for line in tables.divergence_lines(cand):
            console.print(escape(line))
        rows = [[_tail(r[0]), *r[1:]] for r in tables.node_rows(cand)]
        if rows:
            console.print(_table("Nodes adding the most error", tables.NODE_HEADERS, rows))
        if cand.precision:
            console.print("Precision: " + escape(tables.precision_line(cand)))
        said_notes, said_rows = plan_check(result, cand)
        for note in said_notes:
            console.print(("[bold red]" if note.startswith("MISMATCH") else "") + escape(note))
        if said_rows:
            console.print(_table("Plan said / measured", PLAN_HEADERS, said_rows))
        for hint in cand.hints:
            # escaped whole: a '[' in the message and a ']' in the fix must not pair up into a tag
            console.print("[yellow]speed hint[/] " + escape(f"({hint.kind}) {hint.message} Fix: {hint.fix}"))
    if result.latency is not None:
        console.print()
        console.print(
            _table(
                f"Latency (device {result.latency.device}, warm-up {result.latency.warmup})",
                tables.LATENCY_HEADERS,
                tables.latency_rows(result),
            )
        )
