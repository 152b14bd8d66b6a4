"""Search speed: mpinfer's budget search vs onnxconverter-common ``auto_convert_mixed_precision``, both searching.

With a loose criterion occ-auto accepts its first full FP16 conversion and never bisects (bench/precision.py),
so its speed is never measured. Here both tools get the same FP32 model (exported with
``mpinfer.export.export_onnx``), the same calibration samples and the same tight criterion
``max_abs <= T`` on every output, with T below the error of the plain full FP16 conversion on those samples,
so both must search:

* ``mpinfer-ort`` / ``mpinfer-strict``: ``convert_precision(ConvertConfig(budget="max_abs<=T",
  numerics=...))``, the calibration .npz as one batch (``batch_size`` = its samples, ``search_batches=1``);
* ``occ-auto``: ``auto_convert_mixed_precision(model, feeds, validate_fn=..., keep_io_types=True)`` on the
  same samples; ``validate_fn`` is the same criterion on its ONNX Runtime (CPU) outputs.

Each tool runs in its own subprocess with a timeout (wall time includes the imports; "in-process s" is the
conversion call alone: numpy, onnx and onnxruntime are imported before either tool's timer starts). The
results are re-measured on 64 held-out samples (another seed) in ONNX Runtime CPU and in mpinfer's strict
FP16 emulator; FP16 share of FLOPs counts Conv/MatMul/Gemm FLOPs from shapes (bench/precision.py's
``evaluate``).

    PYTHONPATH=$PWD .venv/bin/python bench/search_speed.py [--models transformer_small:2,transformer_small:4,mlp]
        [--tools mpinfer-ort,mpinfer-strict,occ-auto] [--timeout 600] [--samples 32] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.precision import evaluate, launch, make_data, vm_hwm_mb  # noqa: E402

# name:size → (module, build kwargs, symbolic dims for the data, the Ts of the criteria max_abs <= T).
# Every T is below the ORT CPU error of the plain full FP16 conversion on the calibration samples (printed by
# the bench; transformers 2.3e-4 at depth 2 and 2.6e-4 at depth 4, mlp 8.3e-5 on softmax outputs), so neither
# tool can accept the full conversion. The first T is tight (about 40% of that error); the second sits just
# under it, where occ-auto can still finish: its candidates with nodes blocked keep FP16 round trips (see
# occ_all_blocked_error), so below the full-FP16 error it often has no passing candidate at all.
MODELS = {
    "transformer_small:2": ("transformer_small", {"depth": 2}, {"seq": 16}, (1e-4, 2e-4)),
    "transformer_small:4": ("transformer_small", {"depth": 4}, {"seq": 16}, (1e-4, 2.5e-4)),
    "transformer_small:8": ("transformer_small", {"depth": 8}, {"seq": 16}, (1e-4, 3e-4)),
    "mlp": ("mlp", {}, None, (4e-5, 7e-5)),
    "resnet_small": ("resnet_small", {}, None, (2e-5,)),
}
DEFAULT_MODELS = "transformer_small:2,transformer_small:4,mlp"
TOOLS = ["mpinfer-ort", "mpinfer-strict", "occ-auto"]
# occ-auto re-converts and re-runs the whole model per attempt; 600 s is where we stop waiting.
TIMEOUT = 600


# -- models ---------------------------------------------------------------------------------------
# Factory for export_onnx: models/<module>.build(**kwargs), optionally with its norm layers' affine parameters
# moved off their init values. Freshly initialised, every LayerNorm has weight 1 and bias 0; the TorchScript
# exporter then keeps one initializer and feeds the others through Identity nodes, and onnxconverter-common
# 1.16.0 emits an invalid model (FP16 Identity output typed FP32) as soon as one of those consumers is
# blocked, so occ-auto crashes mid-search. After training, each norm layer has its own parameters.
FACTORY = """import sys
sys.path.insert(0, {root!r})
import torch
from models.{module} import INPUT_SPECS, example_inputs  # noqa: F401
from models.{module} import build as _build


def build():
    model = _build(**{kwargs!r})
    if {perturb!r}:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, (torch.nn.LayerNorm, torch.nn.BatchNorm2d)) and m.weight is not None:
                    m.weight.add_(0.1 * torch.randn(m.weight.shape, generator=gen))
                    m.bias.add_(0.1 * torch.randn(m.bias.shape, generator=gen))
    return model
"""


def export_model(key: str, folder: Path, exporter: str, opset: int | None = None, perturb: bool = True) -> Path:
    """Export ``models/<module>.py`` with the key's build kwargs through ``mpinfer.export.export_onnx``."""
    from mpinfer.export import ExportConfig, export_onnx

    module, kwargs, _, _ = MODELS[key]
    tag = key.replace(":", "_d")
    factory = folder / f"{tag}_factory.py"
    factory.write_text(FACTORY.format(root=str(ROOT), module=module, kwargs=kwargs, perturb=perturb))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = export_onnx(
            ExportConfig(
                source=f"{factory}:build", output=folder / f"{tag}.onnx", exporter=exporter, opset=opset, force=True
            )
        )
    return res.path


