"""Markdown report."""

from __future__ import annotations

from mpinfer.compare.result import ComparisonResult
from mpinfer.metrics import METRIC_DOCS
from mpinfer.report import tables
from mpinfer.report.generation import markdown_lines
from mpinfer.report.mdtext import md_escape, md_table
from mpinfer.report.plan_check import HEADERS as PLAN_HEADERS
from mpinfer.report.plan_check import plan_check


def render_markdown(result: ComparisonResult) -> str:
    """The report as GitHub-flavoured Markdown."""
    lines = [
        "# mpinfer compare report",
        "",
        f"**Verdict: {tables.verdict(result)}**; checks: `{', '.join(result.checks)}`",
        "",
        f"- Baseline: `{result.baseline['name']}` ({tables.runner_line(result.baseline['runner'])})",
        f"- Data: {md_escape(str(result.data.get('description')))}: {result.data.get('samples')} samples",
        f"- Created: {result.created}; mpinfer {result.environment.get('mpinfer', '?')}, "
        f"onnxruntime {result.environment.get('onnxruntime', '?')}, {result.environment.get('platform', '')}",
    ]
    lines += [f"- Note: {md_escape(n)}" for n in result.notes] + [""]
    for cand in result.candidates:
        lines += [
            f"## Candidate `{cand.name}`",
            "",
            f"Runner: {tables.runner_line(cand.runner)}. Size: {tables.size_line(result, cand) or 'n/a'}",
            "",
            "### Accuracy vs baseline",
            "",
        ]
        lines += md_table(tables.accuracy_headers(cand), tables.accuracy_rows(cand))
        if tables.label_rows(cand):
            lines += ["### Accuracy vs labels", ""]
            lines += md_table(["output", "baseline", "candidate", "drop"], tables.label_rows(cand))
        if tables.user_metric_rows(result, cand):
            lines += ["### Metrics of your own", ""]
            lines += md_table(tables.USER_HEADERS, tables.user_metric_rows(result, cand))
        lines += ["### Checks", ""] + md_table(
            ["check", "output", "value", "result"], tables.check_rows(cand)
        )
        if cand.divergence is not None:
            lines += ["### Where the error comes from", ""] + [
                f"- {md_escape(x)}" for x in tables.divergence_lines(cand)
            ]
            lines += [""] + md_table(tables.NODE_HEADERS, tables.node_rows(cand))
        if cand.precision:
            lines += ["### Precision", "", md_escape(tables.precision_line(cand)), ""]
        said_notes, said_rows = plan_check(result, cand)
        if said_rows:
            lines += ["### Plan said / measured", ""] + [f"- {md_escape(n)}" for n in said_notes] + [""]
            lines += md_table(PLAN_HEADERS, said_rows)
        if cand.hints:
            lines += ["### Speed hints", ""]
            lines += [
                f"- **{h.kind}** {md_escape(h.node)}: {md_escape(h.message)} Fix: {md_escape(h.fix)}"
                for h in cand.hints
            ] + [""]
    if result.latency is not None:
        lines += [f"## Latency (device `{result.latency.device}`, warm-up {result.latency.warmup})", ""]
        lines += md_table(tables.LATENCY_HEADERS, tables.latency_rows(result))
        lines += [f"- `{n}`: {tables.runner_line(info)}" for n, info in result.latency.runners.items()] + [""]
    lines += markdown_lines(result)
    lines += ["## Metric definitions", ""] + [f"- `{k}`: {v}" for k, v in METRIC_DOCS.items()]
    lines += [
        "",
        "Median and p99 come from log-spaced histograms (40 bins per decade, within ~6 %); the other "
        "metrics are exact.",
        "",
    ]
    return "\n".join(lines)
