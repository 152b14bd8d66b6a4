"""Report figures (matplotlib, object API with the Agg canvas: no pyplot, no global backend change).

Each function returns PNG bytes, or None when there is nothing to plot.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpinfer.compare.result import ComparisonResult
from mpinfer.histogram import LogHistogram

# Figure resolution: sharp on screen, a few tens of KB per plot.
DPI = 90
_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def _figure(width: float = 7.0, height: float = 3.2) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


# The error distributions' margins (fractions of the 7 x 3.2 in figure), fixed: their labels do not depend on
# the data, and tight_layout's extra draw (log-axis tick labels laid out twice) was most of a plot's time, which
# a decoder pays once per output (2 per layer)
DIST_MARGINS = {"left": 0.12, "right": 0.98, "bottom": 0.16, "top": 0.9}


def _png(fig: Any, *, tight: bool = True) -> bytes:
    """The figure as PNG; ``tight``: laid out by tight_layout (labels that vary with the data), else as set."""
    buf = io.BytesIO()
    if tight:
        fig.tight_layout()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def error_distribution(result: ComparisonResult, output: str) -> bytes | None:
    """Histogram of |candidate - baseline| for one output, one line per candidate."""
    return error_distributions(result, [output])[0]


def error_distributions(result: ComparisonResult, outputs: Sequence[str]) -> list[bytes | None]:
    """:func:`error_distribution` of each output, drawn on one figure in turn (the same PNGs, made faster).

    A decoder has two outputs a layer; a new figure each time rebuilt the log axis's few hundred tick artists per
    plot, where a figure cleared of its data reuses them.
    """
    pngs: list[bytes | None] = []
    fig = ax = None
    for output in outputs:
        if ax is not None:
            _clear_data(ax)
        else:
            fig = _figure()
            ax = fig.add_subplot(1, 1, 1)
        drawn, lines = _draw_distribution(ax, result, output)
        if not lines:  # a linear axis (or nothing drawn): its own figure, none reused after it
            fig = ax = None
            pngs.append(error_distribution_alone(result, output) if drawn else None)
            continue
        pngs.append(_png(fig, tight=False))
    return pngs


def error_distribution_alone(result: ComparisonResult, output: str) -> bytes | None:
    """:func:`error_distribution` on a figure of its own."""
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    drawn, _ = _draw_distribution(ax, result, output)
    return _png(fig, tight=False) if drawn else None


def _clear_data(ax: Any) -> None:
    """The axes as a fresh one with the same log x-axis and labels: its data, notes and legend removed."""
    for artist in [*ax.patches, *ax.texts, *ax.lines]:
        artist.remove()
    if ax.get_legend() is not None:
        ax.get_legend().remove()
    ax.relim()
    ax.set_prop_cycle(None)


def _draw_distribution(ax: Any, result: ComparisonResult, output: str) -> tuple[int, int]:
    """Draw one output's error histograms on ``ax``; returns (candidates drawn, lines drawn)."""
    drawn = lines = 0
    for i, cand in enumerate(result.candidates):
        om = next((o for o in cand.outputs if o.name == output), None)
        if om is None or not om.hist_abs:
            continue
        h = LogHistogram.from_dict(om.hist_abs)
        if h.total == 0:
            continue
        edges = h.edges()
        nz = np.nonzero(h.counts)[0]
        frac = h.counts / h.total
        if nz.size:
            lo, hi = max(nz[0] - 2, 0), min(nz[-1] + 3, h.counts.size)
            ax.stairs(
                frac[lo:hi],
                edges[lo : hi + 1],
                color=_COLORS[i % len(_COLORS)],
                label=cand.name,
                fill=False,
                linewidth=1.5,
            )
            lines += 1
        if h.huge:
            ax.annotate(
                f"{cand.name}: {h.huge} overflowed/non-finite",
                xy=(0.98, 0.9 - 0.1 * i),
                xycoords="axes fraction",
                ha="right",
                color=_COLORS[i % len(_COLORS)],
                fontsize=8,
            )
        drawn += 1
    if not drawn:
        return 0, 0
    if lines:
        ax.set_xscale("log")
        ax.legend(fontsize=8, loc="upper left")
    ax.set_xlabel("|candidate - baseline|")
    ax.set_ylabel("fraction of elements")
    ax.set_title(f"Error distribution: output '{output}'")
    ax.figure.subplots_adjust(**DIST_MARGINS)
    return drawn, lines


