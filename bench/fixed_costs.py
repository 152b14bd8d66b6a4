"""Convert's fixed costs on one model (issue 37, item 4): each step timed alone, the best of N repeats.

GraphInfo, the rules (``planner.rule_plan``, no calibration statistics), the rewrite with the in-memory validity gate
(``validate.apply_validated``: checker, strict type inference, an ONNX Runtime load) and the gate on the written file
(``validate.gate_published``). Prints process CPU seconds and wall seconds per step (the CPU figure is the steadier
one on a shared machine).

    PYTHONPATH=$PWD .venv/bin/python bench/fixed_costs.py MODEL.onnx [REPEATS]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from mpinfer.modelio import name_nodes
from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.graph.normalize import sort_nodes
from mpinfer.precision.graph.validate import apply_validated, gate_published
from mpinfer.precision.rules.planner import RuleOptions, rule_plan
from mpinfer.specs import Precision


def main() -> None:
    model = name_nodes(sort_nodes(onnx.load(sys.argv[1])))
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    best: dict[str, tuple[float, float]] = {}

    def timed(label: str, fn: Callable[[], Any]) -> Any:
        start, cpu = time.perf_counter(), time.process_time()
        out = fn()
        spent = (time.process_time() - cpu, time.perf_counter() - start)
        old = best.get(label, (float("inf"), float("inf")))
        best[label] = (min(old[0], spent[0]), min(old[1], spent[1]))
        return out

    for _ in range(repeats):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        info = timed("GraphInfo", lambda m=copy: GraphInfo(m))
        _, nodes = timed("rules", lambda i=info: rule_plan(i, Precision.FP16, RuleOptions()))
        result, nodes = timed("apply + gate", lambda i=info, n=nodes: apply_validated(i, n, Precision.FP16))
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "converted.onnx"
            onnx.save(result.model, path)
            timed("gate on the file", lambda p=path, i=info: gate_published(p, baseline_model=i.model))
    figures = {k: {"cpu_s": round(v[0], 3), "wall_s": round(v[1], 3)} for k, v in best.items()}
    print(json.dumps({"nodes": len(model.graph.node), "best_of": repeats, **figures}))


if __name__ == "__main__":
    main()
