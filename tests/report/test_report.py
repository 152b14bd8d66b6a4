from __future__ import annotations

import base64
import io
import json
import re

import pytest
from PIL import Image

from mpinfer.errors import InvalidInputError
from mpinfer.report import load_report, render, write_report
from tests.conftest import assert_user_error


def test_write_report_formats(report_result, tmp_path):
    paths = report_result["paths"]
    assert sorted(paths) == ["html", "json", "md"]
    data = json.loads(paths["json"].read_text())
    assert data["schema_version"] == 1
    json.loads(paths["json"].read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    md = paths["md"].read_text()
    assert "| output | max abs |" in md and "LayerNormalization" in md and "user:low-node" in md
    assert "## Latency" in md and "speedup vs baseline" in md


def test_refuses_existing_without_force(report_result, tmp_path):
    out = tmp_path / "r"
    write_report(report_result["result"], out, formats=("json",))
    before = (out / "report.json").read_bytes()
    with pytest.raises(InvalidInputError, match="pass --force"):
        write_report(report_result["result"], out, formats=("md", "json"))
    assert not (out / "report.md").exists() and (out / "report.json").read_bytes() == before
    write_report(report_result["result"], out, formats=("json",), force=True)
    with pytest.raises(InvalidInputError, match="Report formats"):
        write_report(report_result["result"], out, formats=("pdf",))


def test_dict_roundtrip_renders_identically(report_result):
    result = report_result["result"]
    again = load_report(report_result["paths"]["json"])
    assert render(again, "md") == render(result, "md")
    assert render(result.to_dict(), "json") == render(result, "json")


def test_html_is_self_contained_with_plots(report_result):
    html = report_result["paths"]["html"].read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)
    assert "<script" not in html and "<link" not in html
    srcs = re.findall(r'<img class="plot" id="([^"]+)" alt="[^"]*" src="data:image/png;base64,([^"]+)"', html)
    ids = {i for i, _ in srcs}
    assert {"dist-0", "along-graph", "precision", "latency"} <= ids
    for _id, data in srcs:
        img = Image.open(io.BytesIO(base64.b64decode(data)))
        assert img.format == "PNG" and img.size[0] > 300
    assert "Error jumps at LayerNormalization" in html and "user:low-node" in html


def test_cli_report_formats(invoke, report_result, tmp_path):
    src = report_result["paths"]["json"]
    r = invoke("report", src, "--format", "md", "-o", tmp_path / "r.md")
    assert r.exit_code == 1  # the saved comparison failed its checks: the exit code says so again
    assert (tmp_path / "r.md").read_text().startswith("# mpinfer compare report")
    r = invoke("report", src, "--format", "console")
    assert "Accuracy vs baseline" in r.output and "FAIL" in r.output and r.exit_code == 1
    r = invoke("report", src, "--format", "json")
    assert json.loads(r.stdout)["schema_version"] == 1
    assert invoke("report", src.parent, "--format", "json").stdout == r.stdout  # the folder compare wrote
    r = invoke("report", src, "-o", tmp_path / "c.txt")
    assert r.exit_code == 2 and "pick one with --format" in r.output and not (tmp_path / "c.txt").exists()


def test_console_report_to_a_file_keeps_names_whole(report_result, monkeypatch):
    import io

    from rich.console import Console

    from mpinfer.report.console import _tail, render_console

    monkeypatch.delenv("COLUMNS", raising=False)
    result = report_result["result"]
    narrow = io.StringIO()
    render_console(result, Console(file=narrow, width=80))
    piped = io.StringIO()
    monkeypatch.setattr("sys.stdout", piped)  # not a terminal: a log file or a pipe
    render_console(result)
    runners = {s.runner.rsplit("/", 1)[-1] for s in result.latency.stats}
    lines = piped.getvalue().splitlines()
    for name in runners:  # each file name on one line in its table row
        assert any(line.startswith(f"│ {name} ") for line in lines), name
    assert max(len(line) for line in narrow.getvalue().splitlines()) <= 80
    assert any("speedup vs baseline" in line for line in lines)  # headers unfolded too
    assert not any("speedup vs baseline" in line for line in narrow.getvalue().splitlines())
    # Long node names: their last path segments, cut at a separator.
    assert _tail("/model/encoder/layer.0/attention/self/query/MatMul_output_0_cast", 40) == (
        "…/self/query/MatMul_output_0_cast"
    )


def test_cli_report_rethreshold(invoke, report_result, tmp_path):
    # Re-thresholding only the healthy candidate's output: tighten until it fails.
    good = report_result["result"].with_checks("cosine>=0.9")
    write_report(good.to_dict() | {"candidates": good.to_dict()["candidates"][:1]}, tmp_path / "g", ("json",))
    path = tmp_path / "g" / "report.json"
    assert invoke("report", path, "--format", "json", "--check", "cosine>=0.9").exit_code == 0
    r = invoke("report", path, "--format", "html", "--check", "max_abs<=1e-12", "-o", tmp_path / "t.html")
    assert r.exit_code == 1 and "Error:" not in r.output
    assert "FAIL: 1 check(s) failed" in r.output and "max_abs<=1e-12" in r.output
    assert "max_abs&lt;=1e-12" in (tmp_path / "t.html").read_text()


