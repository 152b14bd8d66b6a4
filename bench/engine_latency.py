"""Latency of FP32 vs FP16 engines: ONNX Runtime (CUDA, or CPU with --device cpu) and TensorRT if present.

Builds the models in a temp folder from models/resnet_small.py (torch.onnx.export, FP32; the FP16 model
comes from `mpinfer convert` when that stage is installed, else from exporting the half-precision torch
model), builds engines with `mpinfer.engine.build_engine`, and times each engine with the same inputs in
the same run. Prints p50/p90 latency, throughput and the FP16/FP32 ratio per backend, with the device named.

    python bench/engine_latency.py                 # GPU: ORT CUDA (+ TensorRT when installed)
    python bench/engine_latency.py --device cpu    # plumbing check on a CPU machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def export_models(work: Path, device: str, batch: int) -> dict[str, Path]:
    import torch

    from models import resnet_small

    model = resnet_small.build().eval()
    x = resnet_small.example_inputs(batch)[0]
    fp32 = work / "resnet.onnx"
    torch.onnx.export(
        model,
        (x,),
        str(fp32),
        input_names=["x"],
        output_names=["y"],
        dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
        dynamo=False,
    )
    fp16 = work / "resnet.fp16.onnx"
    try:
        from mpinfer.precision import ConvertConfig, convert_precision

        convert_precision(ConvertConfig(model=fp32, output=fp16))
        how = "mpinfer convert"
    except ImportError:
        dev = "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"
        half = resnet_small.build().eval().to(dev).half()
        torch.onnx.export(
            half,
            (x.to(dev).half(),),
            str(fp16),
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
            dynamo=False,
        )
        how = "torch .half() export (mpinfer convert not installed)"
    print(f"FP16 model from: {how}")
    return {"fp32": fp32, "fp16": fp16}


def time_runner(runner, feeds: dict[str, np.ndarray], warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        runner.infer(feeds, check_inputs=False)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        runner.infer(feeds, check_inputs=False)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()

    from mpinfer.engine import BuildConfig, build_engine, load_engine_runner, parse_shapes, probe_tensorrt
    from mpinfer.engine.config import Backend
    from mpinfer.gpu import gpu_info

    gpu = gpu_info(0) if args.device == "cuda" else None
    if args.device == "cuda" and gpu is None:
        sys.exit("No CUDA GPU visible; run with --device cpu for a plumbing check.")
    where = f"{gpu.name} (compute capability {gpu.capability_text})" if gpu else "CPU"
    backends = [("onnxruntime", Backend.ONNXRUNTIME)]
    if gpu is not None and probe_tensorrt().version is not None:
        backends.append((f"tensorrt {probe_tensorrt().version}", Backend.TENSORRT))
    rows = []
    with tempfile.TemporaryDirectory() as td:
        work = Path(td)
        models = export_models(work, args.device, args.batch)
        shapes = parse_shapes(f"x:1x3x64x64,{args.batch}x3x64x64,{args.batch}x3x64x64")
        for label, backend in backends:
            medians = {}
            for prec, path in models.items():
                suffix = ".engine" if backend is Backend.TENSORRT else ".ort"
                result = build_engine(
                    BuildConfig(
                        model=path,
                        output=work / f"{prec}-{backend.value}{suffix}",
                        backend=backend,
                        device=args.device,
                        shapes=shapes,
                    )
                )
                with load_engine_runner(result.path, device=args.device) as runner:
                    dtype = runner.input_specs()[0].dtype
                    x = np.random.default_rng(0).standard_normal((args.batch, 3, 64, 64)).astype(dtype)
                    times = time_runner(runner, {"x": x}, args.warmup, args.iters)
                p50 = statistics.median(times) * 1e3
                p90 = float(np.percentile(times, 90)) * 1e3
                medians[prec] = p50
                rows.append((label, prec, p50, p90, args.batch / (p50 / 1e3)))
            rows.append((label, "fp16/fp32", medians["fp16"] / medians["fp32"], None, None))
    print(
        f"\nLatency on {where}, batch {args.batch}, {args.iters} iterations (host<->device copies included)"
    )
    print(f"{'backend':<22}{'model':<11}{'p50 ms':>9}{'p90 ms':>9}{'samples/s':>12}")
    for label, prec, p50, p90, thr in rows:
        if p90 is None:
            print(f"{label:<22}{prec:<11}{p50:>9.2f}x")
        else:
            print(f"{label:<22}{prec:<11}{p50:>9.3f}{p90:>9.3f}{thr:>12.0f}")


if __name__ == "__main__":
    main()
