"""Strict emulator speed vs ONNX Runtime CPU on models/resnet_small.py (and the incremental run_from cost).

Run from the repository root:
    PYTHONPATH=$PWD python bench/emulator_speed.py [--batch 16] [--repeat 5]

Prints one line per measurement; ratios are against ONNX Runtime measured in the same run, same threads.
"""

from __future__ import annotations

import argparse
import io
import time
import warnings

import numpy as np


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _interleaved(fns, repeat: int) -> list[float]:
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0 = ORT default)")
    args = parser.parse_args()

    import onnx
    import onnxruntime as ort
    import torch

    from models import resnet_small
    from mpinfer.modelio import iter_nodes, name_nodes
    from mpinfer.precision.emulator.emulate import GraphEmulator
    from mpinfer.specs import Precision

    module = resnet_small.build()
    x = resnet_small.example_inputs(args.batch)[0]
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), buf, dynamo=False, input_names=["x"], opset_version=17)
    model = name_nodes(onnx.load_from_string(buf.getvalue()))
    feeds = {"x": x.numpy()}
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    emu = GraphEmulator(model)
    addresses = [ref.address for ref in iter_nodes(model.graph)]
    all_low = {a: Precision.FP16 for a in addresses}
    sess.run(None, feeds)
    emu.run(feeds)
    emu.run(feeds, all_low)

    # interleaved, best of N: the machine may be shared, so each tool sees the same background load
    t_ort, t_fp32, t_fp16 = _interleaved(
        [lambda: sess.run(None, feeds), lambda: emu.run(feeds), lambda: emu.run(feeds, all_low)], args.repeat
    )
    ref = emu.run(feeds, keep=True)
    mid = addresses[len(addresses) // 2]
    t_mid = _best(lambda: emu.run_from(ref, {mid: Precision.FP16}), args.repeat)
    t_last = _best(lambda: emu.run_from(ref, {addresses[-1]: Precision.FP16}), args.repeat)
    n_mid = emu.run_from(ref, {mid: Precision.FP16}).recomputed
    out = sess.get_outputs()[0].name
    err = float(np.abs(emu.run(feeds).outputs[out] - sess.run(None, feeds)[0]).max())
    print(f"model: models/resnet_small.py, batch {args.batch}, {len(addresses)} nodes, input 3x64x64")
    print(f"onnxruntime CPU           {t_ort * 1e3:8.1f} ms  1.0x")
    print(f"emulator FP32 (full run)  {t_fp32 * 1e3:8.1f} ms  {t_fp32 / t_ort:.1f}x")
    print(f"emulator all-FP16         {t_fp16 * 1e3:8.1f} ms  {t_fp16 / t_ort:.1f}x")
    print(f"run_from, middle node     {t_mid * 1e3:8.1f} ms  {t_mid / t_ort:.2f}x  ({n_mid} nodes redone)")
    print(f"run_from, last node       {t_last * 1e3:8.1f} ms  {t_last / t_ort:.3f}x  (1 node redone)")
    print(f"max |FP32 emulator - onnxruntime| = {err:.2e}")


if __name__ == "__main__":
    main()
