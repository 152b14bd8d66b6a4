"""LSTM and GRU, one time step at a time, with the state stored in the node's precision between steps.

Gate pre-activations are matrix products accumulated in FP32 plus the biases, rounded once (a fused
recurrent kernel); each activation, product and sum of the cell update is rounded. Non-default activations,
clipping, coupled input/forget gates and ragged ``sequence_lens`` fall back to onnx.reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpinfer.precision.kernels.numerics import NodeInfo, Numerics, UnsupportedVariant


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
    bias = x[3] if len(x) > 3 and x[3] is not None else np.zeros((w.shape[0], 2 * gates * hidden), xs.dtype)
    h0 = x[5] if len(x) > 5 and x[5] is not None else None
    c0 = x[6] if with_cell and len(x) > 6 and x[6] is not None else None
    peep = x[7] if with_cell and len(x) > 7 and x[7] is not None else None
    if layout:
        h0 = np.swapaxes(h0, 0, 1) if h0 is not None else None
        c0 = np.swapaxes(c0, 0, 1) if c0 is not None else None
    seq, batch = xs.shape[:2]
    ys, hs, cs = [], [], []
    for d, backwards in enumerate(_directions(n)):
        h = h0[d] if h0 is not None else np.zeros((batch, hidden), xs.dtype)
        c = c0[d] if c0 is not None else np.zeros((batch, hidden), xs.dtype)
        wb, rb = bias[d, : gates * hidden], bias[d, gates * hidden :]
        xw = num.r(xs @ w[d].T + wb)  # all time steps' input projections at once, FP32 accumulation
        p = peep[d] if peep is not None else None
        out = [np.empty(0)] * seq
        for t in range(seq - 1, -1, -1) if backwards else range(seq):
            h, c = step(num, xw[t], h, c, r[d], rb, p, hidden)
            out[t] = h
        ys.append(np.stack(out))
        hs.append(h)
        cs.append(c)
    y = np.stack(ys, axis=1)  # (seq, dirs, batch, hidden)
    states = [np.stack(hs), np.stack(cs)] if with_cell else [np.stack(hs)]
    if layout:
        y, states = np.transpose(y, (2, 0, 1, 3)), [np.swapaxes(s, 0, 1) for s in states]
    return [y, *states]


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
