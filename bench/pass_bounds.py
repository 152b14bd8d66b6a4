"""The two passes a verifying convert cannot skip, against the two-pass floor (issue 37's "within 2x the floor").

The floor of bench/convert_cost.py is one FP32 ONNX Runtime pass over the calibration data plus one ONNX Runtime pass
of the written model. Convert with data cannot do with those two: its range rules read every float tensor of every
sample (the calibration pass fetches each one as a graph output), and it verifies the written model under strict
numerics (the cast graph: a float32 graph with a rounding Cast pair after every low op), not under ONNX Runtime's
own FP16 CPU kernels. This script times, sessions included, over every sample of ``--data`` in batches of
``--batch``, in interleaved rounds:

* ``fp32``: the FP32 model, default session options (the floor's first pass);
* ``written``: the converted model, default session options (the floor's second pass);
* ``calibration``: the FP32 model fetching every float tensor calibration fetches, in calibration's own session
  (``calibrate.fetched_tensors``, ``capture._Sessions``), the tensors only fetched (no statistics);
* ``strict``: the converted model's cast graph (``castgraph.open_cast_session``, the session convert verifies with).

and prints the medians and ``(calibration + strict) / (fp32 + written)``: a lower bound of convert / floor before any
statistics, rules, planning, search or file writing.

    PYTHONPATH=$PWD python bench/pass_bounds.py --model /tmp/cc/deep.1.onnx --reference /tmp/cc/deep.onnx \\
        --data /tmp/cc/deep.npz [--batch 16] [--rounds 5]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import onnx
import onnxruntime as ort
from strict_pass import parse_passes  # (bench/, first on sys.path when run as a script)

from mpinfer.precision.calib.calibrate import fetched_tensors
from mpinfer.precision.calib.capture import _Sessions
from mpinfer.precision.emulator.castgraph import open_cast_session


def calibration_session(model: onnx.ModelProto) -> tuple[Callable[[], Callable], int]:
    """A maker of calibration's own session of ``model`` (its every main-graph float tensor but the inputs, the graph
    outputs first, as ``calibrate._Run`` fetches them) and how many tensors it returns."""
    names, _, _, types = fetched_tensors(model)

    def make() -> Callable:
        sess = _Sessions(model, types).session(names)
        return lambda b: sess.run(names, b)

    return make, len(names)


def timed(make: Callable[[], Callable], batches: list[dict]) -> float:
    """Wall seconds of opening a runner with ``make`` and running it on every batch."""
    t = time.perf_counter()
    run = make()
    for b in batches:
        run(b)
    return time.perf_counter() - t


def main() -> None:
    a, batches, n = parse_passes(__doc__, 5)
    converted = onnx.load(a.model)
    calibration, outputs = calibration_session(onnx.load(a.reference))
    cpu = ["CPUExecutionProvider"]

    def session(path: str) -> Callable:
        sess = ort.InferenceSession(path, providers=cpu)
        return lambda b: sess.run(None, b)

    def strict() -> Callable:
        sess, why = open_cast_session(converted)
        if sess is None:
            raise SystemExit(f"no cast graph for this model: {why}")
        return sess

    passes: dict[str, Callable[[], Callable]] = {
        "fp32": lambda: session(a.reference),
        "written": lambda: session(a.model),
        "calibration": calibration,
        "strict": strict,
    }
    times: dict[str, list[float]] = {k: [] for k in passes}
    for _ in range(a.rounds):
        for name, make in passes.items():
            times[name].append(timed(make, batches))
    med = {k: statistics.median(v) for k, v in times.items()}
    floor, bound = med["fp32"] + med["written"], med["calibration"] + med["strict"]
    print(f"{n} samples, batch {a.batch}, {a.rounds} interleaved rounds (median wall s, sessions included); "
          f"calibration fetches {outputs} outputs")
    print("| pass | wall s | / fp32 pass |")
    print("|---|---|---|")
    for name, value in med.items():
        print(f"| {name} | {value:.3f} | {value / med['fp32']:.2f}x |")
    print(f"floor (fp32 + written) {floor:.3f} s; calibration + strict {bound:.3f} s: "
          f"**{bound / floor:.2f}x the floor** before statistics, rules, search and writing")


if __name__ == "__main__":
    main()
