"""One self-contained HTML report: inline CSS and inline base64 PNG figures, no network access."""

from __future__ import annotations

import base64
import html

from mpinfer.compare.result import CandidateResult, ComparisonResult, check_scope
from mpinfer.metrics import METRIC_DOCS
from mpinfer.report import plots, tables
from mpinfer.report.generation import html_parts
from mpinfer.report.plan_check import HEADERS as PLAN_HEADERS
from mpinfer.report.plan_check import plan_check

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1100px;
color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;margin:8px 0 16px;font-size:0.9em}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:right}th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}
.pass{color:#1a7f37;font-weight:bold}.fail{color:#cf222e;font-weight:bold}
.verdict{font-size:1.2em;padding:8px 12px;border-radius:6px;display:inline-block}
.ok{background:#dafbe1}.bad{background:#ffebe9}.hint{background:#fff8c5;padding:6px 10px;margin:4px 0}
figure{margin:8px 0}img{max-width:100%}code{background:#f4f4f4;padding:1px 4px}
"""


def _code_spans(text: str) -> str:
    """Escape ``text`` and render its `backticked` parts as <code> (hints quote commands that way)."""
    parts = str(text).split("`")
    return "".join(f"<code>{_e(p)}</code>" if i % 2 else _e(p) for i, p in enumerate(parts))


def _e(x: object) -> str:
    return html.escape(str(x))


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for c in row:
            cls = ' class="pass"' if c == "PASS" else (' class="fail"' if c == "FAIL" else "")
            cells.append(f"<td{cls}>{_e(c)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _img(png: bytes | None, alt: str, plot_id: str) -> str:
    if png is None:
        return ""
    data = base64.b64encode(png).decode("ascii")
    return (
        f'<figure><img class="plot" id="{_e(plot_id)}" alt="{_e(alt)}" '
        f'src="data:image/png;base64,{data}"></figure>'
    )


def render_html(result: ComparisonResult) -> str:
    """The report as one HTML document."""
    ok = bool(result)
    env = result.environment
    parts = [
        f'<h1>mpinfer compare report</h1><p class="verdict {"ok" if ok else "bad"}">'
        f"{_e(tables.verdict(result))}</p>",
        f"<p>Checks: <code>{_e(', '.join(result.checks))}</code></p><ul>",
        f"<li>Baseline: <code>{_e(result.baseline['name'])}</code> "
        f"({_e(tables.runner_line(result.baseline['runner']))})</li>",
        f"<li>Data: {_e(result.data.get('description'))} ({_e(result.data.get('samples'))} samples)</li>",
        f"<li>Created {_e(result.created)}; mpinfer {_e(env.get('mpinfer', '?'))}, onnxruntime "
        f"{_e(env.get('onnxruntime', '?'))}, {_e(env.get('platform', ''))}</li>",
    ]
    parts += [f"<li><b>Note:</b> {_e(n)}</li>" for n in result.notes] + ["</ul>"]
    failed = result.failed_checks()
    if failed:
        parts.append(
            "<h2>Failed checks</h2><ul>"
            + "".join(
                f"<li class=\"fail\">{_e(c)}: {_e(check_scope(o.output))}: {_e(o.check)} "
                f"(got {_e(tables.fmt(o.value))})"
                "</li>"
                for c, o in failed
            )
            + "</ul>"
        )
    for cand in result.candidates:
        parts.append(_candidate_section(result, cand))

    parts += html_parts(result, _table)
    parts += _plot_sections(result)
    parts.append(
        "<h2>Metric definitions</h2><ul>"
        + "".join(f"<li><code>{_e(k)}</code>: {_e(v)}</li>" for k, v in METRIC_DOCS.items())
        + "</ul>"
        "<p>Median and p99 come from log-spaced histograms (40 bins per decade, within ~6 %); the other "
        "metrics are exact.</p>"
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>mpinfer compare report</title>'
        f"<style>{_CSS}</style></head><body>{''.join(parts)}</body></html>\n"
    )


def _candidate_section(result: ComparisonResult, cand: object) -> str:

    assert isinstance(cand, CandidateResult)
    out = [
        f"<h2>Candidate <code>{_e(cand.name)}</code></h2>"
        f"<p>Runner: {_e(tables.runner_line(cand.runner))}. "
        f"Size: {_e(tables.size_line(result, cand) or 'n/a')}</p>",
        "<h3>Accuracy vs baseline</h3>",
        _table(tables.accuracy_headers(cand), tables.accuracy_rows(cand)),
    ]
    if tables.label_rows(cand):
        out += [
            "<h3>Accuracy vs labels</h3>",
            _table(["output", "baseline", "candidate", "drop"], tables.label_rows(cand)),
        ]
    if tables.user_metric_rows(result, cand):
        out += ["<h3>Metrics of your own</h3>", _table(tables.USER_HEADERS, tables.user_metric_rows(result, cand))]
    out += ["<h3>Checks</h3>", _table(["check", "output", "value", "result"], tables.check_rows(cand))]
    if cand.divergence is not None:
        out.append(
            "<h3>Where the error comes from</h3><ul>"
            + "".join(f"<li>{_e(x)}</li>" for x in tables.divergence_lines(cand))
            + "</ul>"
        )
        rows = tables.node_rows(cand)
        if rows:
            out.append(_table(tables.NODE_HEADERS, rows))
    if cand.precision:
        out.append(f"<h3>Precision</h3><p>{_e(tables.precision_line(cand))}</p>")
    said_notes, said_rows = plan_check(result, cand)
    if said_rows:
        out += ["<h3>Plan said / measured</h3>", *(f"<p>{_e(n)}</p>" for n in said_notes)]
        out.append(_table(PLAN_HEADERS, said_rows))
    if cand.hints:
        out.append(
            "<h3>Speed hints</h3>"
            + "".join(
                f'<div class="hint"><b>{_e(h.kind)}</b> <code>{_e(h.node)}</code>: {_e(h.message)} '
                f"<i>Fix:</i> {_code_spans(h.fix)}</div>"
                for h in cand.hints
            )
        )
    return "".join(out)


def _plot_sections(result: ComparisonResult) -> list[str]:
    """Error distribution, error along the graph, precision and latency sections."""
    parts = ["<h2>Error distribution</h2>"]
    outputs = list(dict.fromkeys(o.name for c in result.candidates for o in c.outputs))
    for k, (name, png) in enumerate(zip(outputs, plots.error_distributions(result, outputs), strict=True)):
        parts.append(_img(png, f"error distribution of {name}", f"dist-{k}"))
    along = plots.error_along_graph(result)
    if along:
        parts.append("<h2>Error along the graph</h2>" + _img(along, "error along the graph", "along-graph"))
    prec = plots.precision_chart(result)
    if prec:
        parts.append("<h2>Precision</h2>" + _img(prec, "FP16 share and cast count", "precision"))
    if result.latency is not None:
        parts.append(
            f"<h2>Latency (device {_e(result.latency.device)}, warm-up {result.latency.warmup})</h2>"
        )
        parts.append(_table(tables.LATENCY_HEADERS, tables.latency_rows(result)))
        parts.append(
            "<ul>"
            + "".join(
                f"<li><code>{_e(n)}</code>: {_e(tables.runner_line(i))}</li>"
                for n, i in result.latency.runners.items()
            )
            + "</ul>"
        )
        parts.append(_img(plots.latency_chart(result), "latency baseline vs candidates", "latency"))
    return parts
