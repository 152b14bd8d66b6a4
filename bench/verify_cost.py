"""The cost of convert's guarantee: final verification time as a share of convert time, before vs after.

Each model converts in its own subprocess, once with the code of ``--before`` (a checkout of mpinfer before the
final verification existed, e.g. the main worktree) and once with this tree, on the same model and the same
calibration .npz (256 samples unless the model ships its own data), with the same budget (``--budget`` text;
default: the default floor's text), and once more with this tree and no ``--budget`` (the default floor). The
table gives convert wall time (the ``convert_precision`` call, imports excluded), the verification's share of it
(``summary.verification.wall_s``), the ratio after / before, the FP16 share of FLOPs before and after, and what
the verification measured (the budget's metrics on every sample) and moved back to FP32.

Models: ``digits_cnn`` (calibration/digits.npz, 256 real samples), ``mlp``, ``resnet_small`` and
``transformer_small:<depth>`` (depth 8: over 500 nodes), exported with TorchScript at opset 17, fed seeded
random .npz data (token ids for the transformer).

With ``--published layout,orientation,ocr_rec,vad,pitch,dnsmos``: bench/published.py's models instead (downloaded
once into its cache), on its task calibration data and batch sizes. Each child's peak RSS and its FP32 node list
(``runs.jsonl`` in ``--out``) come with the figures.

    PYTHONPATH=$PWD .venv/bin/python bench/verify_cost.py --before /work/main [--models digits_cnn,mlp]
        [--published layout,vad] [--numerics strict] [--budget "cosine>=0.999"] [--out bench/out/verify_cost]
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = 256
CHILD = r"""
import json, sys, time
from pathlib import Path
from mpinfer.precision import ConvertConfig, convert_precision
args = json.loads(sys.argv[1])
spent = {"cpu": 0.0}
try:  # the verification's CPU time (trees that have it)
    import mpinfer.precision.budget.repair as verify_mod
    real = verify_mod.verify_and_repair
    def timed(*a, **k):
        t = time.process_time()
        try:
            return real(*a, **k)
        finally:
            spent["cpu"] += time.process_time() - t
    verify_mod.verify_and_repair = timed
except ImportError:
    pass
start, cpu = time.perf_counter(), time.process_time()
res = convert_precision(ConvertConfig(model=Path(args["model"]), output=Path(args["output"]),
                        calibration=args["data"], budget=args["budget"], numerics=args["numerics"], force=True,
                        progress=False, batch_size=args.get("batch_size")))
wall, cpu = time.perf_counter() - start, time.process_time() - cpu
s = res.plan.summary
import resource
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "verify_cpu_s": spent["cpu"],
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "fp32_nodes": sorted(f"{n.name} ({n.op_type}: {n.reason})" for n in res.plan.nodes
                                       if not n.precision.is_low),
                  "low_share_flops": s.get("low_share_flops"), "verification": s.get("verification"),
                  "search": s.get("search")}))
"""

def export(name: str, out: Path) -> tuple[Path, Path]:
    """Export models/<name>.py (``transformer_small:8`` gives the depth) and write its calibration .npz."""
    import importlib

    import onnx
    import torch

    base, _, arg = name.partition(":")
    sys.path.insert(0, str(ROOT))
    mod = importlib.import_module(f"models.{base}")
    torch.manual_seed(0)
    model = (mod.build(depth=int(arg)) if arg else mod.build()).eval()
    args = mod.example_inputs(2)
    names = ["x"] if base == "digits_cnn" else [f"input_{i}" for i in range(len(args))]
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, buf, dynamo=False, input_names=names, opset_version=17,
                          dynamic_axes={n: {0: "batch"} for n in names})
    path = out / f"{name.replace(':', '_')}.onnx"
    onnx.save(onnx.load_from_string(buf.getvalue()), str(path))
    if base == "digits_cnn":
        return path, ROOT / "calibration" / "digits.npz"
    rng = np.random.default_rng(0)
    data = {}
    for n, a in zip(names, args, strict=True):
        a = a.numpy()
        shape = (SAMPLES, *a.shape[1:])
        if a.dtype.kind in "iu":
            data[n] = rng.integers(0, int(a.max()) + 1 if a.max() > 0 else 2, shape).astype(a.dtype)
        else:
            data[n] = rng.standard_normal(shape).astype(a.dtype)
    npz = out / f"{name.replace(':', '_')}.npz"
    np.savez(npz, **data)
    return path, npz


def published_cases(names: str, out: Path) -> list[tuple[str, Path, Path, int | None]]:
    """bench/published.py's models and task calibration data: (name, model, calibration .npz, batch size)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import published

    return published.task_cases(names, out)


