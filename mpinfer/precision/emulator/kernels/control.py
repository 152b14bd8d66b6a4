"""If, Loop and Scan: the executor passes ``run_body(body, bindings) -> outputs`` for the bodies.

Body nodes have their own addresses (``Loop_2/body/Add_1``) and their own precision; the control-flow
node itself only moves values between iterations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mpinfer.precision.emulator.kernels.numerics import NodeInfo, UnsupportedVariant

BodyRunner = Callable[[Any, Mapping[str, Any]], list[Any]]


def _scalar(v: Any) -> Any:
    return np.asarray(v).ravel()[0]


def run_if(n: NodeInfo, bodies: Mapping[str, Any], ins: list[Any], run_body: BodyRunner) -> list[Any]:
    """If: run then_branch or else_branch."""
    return run_body(bodies["then_branch" if bool(_scalar(ins[0])) else "else_branch"], {})


def run_loop(n: NodeInfo, bodies: Mapping[str, Any], ins: list[Any], run_body: BodyRunner) -> list[Any]:
    """Loop: trip count and/or condition, loop-carried values, stacked scan outputs."""
    body = bodies["body"]
    trip = int(np.asarray(ins[0]).ravel()[0]) if ins and ins[0] is not None else None
    cond = bool(np.asarray(ins[1]).ravel()[0]) if len(ins) > 1 and ins[1] is not None else True
    carried = list(ins[2:])
    n_scan = len(body.outputs) - 1 - len(carried)
    scans: list[list[np.ndarray]] = [[] for _ in range(n_scan)]
    i = 0
    while cond and (trip is None or i < trip):
        names = body.inputs
        bind = {names[0]: np.asarray(i, np.int64), names[1]: np.asarray(cond, bool)}
        bind.update({names[2 + j]: v for j, v in enumerate(carried)})
        res = run_body(body, {k: v for k, v in bind.items() if k})
        cond = bool(np.asarray(res[0]).ravel()[0])
        carried = res[1 : 1 + len(carried)]
        for j, v in enumerate(res[1 + len(carried) :]):
            scans[j].append(v)
        i += 1
    return carried + [np.stack(s) if s else np.zeros((0,), np.float32) for s in scans]


def run_scan(n: NodeInfo, bodies: Mapping[str, Any], ins: list[Any], run_body: BodyRunner) -> list[Any]:
    """Scan: states carried, inputs sliced along their scan axes, outputs stacked (opset 8's batch too)."""
    body = bodies["body"]
    m = int(n.get("num_scan_inputs"))
    if n.opset < 9:  # Scan-8: [sequence_lens], states and inputs with a leading batch axis
        lens, rest = ins[0], ins[1:]
        states, xs = list(rest[: len(rest) - m]), rest[len(rest) - m :]
        if lens is not None and np.any(np.asarray(lens) != xs[0].shape[1]):
            raise UnsupportedVariant("Scan-8 with per-sample sequence lengths")
        dirs = list(n.get("directions") or [0] * m)
        per_sample = [
            _scan(body, [s[b] for s in states], [x[b] for x in xs], [0] * m, dirs, None, None, run_body)
            for b in range(xs[0].shape[0])
        ]
        return [np.stack(vals) for vals in zip(*per_sample, strict=True)]
    states, xs = list(ins[: len(ins) - m]), ins[len(ins) - m :]
    in_axes = list(n.get("scan_input_axes") or [0] * m)
    in_dirs = list(n.get("scan_input_directions") or [0] * m)
    return _scan(
        body,
        states,
        xs,
        in_axes,
        in_dirs,
        n.get("scan_output_axes"),
        n.get("scan_output_directions"),
        run_body,
    )


def _scan(
    body: Any,
    states: list[Any],
    xs: list[Any],
    in_axes: list[int],
    in_dirs: list[int],
    out_axes: Any,
    out_dirs: Any,
    run_body: BodyRunner,
) -> list[Any]:
    n_out = len(body.outputs) - len(states)
    out_axes = list(out_axes or [0] * n_out)
    out_dirs = list(out_dirs or [0] * n_out)
    length = xs[0].shape[in_axes[0] % xs[0].ndim]
    outs: list[list[np.ndarray]] = [[] for _ in range(n_out)]
    for t in range(length):
        bind = dict(zip(body.inputs, states, strict=False))
        for j, x in enumerate(xs):
            pos = length - 1 - t if in_dirs[j] else t
            bind[body.inputs[len(states) + j]] = np.take(x, pos, axis=in_axes[j] % x.ndim)
        res = run_body(body, bind)
        states = res[: len(states)]
        for j, v in enumerate(res[len(states) :]):
            outs[j].append(v)
    stacked = []
    for j, seq in enumerate(outs):
        seq = seq[::-1] if out_dirs[j] else seq
        ax = out_axes[j] % (seq[0].ndim + 1) if seq else 0
        stacked.append(np.stack(seq, axis=ax) if seq else np.zeros((0,), np.float32))
    return states + stacked


CONTROL_FLOW_KERNELS = {"If": run_if, "Loop": run_loop, "Scan": run_scan}
