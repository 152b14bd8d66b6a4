"""Rows shared by the console, Markdown and HTML renderers (one place decides what a report shows)."""

from __future__ import annotations

import math
from typing import Any

from mpinfer.compare.result import CandidateResult, ComparisonResult, format_value

# Columns of the accuracy table: (header, metric key).
ACCURACY_COLUMNS = [
    ("max abs", "max_abs"),
    ("mean abs", "mean_abs"),
    ("p99 abs", "p99_abs"),
    ("max rel", "max_rel"),
    ("p99 rel", "p99_rel"),
    ("cosine", "cosine"),
    ("cosine min", "cosine_min"),
    ("range err", "range_err"),
    ("SNR dB", "snr_db"),
    ("top-1", "top1"),
    ("top-5", "top5"),
    ("mismatch", "mismatch"),
    ("NaN", "nan"),
    ("Inf", "inf"),
]
# Columns shown only when an output has a value there: top-k (class-score outputs), mismatch (integer outputs),
# cosine min and range err (absent from reports of older versions).
OPTIONAL_COLUMNS = frozenset({"top1", "top5", "mismatch", "cosine_min", "range_err"})
# Divergence nodes listed in the tables.
TOP_NODES = 5


def fmt(v: Any) -> str:
    """Format a metric value for tables."""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e9:
        return str(int(v))
    return format_value(v)


def accuracy_columns(cand: CandidateResult) -> list[tuple[str, str]]:
    """The ACCURACY_COLUMNS shown for a candidate: an optional one only where some output has a value."""
    return [
        (h, k)
        for h, k in ACCURACY_COLUMNS
        if k not in OPTIONAL_COLUMNS or any(o.values.get(k) is not None for o in cand.outputs)
    ]


def accuracy_rows(cand: CandidateResult) -> list[list[str]]:
    """One row per output: name, then :func:`accuracy_columns`."""
    columns = accuracy_columns(cand)
    return [[o.name] + [fmt(o.values.get(k)) for _h, k in columns] for o in cand.outputs]


def accuracy_headers(cand: CandidateResult) -> list[str]:
    """Headers of :func:`accuracy_rows`."""
    return ["output"] + [h for h, _k in accuracy_columns(cand)]


def label_rows(cand: CandidateResult) -> list[list[str]]:
    """Accuracy against labels, where the data had ``_labels``."""
    return [
        [
            o.name,
            fmt(o.values["baseline_accuracy"]),
            fmt(o.values["accuracy"]),
            fmt(o.values["accuracy_drop"]),
        ]
        for o in cand.outputs
        if o.values.get("accuracy") is not None
    ]


# Columns of the user metrics' table (compare --metric).
USER_HEADERS = ["metric", "mean", "min", "max", "function", "sha256"]


def user_metric_rows(result: ComparisonResult, cand: CandidateResult) -> list[list[str]]:
    """One row per user metric (``--metric``): its figures, where it came from and its file's sha256 (12 chars)."""
    figures = cand.metrics or {}
    rows = []
    for name, rec in result.user_metrics.items():
        where = f"{rec.get('file') or '(no file)'}:{rec.get('function')}"
        sha = str(rec.get("sha256") or "")[:12] or "n/a"
        values = [fmt(figures.get(k)) for k in (name, f"{name}_min", f"{name}_max")]
        rows.append([name, *values, where, sha])
    return rows


def check_rows(cand: CandidateResult) -> list[list[str]]:
    """One row per applicable check: check, output, value (or why it is not computable), PASS/FAIL."""
    rows = []
    for c in cand.checks:
        if c.passed is None:
            continue
        value = c.note if c.note and c.value is None else fmt(c.value)
        rows.append([c.check, c.output, value, "PASS" if c.passed else "FAIL"])
    return rows


def divergence_lines(cand: CandidateResult) -> list[str]:
    """Plain-language summary of where the candidate went wrong."""
    d = cand.divergence
    if d is None:
        return []
    lines = [f"Intermediate tensors compared: {d.tensors_compared} on {d.batches} batch(es) ({d.numerics})."]
    if d.first_jump is not None:
        j = d.first_jump
        text = (
            f"Error jumps at {j.op_type} '{j.address}' ({j.precision}): relative error {fmt(j.error)} "
            f"from {fmt(j.input_error)} in its inputs"
        )
        if j.nonfinite:
            text += f", {j.nonfinite} NaN/Inf values"
        lines.append(text + ".")
        if j.reason:
            lines.append(
                f"Plan reason for '{j.address}': {j.reason}" + (f": {j.detail}" if j.detail else ".")
            )
        if cand.passed and d.numerics.startswith("ort") and j.numerics == "strict":
            lines.append(
                "The end-to-end outputs pass in onnxruntime, whose CPU provider computes most FP16 ops in FP32; "
                "this node is inside an If/Loop/Scan body, compared in the strict emulator (FP16 arithmetic, as "
                "on a GPU). Check the outputs with --numerics strict."
            )
        elif cand.passed and d.numerics.startswith("ort"):
            lines.append(
                "The end-to-end outputs pass although an intermediate tensor does not: fetching "
                "intermediates keeps Casts that onnxruntime otherwise folds away (computing in FP32). "
                "A GPU keeps them too; check with --numerics strict."
            )
    else:
        lines.append("No node makes the error jump (no node reaches 1 % relative error at 10x its inputs').")
    skipped = {k: v for k, v in d.skipped.items() if v}
    if skipped:
        lines.append(
            "Not compared: "
            + ", ".join(f"{v} {_SKIPPED.get(k) or k.replace('_only_', '-only ').replace('_', ' ')}"
                        for k, v in skipped.items())
            + "."
        )
    return lines + list(d.notes)


