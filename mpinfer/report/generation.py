"""Generation figures (``mpinfer compare --generate N``) in the console and the Markdown report.

They travel in the report JSON as ``data["generation"]``: one :meth:`GenerationResult.to_dict
<mpinfer.generation.GenerationResult.to_dict>` per candidate.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from mpinfer.compare.result import ComparisonResult
from mpinfer.report.console import FILE_WIDTH
from mpinfer.report.mdtext import md_table
from mpinfer.report.tables import fmt

GENERATION_HEADERS = ["candidate", "tokens", "token agreement", "first divergence (mean / min)",
                      "step cosine (min)", "ppl baseline", "ppl candidate", "ppl ratio"]
LATENCY_HEADERS = ["candidate", "batch", "model", "prefill ms", "decode tokens/s"]


def generation_of(result: ComparisonResult) -> list[dict[str, Any]]:
    """The generation entries of a result (empty without --generate)."""
    entries = result.data.get("generation") or []
    return [e for e in entries if isinstance(e, dict)]


def generation_rows(result: ComparisonResult) -> list[list[str]]:
    """One row per candidate."""
    rows = []
    for e in generation_of(result):
        m = e.get("metrics", {})
        rows.append([str(e.get("candidate")), str(e.get("tokens")), fmt(m.get("token_agreement")),
                     f"{fmt(m.get('first_divergence'))} / {fmt(m.get('first_divergence_min'))}",
                     fmt(m.get("step_cosine_min")), fmt(m.get("ppl_baseline")), fmt(m.get("ppl_candidate")),
                     fmt(m.get("ppl_ratio"))])
    return rows


def generation_latency_rows(result: ComparisonResult) -> list[list[str]]:
    """Prefill ms and decode tokens/s per candidate, batch size and model."""
    rows = []
    for e in generation_of(result):
        for batch, models in (e.get("latency") or {}).items():
            for who, t in models.items():
                rows.append([str(e.get("candidate")), str(batch), who, f"{t['prefill_ms']:.3g}",
                             f"{t['decode_tokens_per_s']:.4g}"])
    return rows


def markdown_lines(result: ComparisonResult) -> list[str]:
    """The Markdown section (empty without --generate)."""
    if not generation_of(result):
        return []
    lines = ["## Generation (greedy, ONNX Runtime)", ""] + md_table(GENERATION_HEADERS, generation_rows(result))
    lines += ["### Generation latency", ""] + md_table(LATENCY_HEADERS, generation_latency_rows(result))
    return lines


def html_parts(result: ComparisonResult, table: Callable[[list[str], list[list[str]]], str]) -> list[str]:
    """The HTML section, tables drawn by ``table`` (the report's own); empty without --generate."""
    if not generation_of(result):
        return []
    return ["<h2>Generation (greedy, ONNX Runtime)</h2>", table(GENERATION_HEADERS, generation_rows(result)),
            "<h3>Generation latency</h3>", table(LATENCY_HEADERS, generation_latency_rows(result))]


def print_console(result: ComparisonResult, console: Any = None) -> None:
    """Print the generation tables (nothing without --generate)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if not generation_of(result):
        return
    if console is None:

        console = Console()
        if not console.is_terminal and "COLUMNS" not in os.environ:
            console = Console(width=FILE_WIDTH)
    for title, headers, rows in (("Generation (greedy, ONNX Runtime)", GENERATION_HEADERS, generation_rows(result)),
                                 ("Generation latency", LATENCY_HEADERS, generation_latency_rows(result))):
        table = Table(title=title, title_justify="left")
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right", overflow="fold")
        for row in rows:
            table.add_row(*[escape(c) for c in row])
        console.print(table)
