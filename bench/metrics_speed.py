"""Speed of the metrics core (``mpinfer.metrics.ModelAccumulator``) on output shapes the budget search compares.

Two batches of 16 samples per shape, the candidate an FP16 rounding of a slightly perturbed reference; the
search's accumulator (``quantiles=False``) and compare's (with the median/p99 histograms). With
``--old-budget FILE`` (a copy of the pre-core ``mpinfer/precision/budget.py``, e.g.
``git show 0d5421e:mpinfer/precision/budget.py > /tmp/old_budget.py``) its ``output_metrics`` is timed too.

    PYTHONPATH=$PWD .venv/bin/python bench/metrics_speed.py [--old-budget /tmp/old_budget.py] [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from mpinfer.metrics import ModelAccumulator

SHAPES = (
    ((16, 1000), "logits"),
    ((16, 128, 768), "hidden"),
    ((16, 32, 32000), "logits"),
    ((16, 3, 224, 224), "img"),
)


def _time(fn: Callable[[], object], repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old-budget", help="path of the old precision/budget.py, timed side by side")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    old = None
    if args.old_budget:
        spec = importlib.util.spec_from_file_location("old_budget", args.old_budget)
        assert spec is not None and spec.loader is not None
        old = importlib.util.module_from_spec(spec)
        sys.modules["old_budget"] = old  # its dataclasses look their module up
        spec.loader.exec_module(old)
    rng = np.random.default_rng(0)
    print("| output | shape | old budget ms | core, search ms | core, compare ms |")
    print("|---|---|---|---|---|")
    for shape, name in SHAPES:
        refs = [{name: rng.standard_normal(shape).astype(np.float32)} for _ in range(2)]
        noisy = [r[name] + 1e-3 * rng.standard_normal(shape) for r in refs]
        outs = [{name: n.astype(np.float16).astype(np.float32)} for n in noisy]

        def core(quantiles: bool, refs=refs, outs=outs, name=name) -> object:
            acc = ModelAccumulator([name], quantiles=quantiles)
            for r, o in zip(refs, outs, strict=True):
                acc.update(r, o)
            return acc.finalize()

        before = "-"
        if old is not None:
            before = f"{_time(partial(old.output_metrics, refs, outs, [name]), args.repeat):.1f}"
        search = _time(lambda: core(False), args.repeat)
        compare = _time(lambda: core(True), args.repeat)
        print(f"| {name} | {'x'.join(map(str, shape))} | {before} | {search:.1f} | {compare:.1f} |")


if __name__ == "__main__":
    main()