def node_rows(cand: CandidateResult) -> list[list[str]]:
    """The nodes adding the most error: address, op, precision, error, input error, added, reason."""
    d = cand.divergence
    if d is None:
        return []
    by_addr = {n.address: n for n in d.nodes}
    rows = []
    for addr in d.ranking[:TOP_NODES]:
        n = by_addr[addr]
        rows.append(
            [
                n.address,
                n.op_type,
                n.precision,
                fmt(n.error),
                fmt(n.input_error),
                fmt(n.added),
                n.reason or "",
            ]
        )
    return rows


NODE_HEADERS = ["node", "op", "precision", "rel error", "input error", "added", "plan reason"]


def short_names(names: list[str]) -> dict[str, str]:
    """File names instead of paths where those are unique (tables stay narrow)."""
    import os

    base = {n: os.path.basename(n) or n for n in names}
    unique = len(set(base.values())) == len(base)
    return base if unique else {n: n for n in names}


def latency_rows(result: ComparisonResult) -> list[list[str]]:
    """One row per runner and batch size."""
    if result.latency is None:
        return []
    short = short_names(list(dict.fromkeys(s.runner for s in result.latency.stats)))
    return [
        [
            short[s.runner],
            str(s.batch_size),
            str(s.iterations),
            f"{s.p50_ms:.3f}",
            f"{s.p90_ms:.3f}",
            f"{s.p99_ms:.3f}",
            f"{s.mean_ms:.3f}",
            f"{s.throughput:.1f}",
            f"{s.speedup:.2f}x" if s.speedup is not None and math.isfinite(s.speedup) else "n/a",
        ]
        for s in result.latency.stats
    ]


LATENCY_HEADERS = [
    "runner",
    "batch",
    "runs",
    "p50 ms",
    "p90 ms",
    "p99 ms",
    "mean ms",
    "samples/s",
    "speedup vs baseline",
]


# What each "Not compared" count is, where its key alone reads ambiguously.
_SKIPPED = {
    "subgraph_nodes": "If/Loop/Scan body nodes with no output compared (a branch not taken, or bodies not run)",
}


def precision_line(cand: CandidateResult) -> str:
    """FP16 share and cast count, with where they come from."""
    p = cand.precision
    if not p:
        return ""
    share = f"{100 * float(p.get('low_share') or 0):.0f} %"
    flops = p.get("low_share_flops")
    text = (
        f"{p.get('nodes_low')}/{p.get('nodes_total')} float nodes in {p.get('precision') or 'low precision'} "
        f"({share}"
    )
    if flops is not None:
        text += f", {100 * float(flops):.0f} % of FLOPs"
    src = "plan" if p.get("source") != "model" else "counted from the model"
    return text + f"), {p.get('cast_count')} Casts ({src})."


def size_line(result: ComparisonResult, cand: CandidateResult) -> str:
    """Model size on disk, and its ratio to the baseline's."""
    if cand.size_bytes is None:
        return ""
    text = f"{cand.size_bytes / 1e6:.2f} MB on disk"
    base = result.baseline.get("size_bytes")
    if base:
        text += f" ({cand.size_bytes / base:.2f}x the baseline's {base / 1e6:.2f} MB)"
    return text + "."


def runner_line(info: dict[str, Any]) -> str:
    """Backend, providers/device and numerics of a runner."""
    parts = [str(info.get("backend", info.get("runner", "?")))]
    if info.get("providers"):
        parts.append("/".join(info["providers"]))
    if info.get("device"):
        parts.append(str(info["device"]))
    parts.append(f"numerics {info.get('numerics', '?')}")
    return ", ".join(parts)


def verdict(result: ComparisonResult) -> str:
    """PASS or FAIL with the failed checks counted."""
    failed = result.failed_checks()
    return "PASS" if not failed else f"FAIL ({len(failed)} failed check{'s' if len(failed) > 1 else ''})"