def run(tree: Path, model: Path, data: Path, out: Path, budget: str | None, numerics: str,
        batch_size: int | None = None) -> dict:
    args = {"model": str(model), "output": str(out), "data": str(data), "budget": budget, "numerics": numerics,
            "batch_size": batch_size}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}, check=False)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row(name: str, tag: str, before: dict, after: dict) -> str:
    if "error" in after or "error" in before:
        return f"| {name} | {tag} | {before.get('error', '')} | {after.get('error', '')} | | | | | | |"
    ver = after.get("verification") or {}
    share = ver.get("wall_s", 0.0) / after["wall_s"] if after["wall_s"] else 0.0
    cpu_share = after.get("verify_cpu_s", 0.0) / after["cpu_s"] if after.get("cpu_s") else 0.0
    figures = ver.get("figures") or {}
    worst: dict[str, float] = {}
    for values in figures.values():
        for k in ("cosine_min", "cosine", "max_abs"):
            v = values.get(k)
            if isinstance(v, (int, float)):
                worst[k] = min(worst.get(k, v), v) if k != "max_abs" else max(worst.get(k, v), v)
    measured = ", ".join(f"{k}={v:.6g}" for k, v in worst.items())
    return (
        f"| {name} | {tag} | {before['wall_s']:.2f} / {before['cpu_s']:.2f} | {after['wall_s']:.2f} / "
        f"{after['cpu_s']:.2f} | {after['wall_s'] / before['wall_s']:.2f}x / {after['cpu_s'] / before['cpu_s']:.2f}x "
        f"| {share:.0%} / {cpu_share:.0%} ({ver.get('samples', 0)} samples) "
        f"| {before.get('low_share_flops', 0):.1%} → {after.get('low_share_flops', 0):.1%} "
        f"| {ver.get('moved_to_fp32', 0)} | {measured} "
        f"| {before.get('rss_mb', 0):.0f} / {after.get('rss_mb', 0):.0f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="mpinfer checkout before the final verification")
    p.add_argument("--models", default="digits_cnn,mlp,resnet_small,transformer_small:8")
    p.add_argument("--published", default="", help="bench/published.py models instead (e.g. layout,vad), "
                   "on their task calibration data")
    p.add_argument("--numerics", default="strict")
    p.add_argument("--budget", default="cosine>=0.999")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "verify_cost")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"budget {a.budget!r}, {a.numerics} numerics; convert seconds (imports excluded), OMP_NUM_THREADS=1")
    print("| model | run | before s (wall / CPU) | after s (wall / CPU) | after/before | verification share "
          "(wall / CPU) | FP16 FLOPs before → after | moved to FP32 | verified (worst output) | peak RSS MB (before / "
          "after) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cases = (published_cases(a.published, a.out) if a.published
             else [(name, *export(name, a.out), None) for name in a.models.split(",")])
    for name, model, data, batch in cases:
        for tag, budget in (("--budget", a.budget), ("no --budget (floor)", None)):
            before = run(a.before, model, data, a.out / "before.onnx", budget, a.numerics, batch)
            after = run(ROOT, model, data, a.out / "after.onnx", budget, a.numerics, batch)
            print(row(name, tag, before, after), flush=True)
            log = a.out / "runs.jsonl"
            with log.open("a") as f:
                f.write(json.dumps({"model": name, "run": tag, "before": before, "after": after}) + "\n")


if __name__ == "__main__":
    main()
