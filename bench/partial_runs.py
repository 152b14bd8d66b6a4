"""What partial cast-graph runs would save a convert's search (issue 37, "searches that reuse").

Runs one ``mpinfer convert`` in this process with :data:`mpinfer.precision.numerics.castjudge.PARTIAL_RUNS` on or
off and reports, for every candidate judged on the cast graph, its partial graph's nodes against its whole cast
graph's (None: whole runs), and the CPU seconds its runs took by kind: ``whole`` (the whole cast graph),
``partial-batch`` / ``partial-rows`` (the partial graph on a kept search batch / on samples of them), ``rows-past``
(a subset of the samples the kept FP32 tensors cannot feed: the whole cast graph runs it), and ``keep`` (the FP32
cast graph's run that keeps the tensors).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/partial_runs.py on|off -- convert M --calibration D.npz \
        -o /tmp/x/out.onnx --force
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

from mpinfer.cli import main
from mpinfer.precision.numerics import castjudge

costs: defaultdict[str, float] = defaultdict(float)
graphs: list[tuple[int, int] | None] = []


def _timed(kind: str, fn, *args):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    costs[f"{kind} cpu_s"] += time.process_time() - cpu
    costs[f"{kind} wall_s"] += time.perf_counter() - wall
    costs[f"{kind} runs"] += 1
    return out


def _install() -> None:
    judged_call, session = castjudge.JudgedGraph.__call__, castjudge.CastJudge.session
    keep = castjudge.CastJudge.keep_fp32

    def call(self, feeds, batch=None, rows=None):
        kind = "whole"
        if self.partial is not None and self.fp32 is not None:
            if batch is not None and batch < len(self.fp32.batches):
                kind = "partial-batch"
            elif rows is not None:
                fed = self.fp32.rows(self.partial.cut + self.partial.taken, rows) is not None
                kind = "partial-rows" if fed else "rows-past"
        return _timed(kind, judged_call, self, feeds, batch, rows)

    def judged(self, low):
        before = self._last
        got = session(self, low)
        if got is not None and self._last is not before:
            graphs.append((got.partial.changed, got.partial.total) if got.partial is not None else None)
        return got

    setattr(castjudge.JudgedGraph, "__call__", call)  # noqa: B010 (patched in place: the search calls these)
    setattr(castjudge.CastJudge, "session", judged)  # noqa: B010
    setattr(castjudge.CastJudge, "keep_fp32",  # noqa: B010
            lambda self, batches: None if self._fp32_asked else _timed("keep", keep, self, batches))


if __name__ == "__main__":
    castjudge.PARTIAL_RUNS = sys.argv[1] == "on"
    _install()
    try:
        main(sys.argv[3:], standalone_mode=False)
    finally:
        print(f"partial runs {sys.argv[1]}; candidate cast graphs (partial nodes / whole nodes):",
              ", ".join("whole" if g is None else f"{g[0]}/{g[1]}" for g in graphs))
        for kind in ("whole", "partial-batch", "partial-rows", "rows-past", "keep"):
            if costs[f"{kind} runs"]:
                print(f"  {kind}: {costs[f'{kind} runs']:.0f} runs, {costs[f'{kind} cpu_s']:.2f} CPU s, "
                      f"{costs[f'{kind} wall_s']:.2f} wall s")
        print(f"  total: {sum(v for k, v in costs.items() if k.endswith('cpu_s')):.2f} CPU s")