def error_along_graph(result: ComparisonResult) -> bytes | None:
    """Relative error of each node's output in graph order, per candidate, with the first jump marked."""
    cands = [c for c in result.candidates if c.divergence is not None and c.divergence.nodes]
    if not cands:
        return None
    fig = _figure(7.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    finite = [n.error for c in cands for n in c.divergence.nodes if math.isfinite(n.error) and n.error > 0]  # type: ignore[union-attr]
    top = max(finite, default=1.0) * 10
    floor = min(finite, default=1e-8) / 10
    for i, cand in enumerate(cands):
        div = cand.divergence
        assert div is not None
        color = _COLORS[i % len(_COLORS)]
        ys = [n.error if math.isfinite(n.error) else top for n in div.nodes]
        ys = [max(y, floor) for y in ys]
        ax.plot(range(len(ys)), ys, marker=".", color=color, label=cand.name, linewidth=1)
        bad = [k for k, n in enumerate(div.nodes) if not math.isfinite(n.error)]
        if bad:
            ax.scatter(bad, [top] * len(bad), marker="x", color=color, zorder=3)
        if div.first_jump is not None:
            k = next(k for k, n in enumerate(div.nodes) if n.address == div.first_jump.address)
            ax.axvline(k, color=color, linestyle="--", linewidth=1)
            ax.annotate(
                f"jump: {div.first_jump.op_type} {div.first_jump.address}",
                xy=(k, ys[k]),
                xytext=(6, -14 - 12 * i),
                textcoords="offset points",
                fontsize=8,
                color=color,
            )
    ax.set_yscale("log")
    ax.set_xlabel("node (graph order)")
    ax.set_ylabel("relative L2 error of output\n(x = NaN/Inf)")
    ax.set_title("Error along the graph (candidate vs FP32 baseline)")
    ax.legend(fontsize=8)
    return _png(fig)


def latency_chart(result: ComparisonResult) -> bytes | None:
    """p50 latency per runner and batch size, whiskers to p90 and p99."""
    if result.latency is None or not result.latency.stats:
        return None
    stats = result.latency.stats
    runners = list(dict.fromkeys(s.runner for s in stats))
    sizes = sorted({s.batch_size for s in stats})
    fig = _figure(7.0, 3.2)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(runners)
    for i, r in enumerate(runners):
        xs, p50, p90, p99 = [], [], [], []
        for j, bs in enumerate(sizes):
            s = next((s for s in stats if s.runner == r and s.batch_size == bs), None)
            if s is not None:
                xs.append(j + (i - (len(runners) - 1) / 2) * width)
                p50.append(s.p50_ms)
                p90.append(s.p90_ms)
                p99.append(s.p99_ms)
        color = _COLORS[i % len(_COLORS)]
        ax.bar(xs, p50, width * 0.9, color=color, label=("baseline: " if i == 0 else "") + r)
        ax.errorbar(
            xs,
            p50,
            yerr=[np.zeros(len(p50)), np.subtract(p90, p50)],
            fmt="none",
            ecolor="black",
            capsize=3,
            linewidth=1,
        )
        ax.scatter(xs, p99, marker=".", color="black", zorder=3)
    ax.set_xticks(range(len(sizes)), [f"batch {b}" for b in sizes])
    ax.set_ylabel("ms (bar p50, whisker p90, dot p99)")
    ax.set_yscale("log")
    ax.set_title(f"Latency on {result.latency.device}")
    ax.legend(fontsize=8)
    return _png(fig)


def precision_chart(result: ComparisonResult) -> bytes | None:
    """Nodes per precision (stacked) and cast count per candidate, from the plan or the model."""
    rows: list[tuple[str, dict[str, Any]]] = [(c.name, c.precision) for c in result.candidates if c.precision]
    if not rows:
        return None
    fig = _figure(7.0, 1.6 + 0.5 * len(rows))
    ax = fig.add_subplot(1, 1, 1)
    colors = {"fp16": "#2ca02c", "bf16": "#17becf", "fp32": "#7f7f7f"}
    labelled: set[str] = set()
    for i, (_name, prec) in enumerate(rows):
        counts = prec.get("counts", {})
        left = 0.0
        for kind in ("fp16", "bf16", "fp32"):
            n = float(counts.get(kind, 0))
            if n:
                ax.barh(i, n, left=left, color=colors[kind], label=None if kind in labelled else kind)
                labelled.add(kind)
                left += n
        share = 100 * float(prec.get("low_share") or 0)
        ax.annotate(
            f"{share:.0f} % low, {prec.get('cast_count')} casts",
            xy=(left, i),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
    ax.set_yticks(range(len(rows)), [name for name, _p in rows], fontsize=8)
    ax.set_xlabel("nodes")
    ax.set_title("Precision of nodes (FP16 share) and Cast count")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.1 / len(rows)), ncol=3)
    ax.margins(x=0.25)
    return _png(fig)
