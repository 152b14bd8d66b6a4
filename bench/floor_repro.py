"""Issue 27's repro models under the default floor: FP16 share of nodes, verdict, error on held-out inputs.

The three score MLPs of ``tests/precision/graphs.score_mlp`` (``x[N, 96] -> 384 -> 384 -> 1``; heads: a logit
times 40 into a Sigmoid, ``Add(z, 1000)``, a ReLU), converted with 160 calibration samples ``x ~ N(0, 3^2)`` and
no ``--budget`` (the default floor, strict numerics), then measured on 512 held-out samples of another seed:
the written model against the FP32 model, by ONNX Runtime and by the strict emulator. Run from the repo root::

    PYTHONPATH=$PWD python bench/floor_repro.py [--seeds 8,0]

``--published orientation,vad,...`` instead converts bench/published.py's models on their task calibration data
under the default floor and prints the floor's verdict per output (the noise it was judged from, if any).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpinfer.errors import AccuracyMismatchError  # noqa: E402
from mpinfer.precision import ConvertConfig, convert_precision  # noqa: E402
from mpinfer.precision.emulator.runner import StrictRunner  # noqa: E402
from tests.precision.graphs import SCORE_HEADS, run_ort, save, score_data, score_mlp  # noqa: E402


def _held_out_error(src: Path, out: Path, x: np.ndarray) -> tuple[float, float, float]:
    """Max |written - FP32| on ``x`` by ONNX Runtime and by strict emulation, and FP32's range there."""
    (ref,) = run_ort(src, {"x": x})
    (ort_out,) = run_ort(out, {"x": x})
    with StrictRunner(str(out)) as strict:
        strict_out = strict.infer({"x": x})["y"]
    return float(np.abs(ort_out - ref).max()), float(np.abs(strict_out - ref).max()), float(np.ptp(ref))


def row(head: str, seed: int, tmp: Path) -> str:
    """One table row: the head's model converted on the calibration data of ``seed``."""
    src = save(score_mlp(head), tmp / f"{head}.onnx")
    cal = score_data(tmp / f"cal{seed}.npz", seed=seed)
    held = np.load(score_data(tmp / "held.npz", n=512, seed=1000))["x"]
    out = tmp / f"{head}.{seed}.fp16.onnx"
    try:
        res = convert_precision(ConvertConfig(model=src, output=out, calibration=str(cal), progress=False))
    except AccuracyMismatchError as err:
        return f"| {head} | {seed} | refused: {err} | | | |"
    plan = res.plan.to_dict()
    ver = plan["summary"]["verification"]
    low = sum(n["precision"] != "fp32" for n in plan["nodes"])
    figs = ver["figures"]["y"]
    verdict = f"{'met' if ver['passed'] else 'NOT met'} (cosine_min={figs['cosine_min']:.4g}, " + (
        f"range_err={figs['range_err']:.3g})" if "range_err" in figs else f"max_abs={figs['max_abs']:.3g})"
    )
    ort_err, strict_err, span = _held_out_error(src, out, held)
    return (f"| {head} | {seed} | {low}/{len(plan['nodes'])} | {ver['budget']}: {verdict} | "
            f"{ort_err:.4g} / {strict_err:.4g} | {span:.3g} |")


def published_rows(names: str, tmp: Path) -> None:
    """The default floor's verdict per output on bench/published.py's models (strict numerics)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import plan_digest
    import published

    print("| model | FP16 nodes | moved back | output | floor terms | figures | verdict |")
    print("|---|---|---|---|---|---|---|")
    for name, model, npz, batch_size in published.task_cases(names, tmp):
        res = convert_precision(ConvertConfig(model=model, output=tmp / f"{name}.onnx", calibration=str(npz),
                                              batch_size=batch_size, progress=False))
        plan = res.plan.to_dict()
        ver = plan["summary"]["verification"]
        floor = ver.get("noise", {}).get("budget", ver["budget"])
        low = sum(n["precision"] != "fp32" for n in plan["nodes"])
        print(f"{name}-strict-floor digest {plan_digest._digest(res.plan)}", file=sys.stderr, flush=True)
        for out, figs in ver["figures"].items():
            shown = ", ".join(f"{k}={figs[k]:.4g}" for k in ("cosine_min", "range_err")
                              if isinstance(figs.get(k), float))
            noise = ver.get("noise", {}).get("figures", {}).get(out, {})
            if noise:
                shown += f" (all-FP32 noise: range_err={noise.get('range_err')})"
            terms = [t for t in floor.split(",") if ":" not in t or t.startswith(f"{out}:")]
            print(f"| {name} | {low}/{len(plan['nodes'])} | {ver['moved_to_fp32']} | {out} | {','.join(terms)} | "
                  f"{shown} | {'met' if ver['passed'] else 'NOT met'} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="8,0", help="calibration data seeds (comma-separated)")
    parser.add_argument("--published", default="", help="bench/published.py model names (comma-separated)")
    args = parser.parse_args()
    if args.published:
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            published_rows(args.published, Path(d))
        return
    print("| head | cal. seed | FP16 nodes | floor: verdict (verified on 160 samples) "
          "| held-out max err ORT / strict | held-out FP32 range |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in (int(s) for s in args.seeds.split(",")):
            for head in SCORE_HEADS:
                print(row(head, seed, Path(d)), flush=True)


if __name__ == "__main__":
    main()
