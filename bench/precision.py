"""Side-by-side FP16 conversion benchmark: mpinfer vs onnxconverter-common vs ModelOpt AutoCast.

Every model in models/ is exported (TorchScript exporter, opset 17, seeded weights; runs/digits/best.pt
for the digits CNN when present), then each tool converts it in its own subprocess (wall time and peak RSS
from wait4). Each result is loaded in ONNX Runtime (CPU) and run through mpinfer's strict FP16 emulator on
held-out data; errors are against the FP32 model under the same numerics.

    PYTHONPATH=$PWD .venv/bin/python bench/precision.py [--models digits_cnn,mlp] [--modelopt-python PY]
        [--out bench/out] [--sizes]

Tools: ``mpinfer`` (rules + calibration ranges + budget search ``cosine>=0.9999,top1>=0.999``, strict
numerics), ``occ-fp16`` (onnxconverter-common ``convert_float_to_float16``, keep_io_types),
``occ-auto`` (``auto_convert_mixed_precision``, validate: cosine>=0.9999 and equal arg-max),
``modelopt`` (AutoCast ``convert_to_mixed_precision`` defaults, keep_io_types). ``--sizes`` adds the
search-cost scaling table (transformer_small depth 2/4/8, resnet_small width 8/16/32).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BUDGET = "cosine>=0.9999,top1>=0.999"
# Tighter budget for the scaling table, so that verification fails and the bisection runs.
SIZE_BUDGET = "max_abs<=2e-4"
MODELS = [
    "digits_cnn",
    "mlp",
    "resnet_small",
    "transformer_small",
    "control_flow",
    "hard_overflow",
    "hard_bn_var",
    "hard_shared_weight",
]
TOOLS = ["mpinfer", "occ-fp16", "occ-auto", "modelopt"]
TOOL_TIMEOUT = 900


# -- models and data ------------------------------------------------------------------------------
def hard_model(name: str, out: Path) -> Path:
    """Small graphs with the failure modes seen in published models (built with onnx.helper)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def w(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def t(name, arr):
        return numpy_helper.from_array(np.asarray(arr, np.float32), name)

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])
    if name == "hard_overflow":  # a detection-head-like score that reaches ~1e5 before being normalised
        nodes = [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="feat"),
            helper.make_node("Mul", ["h", "big"], ["s"], name="scale"),
            helper.make_node("MatMul", ["s", "w2"], ["s2"], name="head"),
            helper.make_node("Div", ["s2", "norm"], ["y"], name="normalise"),
        ]
        inits = [t("w1", w(64, 64)), t("big", 30000.0), t("w2", w(64, 10)), t("norm", 1e5)]
    elif name == "hard_bn_var":  # an unfused BatchNorm with a running variance of 1e8
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8, 8])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])
        nodes = [
            helper.make_node("Conv", ["x", "cw"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["bn"], name="bn"),
            helper.make_node("Relu", ["bn"], ["r"], name="relu"),
            helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
            helper.make_node("Flatten", ["p"], ["f"], name="flat"),
            helper.make_node("Gemm", ["f", "fw"], ["y"], name="fc"),
        ]
        inits = [
            t("cw", w(16, 4, 3, 3, scale=300.0)),
            t("g", np.ones(16)),
            t("b", np.zeros(16)),
            t("m", np.zeros(16)),
            t("v", np.full(16, 1e8)),
            t("fw", w(16, 10, scale=1.0)),
        ]
    else:  # hard_shared_weight: one initializer read by an FP16-safe MatMul and an FP32 Softmax path
        nodes = [
            helper.make_node("MatMul", ["x", "wsh"], ["a"], name="mm"),
            helper.make_node("Add", ["a", "wrow"], ["b"], name="add"),
            helper.make_node("ReduceSum", ["wsh"], ["colsum"], name="colsum", keepdims=0),
            helper.make_node("Softmax", ["b"], ["sm"], name="softmax", axis=-1),
            helper.make_node("Mul", ["sm", "colsum"], ["y"], name="weight"),
        ]
        inits = [t("wsh", w(64, 10)), t("wrow", w(10))]
        inits[0].name = "wsh"
        nodes[2].input[:] = ["wsh", "axes0"]
        inits.append(numpy_helper.from_array(np.array([0], np.int64), "axes0"))
    graph = helper.make_graph(nodes, name, [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save_model(model, str(out))
    return out


def export(name: str, out: Path, **build_kw) -> Path:
    import torch

    if name.startswith("hard_"):
        return hard_model(name, out)
    mod = importlib.import_module(f"models.{name}")
    model = mod.build_scriptable() if name == "control_flow" else mod.build(**build_kw)
    ckpt = ROOT / "runs" / "digits" / "best.pt"
    if name == "digits_cnn" and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"] if "model" in state else state)
    names = [s.split(":")[0] for s in mod.INPUT_SPECS]
    dyn = {n: {0: "batch"} for n in names}
    if name.startswith("transformer"):
        dyn = {names[0]: {0: "batch", 1: "seq"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            mod.example_inputs(),
            str(out),
            dynamo=False,
            input_names=names,
            output_names=["y"],
            opset_version=17,
            dynamic_axes=dyn,
        )
    return out


def make_data(
    name: str,
    model_path: Path,
    folder: Path,
    *,
    cal_samples: int = 64,
    dims: dict[str, int] | None = None,
) -> tuple[Path, dict[str, np.ndarray]]:
    """Calibration .npz (digits: the shipped set) and 64 held-out evaluation samples (another seed).

    ``cal_samples`` seeded random calibration samples for the other models; ``dims`` sizes symbolic
    dims other than the batch (``{"seq": 16}``).
    """
    import onnx

    from mpinfer.data import load_feeds
    from mpinfer.specs import specs_from_onnx

    if name == "digits_cnn":
        cal = ROOT / "calibration" / "digits.npz"
        val = (
            np.load(ROOT / "calibration" / "digits_val.npz")
            if (ROOT / "calibration" / "digits_val.npz").exists()
            else np.load(cal)
        )
        return cal, {"x": val["x"][:128]}
    specs = specs_from_onnx(onnx.load(str(model_path)))
    cal_batch = next(iter(load_feeds("random:1", specs, batch_size=cal_samples, seed=0, dims=dims)))
    cal = folder / f"{model_path.stem}.cal.npz"
    np.savez(cal, **cal_batch)
    evals = next(iter(load_feeds("random:1", specs, batch_size=64, seed=123, dims=dims)))
    return cal, evals


# -- tools (run in a subprocess: python bench/precision.py --worker TOOL SRC DST CAL) -------------------
def run_tool(tool: str, src: Path, dst: Path, cal: Path) -> dict:
    import onnx

    if tool == "mpinfer":
        from mpinfer.precision import ConvertConfig, convert_precision

        res = convert_precision(
            ConvertConfig(
                model=src, output=dst, calibration=str(cal), budget=BUDGET, force=True, progress=False
            )
        )
        return {"search": res.plan.summary.get("search")}
    model = onnx.load(str(src))
    if tool == "occ-fp16":
        from onnxconverter_common import float16

        out = float16.convert_float_to_float16(model, keep_io_types=True)
    elif tool == "occ-auto":
        from onnxconverter_common import auto_mixed_precision

        feeds = dict(np.load(cal))
        feeds = {k: v[:16] for k, v in feeds.items() if not k.startswith("_")}

        def validate(res1, res2) -> bool:
            for a, b in zip(res1, res2, strict=False):
                a, b = (
                    np.asarray(a, np.float64).reshape(len(a), -1),
                    np.asarray(b, np.float64).reshape(len(b), -1),
                )
                if not np.all(np.isfinite(b)):
                    return False
                cos = (a * b).sum(1) / np.maximum(
                    np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30
                )
                if cos.mean() < 0.9999 or (a.shape[1] > 1 and np.mean(a.argmax(1) == b.argmax(1)) < 0.999):
                    return False
            return True

        out = auto_mixed_precision.auto_convert_mixed_precision(
            model, feeds, validate_fn=validate, keep_io_types=True
        )
    elif tool == "modelopt":
        from modelopt.onnx.autocast import convert_to_mixed_precision

        out = convert_to_mixed_precision(onnx_path=str(src), low_precision_type="fp16", keep_io_types=True)
    else:
        raise SystemExit(f"unknown tool {tool}")
    from mpinfer.modelio import save_onnx

    save_onnx(out, dst)
    return {}


def launch(
    tool: str,
    src: Path,
    dst: Path,
    cal: Path,
    python: str,
    *,
    script: Path | None = None,
    extra: tuple[str, ...] = (),
    timeout: float = TOOL_TIMEOUT,
) -> dict:
    """Run one tool in a subprocess; wall time and peak RSS (wait4) of that process.

    The worker is ``script --worker TOOL SRC DST CAL INFO *extra`` (default: this file); it writes INFO (json).
    """
    info = dst.with_suffix(".info.json")
    info.unlink(missing_ok=True)
    dst.unlink(missing_ok=True)
    worker_script = str((script or Path(__file__)).resolve())
    cmd = [python, worker_script, "--worker", tool, str(src), str(dst), str(cal), str(info), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    # stderr to a file, not a pipe: a tool that logs a lot would block on a full pipe while we poll wait4.
    err_path = dst.with_suffix(".stderr.txt")
    with err_path.open("w") as err_file:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err_file, text=True)
    deadline = start + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            return {"ok": False, "error": f"did not finish in {timeout:g} s (killed)", "wall_s": timeout}
        time.sleep(0.05)
    wall = time.perf_counter() - start
    err = err_path.read_text(errors="replace")
    out = {"wall_s": round(wall, 2), "ok": os.waitstatus_to_exitcode(status) == 0 and dst.exists()}
    if not out["ok"]:
        out["error"] = (err.strip().splitlines() or ["no output"])[-1][:200]
    if info.exists():  # a worker may record how far it got before failing
        out.update(json.loads(info.read_text()))
    return out


# -- evaluation -----------------------------------------------------------------------------------
def metrics(ref: list[np.ndarray], got: list[np.ndarray]) -> dict:
    a = np.asarray(ref[0], np.float64).reshape(len(ref[0]), -1)
    b = np.asarray(got[0], np.float64).reshape(len(got[0]), -1)
    bad = int(np.size(b) - np.count_nonzero(np.isfinite(b)))
    d = np.where(np.isfinite(b), b - a, np.inf)
    cos = (a * np.nan_to_num(b)).sum(1) / np.maximum(
        np.linalg.norm(a, axis=1) * np.linalg.norm(np.nan_to_num(b), axis=1), 1e-30
    )
    return {
        "max_abs": float(np.abs(d).max()),
        "cosine": float(cos.mean()),
        "top1": float(np.mean(a.argmax(1) == b.argmax(1))) if a.shape[1] > 1 else 1.0,
        "nonfinite": bad,
    }


def evaluate(src: Path, dst: Path, feeds: dict[str, np.ndarray]) -> dict:
    from mpinfer.modelio import ort_session
    from mpinfer.precision.emulator.runner import StrictRunner

    out: dict = {}
    ref_ort = ort_session(src).run(None, feeds)
    try:
        got = ort_session(dst).run(None, feeds)
        out["ort"] = metrics(ref_ort, got)
        out["loads"] = True
    except Exception as err:  # noqa: BLE001 - a peer's invalid model is a result
        out["loads"] = False
        out["ort_error"] = str(err).splitlines()[0][:160]
    try:
        with StrictRunner(src) as r32, StrictRunner(dst) as r16:
            names = r32.output_names()
            ref = [r32.infer(feeds)[n] for n in names]
            got = [r16.infer(feeds)[n] for n in names]
        out["strict"] = metrics(ref, got)
    except Exception as err:  # noqa: BLE001
        out["strict_error"] = str(err).splitlines()[0][:160]
    out.update(fp16_share_and_casts(src, dst))
    return out


def fp16_share_and_casts(src: Path, dst: Path, shapes: dict[str, tuple[int, ...]] | None = None) -> dict:
    """Share of the FP32 model's Conv/MatMul/Gemm FLOPs whose node reads or writes FP16 in ``dst``, and the
    Casts ``dst`` added. ``shapes``: input shapes to count FLOPs at, for a model with dynamic dims."""
    import onnx

    from mpinfer.precision.core.graphinfo import FLOAT16, GraphInfo

    out: dict = {}
    orig, conv = onnx.load(str(src)), onnx.load(str(dst))
    counted = orig
    if shapes:
        counted = onnx.ModelProto()
        counted.CopyFrom(orig)
        del counted.graph.value_info[:]
        for vi in counted.graph.input:
            if vi.name in shapes:
                dims = vi.type.tensor_type.shape.dim
                for d, size in zip(dims, shapes[vi.name], strict=True):
                    d.Clear()
                    d.dim_value = int(size)
    info = GraphInfo(counted)
    flops = {ref.address: info.flops(ref) for ref in info.nodes}
    cinfo = GraphInfo(conv)
    low = set()
    for ref in cinfo.nodes:
        if ref.node.op_type == "Cast":
            continue
        names = [n for n in list(ref.node.input) + list(ref.node.output) if n]
        if any(cinfo.types.get(n) == FLOAT16 for n in names):
            low.add(ref.address)
    total = sum(flops.values()) or 1
    out["fp16_flops"] = round(sum(f for a, f in flops.items() if a in low) / total, 4)
    out["casts"] = sum(n.op_type == "Cast" for n in conv.graph.node) - sum(
        n.op_type == "Cast" for n in orig.graph.node
    )
    return out


def search_sizes(folder: Path) -> list[dict]:
    from mpinfer.precision import ConvertConfig, convert_precision

    rows = []
    for name, kw in [("transformer_small", {"depth": d}) for d in (2, 4, 8)] + [
        ("resnet_small", {"width": w}) for w in (8, 16, 32)
    ]:
        src = export(name, folder / f"{name}_{'_'.join(f'{k}{v}' for k, v in kw.items())}.onnx", **kw)
        cal, _ = make_data(name, src, folder)
        res = convert_precision(
            ConvertConfig(
                model=src,
                output=src.with_suffix(".fp16.onnx"),
                calibration=str(cal),
                budget=SIZE_BUDGET,
                force=True,
                progress=False,
                max_batches=1,
            )
        )
        s = res.plan.summary["search"]
        rows.append(
            {
                "model": name,
                **kw,
                "nodes": s["model_nodes"],
                "groups": s["groups"],
                "node_evaluations": s["node_evaluations"],
                "verifications": s["verifications"],
                "wall_s": s["wall_s"],
                "evals_per_node": round(s["node_evaluations"] / s["model_nodes"], 1),
                "naive_evals": s["groups"] * s["model_nodes"] * s["batches"],
                "low_share_flops": res.plan.summary["low_share_flops"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def compile_bytecode() -> None:
    """Byte-compile mpinfer as ``pip install`` does for onnxconverter-common: run from a source tree with
    PYTHONDONTWRITEBYTECODE set, every import would otherwise compile mpinfer's modules from source inside
    its timers (tens of ms in-process, more in wall time), a cost installed packages never pay."""
    import compileall

    compileall.compile_dir(str(ROOT / "mpinfer"), quiet=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument(
        "--modelopt-python",
        default=sys.executable,
        help="python with nvidia-modelopt[onnx] (its pins clash with the project's onnx/onnxruntime)",
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--sizes", action="store_true")
    args = p.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix="mpinfer-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    compile_bytecode()
    results = []
    for name in args.models.split(","):
        src = export(name, folder / f"{name}.onnx")
        cal, feeds = make_data(name, src, folder)
        for tool in args.tools.split(","):
            dst = folder / f"{name}.{tool}.onnx"
            python = args.modelopt_python if tool == "modelopt" else sys.executable
            row = {"model": name, "tool": tool, **launch(tool, src, dst, cal, python)}
            if row["ok"]:
                row.update(evaluate(src, dst, feeds))
            results.append(row)
            print(json.dumps(row), flush=True)
    sizes = search_sizes(folder) if args.sizes else []
    (folder / "results.json").write_text(json.dumps({"tools": results, "sizes": sizes}, indent=1))
    (folder / "results.md").write_text(markdown(results, sizes))
    print(f"results in {folder / 'results.json'} and {folder / 'results.md'}")


def markdown(results: list[dict], sizes: list[dict]) -> str:
    """The tools table and (with ``--sizes``) the search-cost table, as bench/RESULTS.md shows them."""
    from mpinfer.report.markdown import md_table

    headers = [
        *("model", "tool", "loads in ORT", "FP16 share of FLOPs", "casts added", "max abs err (ORT CPU)"),
        *("max abs err (strict FP16)", "NaN/Inf", "wall s", "peak RSS MB"),
    ]
    rows = []
    for r in results:
        if not r["ok"]:
            rows.append([r["model"], r["tool"], f"crashed: `{r['error']}`", *[""] * 5, f"{r['wall_s']}", ""])
            continue
        rows.append(
            [
                *(r["model"], r["tool"], "yes" if r["loads"] else "no", f"{r['fp16_flops'] * 100:.1f}%"),
                *(str(r["casts"]), f"{r['ort']['max_abs']:.2e}", f"{r['strict']['max_abs']:.2e}"),
                *(str(r["ort"]["nonfinite"] + r["strict"]["nonfinite"]), f"{r['wall_s']}", f"{r['peak_rss_mb']}"),
            ]
        )
    lines = md_table(headers, rows)
    if sizes:
        headers = [
            *("model", "size", "nodes", "groups", "emulator node evaluations", "per node", "verifications"),
            *("naive per-group re-runs", "search wall s", "FP16 FLOPs"),
        ]
        rows = [
            [
                r["model"],
                f"depth {r['depth']}" if "depth" in r else f"width {r['width']}",
                *(str(r[k]) for k in ("nodes", "groups", "node_evaluations", "evals_per_node", "verifications")),
                *(str(r["naive_evals"]), str(r["wall_s"]), f"{r['low_share_flops'] * 100:.1f}%"),
            ]
            for r in sizes
        ]
        lines += md_table(headers, rows)
    return "\n".join(lines)


def vm_hwm_mb() -> float:
    """Peak RSS of this process's address space (VmHWM; unlike ru_maxrss it excludes the forking parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def worker(argv: list[str]) -> None:
    tool, src, dst, cal, info = argv
    extra = run_tool(tool, Path(src), Path(dst), Path(cal))
    extra["peak_rss_mb"] = vm_hwm_mb()
    Path(info).write_text(json.dumps(extra))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()
