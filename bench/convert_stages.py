"""Convert's stages in the pipeline itself (issue 37, item 4): wall and CPU seconds of each, over N converts.

Runs ``mpinfer -q convert MODEL --calibration DATA`` N times in this process (the first pays the lazy imports) with
convert.py's stage functions wrapped: ``_load``, calibration, the rules (``rule_plan``), the search, ``_apply`` (the
plan applied behind the validity gate), ``release_memory``, the verification (and, ``_verified``, with the gate's
ONNX Runtime load that runs beside it), the plan's save, the whole ``_convert``. Prints the median and the least
of each (the CPU figure is the steadier one on a shared machine). Unlike ``bench/fixed_costs.py`` the rules see the
calibration statistics and the apply follows the search, as in a convert.

    OMP_NUM_THREADS=1 PYTHONPATH=$TREE .venv/bin/python bench/convert_stages.py NAME MODEL.onnx DATA.npz [N]
"""

from __future__ import annotations

import functools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STAGES = {
    "_load": "_load",
    "calibrate_for_plan": "calibrate",
    "rule_plan": "rule_plan",
    "_search": "search",
    "_apply": "apply+gate",
    "release_memory": "release_memory",
    "_verify": "verify",
    # the verification with the gate's ONNX Runtime load that runs beside it, waited for (trees since session 26)
    "_verified": "verify+load",
    "_convert": "TOTAL",
}


def _wrap(owner: Any, attr: str, label: str, times: dict[str, list[float]]) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            t = times.setdefault(label, [0.0, 0.0, 0])
            t[0] += time.perf_counter() - wall
            t[1] += time.process_time() - cpu
            t[2] += 1

    setattr(owner, attr, timed)


def main() -> None:
    """Time the stages of N converts of one model and print them."""
    name, model, data = sys.argv[1:4]
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    import mpinfer.precision.convert as convert
    import mpinfer.precision.core.plan as plan
    from mpinfer.cli import main as cli

    times: dict[str, list[float]] = {}
    for attr, label in STAGES.items():
        if hasattr(convert, attr):  # (an older tree lacks a newer stage)
            _wrap(convert, attr, label, times)
    _wrap(plan.PrecisionPlan, "save", "plan.save", times)
    runs = []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(repeats):
            times.clear()
            sys.argv = ["mpinfer", "-q", "convert", model, "--calibration", data, "-o", str(Path(out) / "m.onnx"),
                        "--force"]
            try:
                cli()
            except SystemExit:
                pass
            runs.append({k: list(v) for k, v in times.items()})
    for label in runs[0]:
        walls = sorted(r[label][0] for r in runs)
        cpus = sorted(r[label][1] for r in runs)
        print(f"{name:12s} {label:16s} wall {walls[len(walls) // 2]:.3f} (min {walls[0]:.3f})  "
              f"cpu {cpus[len(cpus) // 2]:.3f} (min {cpus[0]:.3f}) calls={int(runs[0][label][2])}")


if __name__ == "__main__":
    main()
