"""Calibration against one FP32 pass, tree against tree (issue 37, "one FP32 pass").

Each tree given (``--trees``: the baseline checkout first) runs in its own subprocess, ``--rounds`` times interleaved
per model: ``calibrate_for_plan`` as convert calls it (the default floor: the search's tensors and every batch's
outputs kept), then over the same data in batches of ``--batch``: ``plain``, the FP32 model's own ONNX Runtime pass
(the convert floor's reference pass), and ``unfused``, a pass of the session that returns every float tensor, as
calibration's does (ONNX Runtime cannot fuse a Conv with its activation when both tensors are outputs: the least any
calibration that reads every tensor of every sample runs). Calibration runs under a fixed ``--memory-limit``, so
that every tree fetches a batch in the same slices. Figures: wall and CPU seconds (every thread) of each, and a
digest of the statistics (``statistics identical`` when every tree's match).

    PYTHONPATH=$PWD .venv/bin/python bench/calib_cost.py --trees /tmp/base,$PWD --models \
        /tmp/b19/base/deep.onnx=/tmp/b19/base/deep.npz,~/.cache/mpinfer-bench/published/pitch.onnx=/tmp/pitch.npz
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import hashlib, json, sys, time
from pathlib import Path
import numpy as np, onnx, onnxruntime as ort
from onnx import helper
model_path, data_path, batch, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
from mpinfer.memory import use_budget
from mpinfer.precision import ConvertConfig
from mpinfer.precision.convert import floor_for_model
from mpinfer.precision.options import resolve_options
from mpinfer.precision.plandata import CalibrationSettings, calibrate_for_plan
cfg = ConvertConfig(model=Path(model_path), output=Path("unused.onnx"), calibration=data_path, force=True,
                    progress=False)
model = onnx.load(model_path)
g = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.value_info) + list(g.output) + list(g.input)}
opts = floor_for_model(resolve_options(cfg), model)

def timed(fn):
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t, time.process_time() - c

with use_budget(limit or None):
    cal, wall, cpu = timed(lambda: calibrate_for_plan(CalibrationSettings.of(cfg), opts, model, types))
digest = hashlib.sha256(json.dumps(cal.stats.to_dict()["tensors"], sort_keys=True).encode()).hexdigest()[:16]

def one_pass(m, names):
    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    with np.load(data_path) as z:
        data = {k: z[k] for k in z.files}
    n = len(next(iter(data.values())))
    for i in range(0, n, batch):
        sess.run(names, {k: v[i:i + batch] for k, v in data.items()})

every = onnx.ModelProto()
every.CopyFrom(model)
outs = [vi.name for vi in model.graph.output]
floats = outs + [o for n in model.graph.node for o in n.output if types.get(o) == 1 and o not in outs]
del every.graph.output[:]
every.graph.output.extend(helper.make_tensor_value_info(n, 1, None) for n in floats)
_, plain_wall, plain_cpu = timed(lambda: one_pass(model, None))
_, unfused_wall, unfused_cpu = timed(lambda: one_pass(every, floats))
print(json.dumps({"cal_wall": wall, "cal_cpu": cpu, "plain_wall": plain_wall, "plain_cpu": plain_cpu,
                  "unfused_wall": unfused_wall, "unfused_cpu": unfused_cpu, "digest": digest,
                  "tensors": len(cal.stats), "samples": cal.stats.source.get("samples")}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", required=True, help="mpinfer checkouts, comma-separated (baseline first)")
    p.add_argument("--models", required=True, help="MODEL.onnx=DATA.npz pairs, comma-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="samples per call of the plain and unfused passes")
    p.add_argument("--memory-limit", default="4GB", help="calibration's memory budget ('': the default, which follows "
                   "the free memory: a batch fetched in other slices sums its values in another order)")
    args = p.parse_args()
    trees = [Path(t).expanduser().resolve() for t in args.trees.split(",")]
    print("| model | tree | calibration s (CPU s) | plain pass s (CPU s) | unfused pass s (CPU s) | statistics |")
    print("|---|---|---|---|---|---|")
    for pair in args.models.split(","):
        model, data = (str(Path(x).expanduser()) for x in pair.split("="))
        digests = set()
        for _ in range(args.rounds):
            for tree in trees:
                child = [sys.executable, "-c", CHILD, model, data, str(args.batch), args.memory_limit]
                env = {**os.environ, "PYTHONPATH": str(tree)}
                out = subprocess.run(child, cwd=tree, env=env, capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                digests.add(r["digest"])
                print(f"| {Path(model).stem} | {tree.name} | {r['cal_wall']:.2f} ({r['cal_cpu']:.2f}) | "
                      f"{r['plain_wall']:.2f} ({r['plain_cpu']:.2f}) | {r['unfused_wall']:.2f} ({r['unfused_cpu']:.2f})"
                      f" | {r['tensors']} tensors, {r['samples']} samples, {r['digest']} |", flush=True)
        # (a batch fetched in slices, whose size follows the free memory, sums the same values in another order)
        print(f"| {Path(model).stem} | | | | | statistics {'identical' if len(digests) == 1 else 'differ'} |")


if __name__ == "__main__":
    main()