def test_cli_report_bad_input(invoke, report_result, tmp_path):
    newer = json.loads(report_result["paths"]["json"].read_text())
    newer["schema_version"] = 2
    p = tmp_path / "newer.json"
    p.write_text(json.dumps(newer))
    out = tmp_path / "x.html"
    r = invoke("report", p, "--format", "html", "-o", out)
    assert_user_error(
        r, r"Report '.*newer.json': received schema_version 2, expected 1 or older.*upgrade mpinfer"
    )
    assert not out.exists()
    (tmp_path / "junk.json").write_text("{not json")
    assert_user_error(invoke("report", tmp_path / "junk.json"), r"received an unreadable or non-JSON file")
    assert_user_error(
        invoke("report", tmp_path / "missing.json"), r"Report '.*missing.json': received no such file"
    )
    assert_user_error(
        invoke("report", report_result["paths"]["json"], "--check", "snr_dbx>3"), r"unknown metric 'snr_dbx'"
    )
    src = report_result["paths"]["json"]
    assert_user_error(invoke("report", src, "--format", "json", "-o", src), r"same path as an input")


def test_names_with_markup_are_shown_as_they_are(invoke, tmp_path):
    # Output and node names are the model's: rich markup ("[/x]") crashed the console, HTML in them reached the
    # Markdown renderer, and a '[' in a hint's message paired with a ']' in its fix.
    import onnx
    from onnx import TensorProto, helper

    from tests.precision.graphs import rng_w

    out, node = "[/x]", "mm <b>1</b> `tick` [y"
    w = onnx.numpy_helper.from_array(rng_w(8, 6), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], [out], name=node)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", 6])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "m.onnx"))
    conv = invoke("convert", tmp_path / "m.onnx", "--calibration", "none", "-o", tmp_path / "m.fp16.onnx")
    assert conv.exit_code == 0, conv.output
    r = invoke("compare", tmp_path / "m.onnx", tmp_path / "m.fp16.onnx", "--report", tmp_path / "rep")
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "[/x]" in text and f"FP16 MatMul '{node}' has" in text  # the hint whole, the header literal
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "mm &lt;b&gt;1&lt;/b&gt; \\`tick\\` [y" in md and "<b>" not in md


def test_cli_report_refuses_an_empty_check(invoke, report_result, tmp_path):
    r = invoke("report", report_result["paths"]["json"], "--check", " ")
    assert r.exit_code == 2 and "--check" in r.output and "empty" in r.output


def test_error_distributions_skip_tight_layout_and_keep_their_labels_on_the_figure(report_result, monkeypatch):
    """A decoder draws one error distribution per output (2 per layer): laid out by fixed margins, not by
    tight_layout's extra draw, with every label, tick label and the legend still inside the figure."""
    from matplotlib.figure import Figure

    from mpinfer.report import plots

    result = report_result["result"]
    figures, real_png = [], plots._png

    def spy_png(fig, **kw):
        figures.append(fig)
        return real_png(fig, **kw)

    monkeypatch.setattr(plots, "_png", spy_png)
    monkeypatch.setattr(Figure, "tight_layout", lambda self, *a, **k: pytest.fail("tight_layout called"))
    for name in dict.fromkeys(o.name for c in result.candidates for o in c.outputs):
        png = plots.error_distribution(result, name)
        assert png is not None and Image.open(io.BytesIO(png)).size == (630, 288)
    assert figures
    for fig in figures:
        renderer = fig.canvas.get_renderer()
        box = fig.axes[0].get_tightbbox(renderer)  # the axes with its ticks, labels, title and legend
        width, height = fig.bbox.width, fig.bbox.height
        assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height, (box, width, height)


def test_error_distributions_on_one_figure_are_the_pngs_of_a_figure_each(report_result):
    """The error distributions of every output, drawn on one figure in turn, are byte for byte the PNGs of one
    fresh figure each: outputs with two candidates or one, wide and narrow ranges, overflow notes, an output
    with nothing finite to draw (no log axis) between them, and one no candidate has."""
    from mpinfer.compare.result import ComparisonResult
    from mpinfer.report import plots

    doc = json.loads(json.dumps(report_result["result"].to_dict()))
    first, second = doc["candidates"][0], doc["candidates"][1]
    base = first["outputs"][0]
    variants = {  # name -> (first candidate's hist_abs, the second's or None: no such output)
        "narrow": ({**base["hist_abs"], "bins": base["hist_abs"]["bins"][:2]}, base["hist_abs"]),
        "noted": ({**base["hist_abs"], "huge": 3}, {**second["outputs"][0]["hist_abs"], "huge": 1}),
        "nothing_finite": ({**base["hist_abs"], "bins": [], "huge": 5}, None),
        "one_candidate": (second["outputs"][0]["hist_abs"], None),
    }
    for name, (h1, h2) in variants.items():
        first["outputs"].append({**base, "name": name, "hist_abs": h1})
        if h2 is not None:
            second["outputs"].append({**second["outputs"][0], "name": name, "hist_abs": h2})
    result = ComparisonResult.from_dict(doc)
    names = [*dict.fromkeys(o.name for c in result.candidates for o in c.outputs), "nobody's"]
    together = plots.error_distributions(result, names)
    alone = [plots.error_distribution_alone(result, n) for n in names]
    assert together[-1] is None and alone[-1] is None and all(p is not None for p in together[:-1])
    assert together == alone
