"""LSTM and GRU, one time step at a time, with the state stored in the node's precision between steps.

Gate pre-activations are matrix products accumulated in FP32 plus the biases, rounded once (a fused
recurrent kernel); each activation, product and sum of the cell update is rounded. Non-default activations,
clipping, coupled input/forget gates and ragged ``sequence_lens`` fall back to onnx.reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpinfer.precision.emulator.kernels.numerics import NodeInfo, Numerics, UnsupportedVariant


def _sigmoid(v: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(v))
    return np.where(v >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(v.dtype, copy=False)


def _check(n: NodeInfo, x: list[Any], defaults: list[str]) -> None:
    acts = [a.decode() if isinstance(a, bytes) else a for a in (n.get("activations") or [])]
    if acts and [a.lower() for a in acts] not in (
        [d.lower() for d in defaults],
        [d.lower() for d in defaults] * 2,
    ):
        raise UnsupportedVariant(f"{n.op_type} activations {acts}")
    if n.get("clip") is not None or n.get("input_forget", 0):
        raise UnsupportedVariant(f"{n.op_type} clip/input_forget")
    lens = x[4] if len(x) > 4 else None
    seq = x[0].shape[1 if n.get("layout", 0) else 0]
    if lens is not None and np.any(np.asarray(lens) != seq):
        raise UnsupportedVariant(f"{n.op_type} with ragged sequence_lens")


def _directions(n: NodeInfo) -> list[bool]:
    """One entry per direction: True when it runs backwards in time."""
    d = n.get("direction", "forward")
    d = d.decode() if isinstance(d, bytes) else d
    return {"forward": [False], "reverse": [True], "bidirectional": [False, True]}[d]


def _run(
    n: NodeInfo,
    num: Numerics,
    x: list[Any],
    gates: int,
    step: Callable[..., tuple[np.ndarray, np.ndarray | None]],
    with_cell: bool,
) -> list[np.ndarray]:
    """Shared driver: layout, directions, initial states; returns [Y, Y_h] (+ [Y_c])."""
    layout = n.get("layout", 0)
    xs = np.swapaxes(x[0], 0, 1) if layout else x[0]  # (seq, batch, input)
    w, r = x[1], x[2]
    hidden = r.shape[-1]
    bias = _optional(x, 3)
    if bias is None:
        bias = np.zeros((w.shape[0], 2 * gates * hidden), xs.dtype)
    h0, c0, peep = _optional(x, 5), _optional(x, 6, with_cell), _optional(x, 7, with_cell)
    if layout:
        h0 = np.swapaxes(h0, 0, 1) if h0 is not None else None
        c0 = np.swapaxes(c0, 0, 1) if c0 is not None else None
    batch = xs.shape[1]
    ys, hs, cs = [], [], []
    for d, backwards in enumerate(_directions(n)):
        h = h0[d] if h0 is not None else np.zeros((batch, hidden), xs.dtype)
        c = c0[d] if c0 is not None else np.zeros((batch, hidden), xs.dtype)
        p = peep[d] if peep is not None else None
        y_d, h, c = _one_direction(num, xs, w[d], r[d], bias[d], (h, c), p, gates, step, backwards)
        ys.append(y_d)
        hs.append(h)
        cs.append(c)
    y = np.stack(ys, axis=1)  # (seq, dirs, batch, hidden)
    states = [np.stack(hs), np.stack(cs)] if with_cell else [np.stack(hs)]
    if layout:
        y, states = np.transpose(y, (2, 0, 1, 3)), [np.swapaxes(s, 0, 1) for s in states]
    return [y, *states]


def _optional(x: list[Any], i: int, wanted: bool = True) -> Any:
    """Input ``i`` of the node, or None when it is absent, empty-named, or not ``wanted``."""
    return x[i] if wanted and len(x) > i and x[i] is not None else None


def _one_direction(
    num: Numerics,
    xs: np.ndarray,
    w: np.ndarray,
    r: np.ndarray,
    bias: np.ndarray,
    state: tuple[np.ndarray, Any],
    p: np.ndarray | None,
    gates: int,
    step: Callable[..., tuple[np.ndarray, np.ndarray | None]],
    backwards: bool,
) -> tuple[np.ndarray, np.ndarray, Any]:
    """One direction over the whole sequence: its outputs (seq, batch, hidden) and its last states."""
    h, c = state
    hidden = r.shape[-1]
    seq = xs.shape[0]
    wb, rb = bias[: gates * hidden], bias[gates * hidden :]
    xw = num.r(xs @ w.T + wb)  # all time steps' input projections at once, FP32 accumulation
    out = [np.empty(0)] * seq
    for t in range(seq - 1, -1, -1) if backwards else range(seq):
        h, c = step(num, xw[t], h, c, r, rb, p, hidden)
        out[t] = h
    return np.stack(out), h, c


def _lstm_step(
    num: Numerics,
    xw: np.ndarray,
    h: np.ndarray,
    c: Any,
    r: np.ndarray,
    rb: np.ndarray,
    p: np.ndarray | None,
    hidden: int,
) -> tuple[np.ndarray, np.ndarray]:
    rr = num.r
    g = rr(xw + h @ r.T + rb)  # gate order i, o, f, c
    gi, go, gf, gc = (g[:, k * hidden : (k + 1) * hidden] for k in range(4))
    if p is not None:
        gi = rr(gi + rr(p[:hidden] * c))
        gf = rr(gf + rr(p[2 * hidden :] * c))
    i, f, cand = rr(_sigmoid(gi)), rr(_sigmoid(gf)), rr(np.tanh(gc))
    c_new = rr(rr(f * c) + rr(i * cand))
    if p is not None:
        go = rr(go + rr(p[hidden : 2 * hidden] * c_new))
    o = rr(_sigmoid(go))
    return rr(o * rr(np.tanh(c_new))), c_new


def _gru_step(linear_before_reset: bool) -> Callable[..., tuple[np.ndarray, None]]:
    def step(
        num: Numerics,
        xw: np.ndarray,
        h: np.ndarray,
        c: Any,
        r: np.ndarray,
        rb: np.ndarray,
        p: Any,
        hidden: int,
    ) -> tuple[np.ndarray, None]:
        rr = num.r
        hz = rr(xw[:, : 2 * hidden] + h @ r[: 2 * hidden].T + rb[: 2 * hidden])  # gate order z, r, h
        z, reset = rr(_sigmoid(hz[:, :hidden])), rr(_sigmoid(hz[:, hidden:]))
        rh, bh = r[2 * hidden :], rb[2 * hidden :]
        if linear_before_reset:
            pre = rr(xw[:, 2 * hidden :] + rr(reset * rr(h @ rh.T + bh)))
        else:
            pre = rr(xw[:, 2 * hidden :] + rr(reset * h) @ rh.T + bh)
        cand = rr(np.tanh(pre))
        return rr(rr((np.float32(1.0) - z) * cand) + rr(z * h)), None

    return step


def lstm(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """LSTM (gates i, o, f, c; sigmoid/tanh/tanh; optional peepholes)."""
    _check(n, x, ["Sigmoid", "Tanh", "Tanh"])
    return _run(n, num, x, 4, _lstm_step, with_cell=True)


def gru(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """GRU (gates z, r, h; sigmoid/tanh; both linear_before_reset forms)."""
    _check(n, x, ["Sigmoid", "Tanh"])
    return _run(n, num, x, 3, _gru_step(bool(n.get("linear_before_reset", 0))), with_cell=False)


KERNELS = {"LSTM": lstm, "GRU": gru}