def max_abs_error(src: Path, candidate, feeds: dict[str, np.ndarray]) -> float:
    """Worst max abs error over the float outputs of ``candidate`` (path or ModelProto) vs ``src``, ORT CPU."""
    from mpinfer.modelio import ort_session

    ref = ort_session(src).run(None, feeds)
    got = ort_session(candidate).run(None, feeds)
    return criterion_error(ref, got)


def criterion_error(ref, got) -> float:
    """The criterion's statistic: max abs error over all float outputs; inf on a NaN/Inf where ref is finite."""
    worst = 0.0
    for a, b in zip(ref, got, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.dtype.kind != "f":
            continue
        ok = np.isfinite(a)
        if not np.all(np.isfinite(b[ok])):
            return float("inf")
        if ok.any():
            worst = max(worst, float(np.abs(b[ok] - a[ok]).max()))
    return worst


def occ_all_blocked_error(src: Path, cal: Path) -> float:
    """Criterion statistic of onnxconverter-common's conversion with EVERY node in ``node_block_list``.

    This is occ-auto's most conservative candidate (its own preprocessing: shape inference, dtypes from ORT).
    If it exceeds T, every attempt whose segments all fail leaves occ-auto with no valid final model.
    """
    import contextlib
    import io

    import onnx
    from onnxconverter_common import auto_mixed_precision, float16

    feeds = dict(np.load(cal))
    model = onnx.shape_inference.infer_shapes(onnx.load(str(src)))
    with contextlib.redirect_stdout(io.StringIO()):
        model = auto_mixed_precision.add_missing_dtypes_using_ort(model, feeds)
    names = [n.name for n in model.graph.node]
    blocked = float16.convert_float_to_float16(model, node_block_list=names, keep_io_types=True)
    return max_abs_error(src, blocked, feeds)


def full_fp16_error(src: Path, cal: Path) -> float:
    """Criterion statistic of the plain full FP16 conversion on the calibration samples (must exceed T)."""
    import onnx
    from onnxconverter_common import float16

    full = float16.convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    return max_abs_error(src, full, dict(np.load(cal)))


# -- tools (subprocess: python bench/search_speed.py --worker TOOL SRC DST CAL INFO T) ---------------
def run_tool(tool: str, src: Path, dst: Path, cal: Path, info: Path, max_abs: float) -> dict:
    """Convert ``src`` with one tool under ``max_abs <= T``; returns what the tool reports about its search."""
    feeds = {k: v for k, v in np.load(cal).items() if not k.startswith("_")}
    samples = len(next(iter(feeds.values())))
    if tool.startswith("mpinfer-"):
        from mpinfer.precision import ConvertConfig, convert_precision

        cfg = ConvertConfig(
            model=src,
            output=dst,
            calibration=str(cal),
            budget=f"max_abs<={max_abs:g}",
            numerics=tool.split("-", 1)[1],
            batch_size=samples,
            search_batches=1,
            force=True,
            progress=False,
        )
        start = time.perf_counter()
        res = convert_precision(cfg)
        s = res.plan.summary.get("search") or {}
        return {
            "in_process_s": round(time.perf_counter() - start, 3),
            "search_s": s.get("wall_s"),
            "verifications": s.get("verifications"),
            "node_evaluations": s.get("node_evaluations"),
            "groups": f"{s.get('groups_low')}/{s.get('groups')}",
            # one verification for the FP32 baseline, one for the full candidate: more means it bisected
            "searched": (s.get("verifications") or 0) > 2,
            "claimed": res.plan.summary.get("expected_error", {}).get("max_abs"),
        }
    if tool != "occ-auto":
        raise SystemExit(f"unknown tool {tool}")
    import onnx
    from onnxconverter_common import auto_mixed_precision

    from mpinfer.modelio import save_onnx

    calls = [0]

    def validate(ref, got) -> bool:
        calls[0] += 1
        return criterion_error(ref, got) <= max_abs

    model = onnx.load(str(src))
    start = time.perf_counter()
    try:
        out = auto_mixed_precision.auto_convert_mixed_precision(model, feeds, validate_fn=validate, keep_io_types=True)
    except Exception as err:  # occ-auto giving up is a result: record how far it got, then fail the run
        Path(info).write_text(
            json.dumps(
                {
                    "in_process_s": round(time.perf_counter() - start, 3),
                    "verifications": calls[0] - 1,
                    "searched": calls[0] > 3,
                    "raised": f"{type(err).__name__}: {err}"[:200],
                }
            )
        )
        raise
    wall = time.perf_counter() - start
    save_onnx(out, dst)
    runs = calls[0] - 1  # converted candidates run in ORT and validated (the first call checks FP32 itself)
    return {
        "in_process_s": round(wall, 3),
        "verifications": runs,
        "node_evaluations": runs * len(model.graph.node),
        "searched": runs > 2,  # the full conversion, then the final re-validation: more means it bisected
    }


# -- driver ---------------------------------------------------------------------------------------
def bench_model(key: str, folder: Path, args: argparse.Namespace) -> list[dict]:
    _, _, dims, criteria = MODELS[key]
    src = export_model(key, folder, args.exporter)
    cal, feeds = make_data(src.stem, src, folder, cal_samples=args.samples, dims=dims)
    full, blocked = full_fp16_error(src, cal), occ_all_blocked_error(src, cal)
    print(f"{key}: on the calibration samples, full FP16 {full:.3g}, occ all nodes blocked {blocked:.3g}", flush=True)
    rows = []
    for max_abs in criteria:
        runs = []
        for tool in args.tools.split(","):
            dst = folder / f"{src.stem}.{tool}.onnx"
            row = {"model": key, "tool": tool, "max_abs_T": max_abs, "full_fp16_cal": full, "occ_blocked_cal": blocked}
            extra = (repr(max_abs),)
            row.update(
                launch(tool, src, dst, cal, sys.executable, script=Path(__file__), extra=extra, timeout=args.timeout)
            )
            if row["ok"]:
                row.update(evaluate(src, dst, feeds))
                row["cal_max_abs"] = max_abs_error(src, dst, dict(np.load(cal)))
                row["heldout_max_abs"] = max_abs_error(src, dst, feeds)
                row["meets_cal"] = row["cal_max_abs"] <= max_abs
                row["meets_heldout"] = row["heldout_max_abs"] <= max_abs
            runs.append(row)
            print(json.dumps(row), flush=True)
        add_ratios(runs)
        rows += runs
    return rows


def add_ratios(runs: list[dict]) -> None:
    """occ-auto time / mpinfer time on each mpinfer row of one model and criterion."""
    occ = next((r for r in runs if r["tool"] == "occ-auto"), None)
    for r in runs:
        if occ is None or not r["tool"].startswith("mpinfer") or not r["ok"]:
            continue
        # "12.3": occ-auto finished; ">=12.3": killed at the timeout (a lower bound); "(12.3)": occ-auto
        # raised after that long without producing a model.
        fmt = "{:.2g}" if occ["ok"] else ">={:.2g}" if "did not finish" in occ.get("error", "") else "({:.2g})"
        r["occ_over_mpinfer"] = fmt.format(occ["wall_s"] / r["wall_s"])
        if "in_process_s" in occ:
            r["occ_over_mpinfer_in_process"] = fmt.format(occ["in_process_s"] / r["in_process_s"])


def table(rows: list[dict]) -> str:
    """Markdown table of the runs."""
    head = (
        "| model | T | full FP16 err (cal) | occ all-blocked err (cal) | tool | searched | wall s | in-process s "
        "| occ/mpinfer (wall) | occ/mpinfer (in-process) | verifications | node evals | FP16 FLOPs "
        "| max abs cal | max abs held-out "
        "| meets T held-out | strict max abs held-out |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if not r["ok"]:
            why = r.get("raised") or r.get("error", "")
            cells = [
                r["model"],
                f"{r['max_abs_T']:g}",
                f"{r['full_fp16_cal']:.2e}",
                f"{r['occ_blocked_cal']:.2e}",
                r["tool"],
                "yes" if r.get("searched") else "",
                f"{r['wall_s']:g}",
                f"{r.get('in_process_s', '')}",
                "",
                "",
                str(r.get("verifications", "")),
                "",
                f"no model: {why}",
                *[""] * 4,
            ]
        else:
            cells = [
                r["model"],
                f"{r['max_abs_T']:g}",
                f"{r['full_fp16_cal']:.2e}",
                f"{r['occ_blocked_cal']:.2e}",
                r["tool"],
                "yes" if r.get("searched") else "no",
                f"{r['wall_s']:g}",
                f"{r.get('in_process_s', '')}",
                r.get("occ_over_mpinfer", ""),
                r.get("occ_over_mpinfer_in_process", ""),
                str(r.get("verifications", "")),
                str(r.get("node_evaluations", "")),
                f"{100 * r['fp16_flops']:.1f}%",
                f"{r['cal_max_abs']:.2e}",
                f"{r['heldout_max_abs']:.2e}",
                "yes" if r["meets_heldout"] else "no",
                f"{r['strict']['max_abs']:.2e}" if "strict" in r else r.get("strict_error", ""),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=DEFAULT_MODELS, help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per tool run")
    p.add_argument("--samples", type=int, default=32, help="calibration = validation samples for both tools")
    p.add_argument("--exporter", default="torchscript", choices=["torchscript", "dynamo"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix="mpinfer-search-speed-"))
    folder.mkdir(parents=True, exist_ok=True)
    rows = [r for key in args.models.split(",") for r in bench_model(key, folder, args)]
    (folder / "search_speed.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    print(f"results in {folder / 'search_speed.json'}")


def worker(argv: list[str]) -> None:
    tool, src, dst, cal, info, max_abs = argv
    # Imported here, before either tool's timer starts, so that neither tool's in-process time pays for them
    # (occ imports onnxruntime at module level, mpinfer lazily inside the conversion); wall time has them.
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401

    extra = run_tool(tool, Path(src), Path(dst), Path(cal), Path(info), float(max_abs))
    extra["peak_rss_mb"] = vm_hwm_mb()
    Path(info).write_text(json.dumps(extra))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()
