"""CPU cost of the metrics core and of calibration's statistics per batch, tree against tree (issue 27).

Each tree given (``--trees``: the baseline checkout first) runs in its own subprocess (its cwd, so ``python -c``
imports that tree's mpinfer), ``--rounds`` times interleaved, on the shapes of bench/convert_cost.py's nets:

* ``metrics``: ``OutputAccumulator.update`` (quantiles on, as the verification has them) of one batch of the CNN's
  output, float32 ``[16, 128, 96, 96]`` (75 MB, a ReLU's: half zeros), the candidate the baseline rounded to
  float16 (its zeros stay, as in convert's verification); ``metrics (no zero error)``: the candidate the baseline
  plus noise everywhere;
* ``stats cnn``: ``StatsCollector.update_many`` of one batch of the CNN's 16 tensors (8 Conv outputs, 8 ReLU
  outputs, 32 to 128 channels at 96x96, 16 samples: 0.8 GB);
* ``stats deep``: ``update_many`` of one batch of the deep net's 600 tensors ``[16, 32, 64]``.

Figures are ``time.process_time`` seconds (every thread) per batch, the median of ``--repeat`` calls; with
``--convert DIR``, CPU seconds of the thread running ``OutputAccumulator.update`` in a whole convert of the CNN:

    PYTHONPATH=$PWD .venv/bin/python bench/stats_cost.py --trees /work/main,$PWD
    PYTHONPATH=$PWD .venv/bin/python bench/stats_cost.py --trees /work/main,$PWD --convert /tmp/cc --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
import numpy as np
from mpinfer.metrics import OutputAccumulator
from mpinfer.precision.calib.statistics import StatsCollector
repeat = int(sys.argv[1])
rng = np.random.default_rng(0)
def cost(fn):
    fn()
    times = []
    for _ in range(repeat):
        c = time.process_time()
        fn()
        times.append(time.process_time() - c)
    return sorted(times)[len(times) // 2]
b = np.maximum(rng.standard_normal((16, 128, 96, 96), dtype=np.float32), 0)
c = b.astype(np.float16).astype(np.float32)  # (FP16's rounding: the ReLU's zeros stay zeros, as in convert)
acc = OutputAccumulator("y")
out = {"metrics": cost(lambda: acc.update(b, c))}
c = b + rng.standard_normal(b.shape, dtype=np.float32) * np.float32(1e-3)
out["metrics (no zero error)"] = cost(lambda: acc.update(b, c))
del b, c
chans = [32, 32, 64, 64, 128, 128, 128, 128]
conv = [rng.standard_normal((16, ch, 96, 96), dtype=np.float32) for ch in chans]
cnn = [(f"conv{i}", x) for i, x in enumerate(conv)] + [(f"relu{i}", np.maximum(x, 0)) for i, x in enumerate(conv)]
col = StatsCollector()
out["stats cnn"] = cost(lambda: col.update_many(cnn))
del cnn, conv
deep = [(f"t{i}", np.tanh(rng.standard_normal((16, 32, 64), dtype=np.float32))) for i in range(600)]
out["stats deep"] = cost(lambda: col.update_many(deep))
col.close()
print(json.dumps(out))
"""

# --convert DIR: convert DIR/cnn.onnx with DIR/cnn.npz (bench/convert_cost.py writes both there) as convert_cost
# does, timing every OutputAccumulator.update on the thread that runs it (time.thread_time: ONNX Runtime's and the
# statistics' threads left out), summed for the search's accumulators (no quantiles) and the verification's.
CONVERT = r"""
import json, sys, time
from pathlib import Path
import mpinfer.metrics as m
from mpinfer.precision import ConvertConfig, convert_precision
d = Path(sys.argv[1])
spent = {"metrics in search": 0.0, "metrics in verification": 0.0}
update = m.OutputAccumulator.update
def timed(self, b, c, labels=None):
    t = time.thread_time()
    update(self, b, c, labels)
    spent["metrics in verification" if self.quantiles else "metrics in search"] += time.thread_time() - t
m.OutputAccumulator.update = timed
cfg = ConvertConfig(model=d / "cnn.onnx", output=d / "cnn.stats_cost.onnx", calibration=str(d / "cnn.npz"),
                    budget=None, force=True, progress=False, batch_size=16)
convert_precision(cfg)
print(json.dumps(spent))
"""


def run(tree: Path, repeat: int) -> dict[str, float]:
    """One child's figures (CPU s per batch)."""
    return _child(tree, CHILD, str(repeat))


def _child(tree: Path, script: str, arg: str) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, cwd=tree,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", required=True, help="mpinfer checkouts, comma-separated (baseline first)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--convert", type=Path, help="time the metrics in a convert of DIR/cnn.onnx instead")
    a = p.parse_args()
    trees = [Path(t).resolve() for t in a.trees.split(",")]
    got: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    for _ in range(a.rounds):
        for tree in trees:
            got[tree].append(_child(tree, CONVERT, str(a.convert.resolve())) if a.convert else run(tree, a.repeat))
    keys = list(got[trees[0]][0])
    what = "CPU s in the convert" if a.convert else "CPU s per batch"
    print(f"{what} (median of rounds); ratio against the first tree")
    print("| tree | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    base = {k: statistics.median(r[k] for r in got[trees[0]]) for k in keys}
    for tree in trees:
        med = {k: statistics.median(r[k] for r in got[tree]) for k in keys}
        print(f"| {tree.name} | " + " | ".join(f"{med[k]:.3f} ({med[k] / base[k]:.2f}x)" for k in keys) + " |")


if __name__ == "__main__":
    main()
