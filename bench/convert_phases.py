"""Interleaved converts of before/after trees: wall and CPU seconds, and the search's and the verification's seconds.

Each convert runs in its own subprocess (``OMP_NUM_THREADS=1``, the tree on ``PYTHONPATH``, that tree's ``.venv`` or
this checkout's), the trees alternating for each model and round; the phases come from the written plan's summary
(``search.wall_s``, ``verification.wall_s``). Models: ``deep``/``cnn`` as ``DIR/{name}.onnx`` + ``DIR/{name}.npz``,
others as ``DIR/{name}.onnx`` + ``DIR/{name}.cal.npz``.

    .venv/bin/python bench/convert_phases.py --trees /tmp/base,$PWD --models deep,orientation --rounds 3 --dir /tmp/h3/m
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r'''
import hashlib, json, sys, time
from pathlib import Path
from mpinfer.precision import ConvertConfig, convert_precision
m, d, o = sys.argv[1:4]
s, c = time.perf_counter(), time.process_time()
res = convert_precision(ConvertConfig(model=Path(m), output=Path(o), calibration=d, force=True, progress=False))
wall, cpu = time.perf_counter() - s, time.process_time() - c
sm = res.plan.summary
ver = sm.get("verification", {})
print(json.dumps({"wall": wall, "cpu": cpu, "search": sm.get("search", {}).get("wall_s"), "verify": ver.get("wall_s"),
                  "engine": ver.get("engine"), "low": sm["nodes_low"],
                  "sha": hashlib.sha256(Path(o).read_bytes()).hexdigest()[:12]}))
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", required=True, help="mpinfer checkouts, comma-separated (baseline first)")
    p.add_argument("--models", default="deep")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", type=Path, required=True, help="the folder holding the models and their data")
    p.add_argument("--out", type=Path, default=Path("/tmp/convert_phases"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for m in args.models.split(","):
            data = args.dir / (f"{m}.npz" if m in ("deep", "cnn") else f"{m}.cal.npz")
            for tree in args.trees.split(","):
                venv = Path(tree) / ".venv" / "bin" / "python"
                python = str(venv if venv.exists() else ROOT / ".venv" / "bin" / "python")
                env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
                out = args.out / f"{Path(tree).name}_{m}.onnx"
                done = subprocess.run([python, "-c", CHILD, str(args.dir / f"{m}.onnx"), str(data), str(out)],
                                      env=env, capture_output=True, text=True, check=True)
                got = json.loads(done.stdout.strip().splitlines()[-1])
                rows.setdefault((m, tree), []).append(got)
                print(m, Path(tree).name, json.dumps(got), flush=True)
    print(f"\nmedians over {args.rounds} rounds:")
    print("| model | tree | convert wall s | convert CPU s | search s | verify s | verify engine | nodes low | sha |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (m, tree), got in rows.items():
        med = _medians(got)
        print(f"| {m} | {Path(tree).name} | {med('wall'):.2f} | {med('cpu'):.2f} | {med('search')} | {med('verify')} "
              f"| {got[0]['engine']} | {got[0]['low']} | {got[0]['sha']} |")


def _medians(got: list[dict]):
    def med(key: str) -> float | None:
        values = [g[key] for g in got if g[key] is not None]
        return statistics.median(values) if values else None

    return med


if __name__ == "__main__":
    main()
