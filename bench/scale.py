"""Scale: convert a > 2 GB random-weights model end to end and report peak memory / model size.

The model (a stack of MatMul + Add + Relu layers, 9 x 8192x8192 FP32 weights = 2.4 GB) is written straight
to ONNX external data, layer by layer, so building it never holds it in memory. ``mpinfer convert`` then
runs in a subprocess (``--calibration none``: rules and weight ranges only) and reports its peak RSS
(VmHWM).

    PYTHONPATH=$PWD .venv/bin/python bench/scale.py [--layers 9] [--width 8192] [--out DIR]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix="mpinfer-scale-"))
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    src = build(folder, args.layers, args.width)
    size = src.stat().st_size + (folder / "model.onnx.data").stat().st_size
    print(f"built {src} ({size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f}s", flush=True)
    out = folder / "model.fp16.onnx"
    # VmHWM (peak RSS of this address space) printed at exit; ru_maxrss would include the forking parent.
    wrapper = (
        "import atexit, sys; from pathlib import Path; atexit.register(lambda: print(next(l for l in "
        "Path('/proc/self/status').read_text().splitlines() if l.startswith('VmHWM')), file=sys.stderr)); "
        "from mpinfer.cli import main; main()"
    )
    cmd = [
        sys.executable,
        "-c",
        wrapper,
        "convert",
        str(src),
        "--calibration",
        "none",
        "-o",
        str(out),
        "--force",
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read() if proc.stderr else ""
    del usage
    hwm = [line for line in err.splitlines() if line.startswith("VmHWM")]
    peak = int(hwm[-1].split()[1]) * 1024 if hwm else -1
    out_size = out.stat().st_size + sum(f.stat().st_size for f in folder.glob("model.fp16.onnx.data"))
    result = {
        "model_bytes": size,
        "output_bytes": out_size,
        "exit": os.waitstatus_to_exitcode(status),
        "wall_s": round(wall, 1),
        "peak_rss_bytes": peak,
        "peak_over_model_size": round(peak / size, 3),
    }
    if result["exit"]:
        result["error"] = err.strip().splitlines()[-1:] if err else []
    print(json.dumps(result, indent=1))
    (folder / "scale.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
