"""One strict pass over calibration data: the emulator vs the cast graph vs ONNX Runtime FP32 (issue 27).

For a converted model (``--model``, e.g. bench/convert_cost.py's written ``cnn.1.onnx``) and its FP32 source
(``--reference``), each round runs, in this order in one process: ONNX Runtime on the FP32 model (default session
options, the floor's pass), the strict emulator on the converted model (``StrictRunner``, what convert verified
with before), and the converted model's cast graph (``castgraph.open_cast_session``), over every sample of
``--data`` in batches of ``--batch``; sessions included, outputs checked bit for bit between the two strict
engines. Rounds interleave the three, so they see the same background load; the table prints each engine's
best and median wall and CPU (``process_time``, every thread) seconds and its ratio to the FP32 pass.

    PYTHONPATH=$PWD python bench/strict_pass.py --model /tmp/cc/cnn.1.onnx --reference /tmp/cc/cnn.onnx \\
        --data /tmp/cc/cnn.npz --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort

from mpinfer.precision.emulator.castgraph import open_cast_session
from mpinfer.precision.emulator.runner import StrictRunner


def timed(make: Callable[[], Callable], batches: list[dict]) -> tuple[float, float, list]:
    """(wall s, CPU s, outputs) of opening a runner with ``make`` and running it on every batch."""
    t, c = time.perf_counter(), time.process_time()
    run = make()
    outs = [run(b) for b in batches]
    return time.perf_counter() - t, time.process_time() - c, outs


def parse_passes(doc: str, rounds: int) -> tuple[argparse.Namespace, list[dict], int]:
    """The ``--model/--reference/--data/--batch/--rounds`` arguments, the data in batches, and its samples.

    Shared with bench/pass_bounds.py.
    """
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", required=True, help="the converted model")
    p.add_argument("--reference", required=True, help="its FP32 source")
    p.add_argument("--data", required=True, help=".npz of the model's inputs")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=rounds)
    a = p.parse_args()
    with np.load(a.data) as z:
        data = {k: z[k] for k in z.files}
    n = len(next(iter(data.values())))
    return a, [{k: v[i : i + a.batch] for k, v in data.items()} for i in range(0, n, a.batch)], n


def main() -> None:
    a, batches, n = parse_passes(__doc__, 3)
    model = onnx.load(a.model)

    def fp32() -> Callable:
        sess = ort.InferenceSession(a.reference, providers=["CPUExecutionProvider"])
        return lambda b: sess.run(None, b)

    def emulator() -> Callable:
        runner = StrictRunner(model)
        runner.activate()
        return runner.infer

    def casts() -> Callable:
        sess, why = open_cast_session(model)
        if sess is None:
            raise SystemExit(f"no cast graph for this model: {why}")
        return sess

    engines = {"onnxruntime fp32": fp32, "strict emulator": emulator, "strict cast graph": casts}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in engines}
    for _ in range(a.rounds):
        outs = {}
        for name, make in engines.items():
            wall, cpu, outs[name] = timed(make, batches)
            times[name].append((wall, cpu))
        for e, c in zip(outs["strict emulator"], outs["strict cast graph"], strict=True):
            for k in e:
                same = np.array_equal(np.asarray(e[k]), np.asarray(c[k]), equal_nan=True)
                assert same and np.array_equal(np.signbit(e[k]), np.signbit(c[k])), k
    base = statistics.median(w for w, _ in times["onnxruntime fp32"])
    base_cpu = statistics.median(c for _, c in times["onnxruntime fp32"])
    print(f"{n} samples, batch {a.batch}, {a.rounds} interleaved rounds; the two strict engines' outputs identical")
    print("| engine | wall s best / median | CPU s median | wall / FP32 pass | CPU / FP32 pass |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        wall, cpu = statistics.median(w for w, _ in ts), statistics.median(c for _, c in ts)
        best = min(w for w, _ in ts)
        print(f"| {name} | {best:.2f} / {wall:.2f} | {cpu:.1f} | {wall / base:.2f}x | {cpu / base_cpu:.2f}x |")


if __name__ == "__main__":
    main()
