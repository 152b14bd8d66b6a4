"""Scale: a > 2 GB random-weights model through convert, compare and build-engine; peak memory / model size.

The model (a stack of MatMul + Add + Relu layers, 9 x 8192x8192 FP32 weights = 2.4 GB) is written straight
to ONNX external data, layer by layer, so building it never holds it in memory. Each step then runs as
``mpinfer`` in a subprocess of its own, one at a time, and reports its wall time and peak RSS (VmHWM of the
worker, printed at exit) as a multiple of the FP32 model's size:

* ``convert-none``: ``convert --calibration none`` (rules and weight ranges only);
* ``convert``: ``convert --calibration random:16 --budget "cosine>=0.999"`` (calibration, the budget search and
  the final verification on every calibration sample);
* ``compare``: ``compare`` of the FP32 model with that output on ``random:16``;
* ``build-engine``: ``build-engine --backend onnxruntime`` of that output.

    PYTHONPATH=$PWD .venv/bin/python bench/scale.py [--layers 9] [--width 8192] [--out DIR] [--steps ...]
        [--root TREE]       # the mpinfer source tree to run (default this one): an older checkout, for before/after
        [--memory-limit SIZE]

A ~0.6 GB version (``--layers 9 --width 4096``) shows the same ratios minus the interpreter's fixed ~0.1 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("convert-none", "convert", "compare", "build-engine")
BUDGET = "cosine>=0.999"


def build(folder: Path, layers: int, width: int) -> Path:
    """Write model.onnx + model.onnx.data without holding all weights in memory."""
    import onnx
    from onnx import TensorProto, helper

    data_name = "model.onnx.data"
    inits, nodes, offset = [], [], 0
    rng = np.random.default_rng(0)
    with open(folder / data_name, "wb") as f:
        prev = "x"
        for i in range(layers):
            w = (rng.standard_normal((width, width), dtype=np.float32) / np.sqrt(width)).astype(np.float32)
            b = np.zeros(width, np.float32)
            for name, arr in ((f"w{i}", w), (f"b{i}", b)):
                raw = arr.tobytes()
                f.write(raw)
                t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(arr.shape))
                t.data_location = TensorProto.EXTERNAL
                for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(len(raw)))):
                    t.external_data.add(key=k, value=v)
                offset += len(raw)
                inits.append(t)
            del w, raw
            nodes += [
                helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"add{i}"),
                helper.make_node("Relu", [f"a{i}"], [f"r{i}"], name=f"relu{i}"),
            ]
            prev = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["N", width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "model.onnx"
    onnx.save_model(model, str(path))
    return path


def step_args(step: str, src: Path, folder: Path) -> list[str]:
    """The mpinfer command line of ``step``."""
    low = folder / "model.fp16.onnx"
    if step == "convert-none":
        return ["convert", str(src), "--calibration", "none", "-o", str(folder / "model.rules.onnx"), "--force"]
    if step == "convert":
        return ["convert", str(src), "--calibration", "random:16", "--budget", BUDGET, "-o", str(low), "--force"]
    if step == "compare":
        return ["compare", str(src), str(low), "--data", "random:16", "--quiet"]
    if step == "build-engine":
        return ["build-engine", str(low), "--backend", "onnxruntime", "-o", str(folder / "model.fp16.ort.onnx"),
                "--force"]
    raise ValueError(step)


def run_step(args: list[str], root: Path, memory_limit: str | None) -> dict:
    """Run ``mpinfer ARGS`` from ``root`` in a subprocess; its exit status, wall time and peak RSS (VmHWM)."""
    # VmHWM (peak RSS of this address space) printed at exit; ru_maxrss would include the forking parent.
    wrapper = (
        "import atexit, sys; from pathlib import Path; atexit.register(lambda: print(next(l for l in "
        "Path('/proc/self/status').read_text().splitlines() if l.startswith('VmHWM')), file=sys.stderr)); "
        "from mpinfer.cli import main; main()"
    )
    if memory_limit and args[0] in ("convert", "compare"):  # build-engine sizes nothing from a memory limit
        args = [*args, "--memory-limit", memory_limit]
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", wrapper, *args], env=env, cwd=root, stderr=subprocess.PIPE,
                          stdout=subprocess.DEVNULL, text=True, check=False)
    wall = time.perf_counter() - start
    hwm = [line for line in proc.stderr.splitlines() if line.startswith("VmHWM")]
    out = {"exit": proc.returncode, "wall_s": round(wall, 1), "peak_rss_bytes": int(hwm[-1].split()[1]) * 1024
           if hwm else -1}
    if proc.returncode:
        out["error"] = proc.stderr.strip().splitlines()[-3:]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    p.add_argument("--root", type=Path, default=ROOT, help="mpinfer source tree to run (default: this one)")
    p.add_argument("--memory-limit", default=None,
                   help="--memory-limit of the convert and compare steps (default: mpinfer's)")
    args = p.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix="mpinfer-scale-"))
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "model.onnx"
    if not (src.is_file() and (folder / "model.onnx.data").is_file()):
        start = time.perf_counter()
        build(folder, args.layers, args.width)
        print(f"built {src} in {time.perf_counter() - start:.0f}s", flush=True)
    size = src.stat().st_size + (folder / "model.onnx.data").stat().st_size
    print(f"model: {size / 1e9:.2f} GB, mpinfer from {args.root}", flush=True)
    results: dict = {"model_bytes": size, "root": str(args.root), "steps": {}}
    for step in args.steps:
        r = run_step(step_args(step, src, folder), args.root, args.memory_limit)
        r["peak_over_model_size"] = round(r["peak_rss_bytes"] / size, 3)
        results["steps"][step] = r
        print(f"{step:>13}: exit {r['exit']}, {r['wall_s']:7.1f} s, peak RSS {r['peak_rss_bytes'] / 1e9:5.2f} GB "
              f"= {r['peak_over_model_size']:.2f}x the FP32 model{'  ' + str(r.get('error')) if 'error' in r else ''}",
              flush=True)
    print(json.dumps(results, indent=1))
    (folder / "scale.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
