"""ONNX Attention (opset 23+): scaled dot-product attention with every step in the node's precision.

Q and K are each scaled by sqrt(scale) (as the ONNX function body does), the two matrix products
accumulate in FP32 and round once, the optional softcap, the mask addition and the softmax round each
step (unless ``softmax_precision`` asks for FP32). Supported: 3-D and 4-D inputs, boolean or additive
masks (padded to the key length), past key/value caches, causal masking aligned to the cache, grouped
query heads, softcap. The external-cache input (``nonpad_kv_seqlen``), sliding windows and the
``qk_matmul_output`` output fall back to onnx.reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpinfer.precision.emulator.kernels.numerics import NodeInfo, Numerics, UnsupportedVariant
from mpinfer.specs import Precision


def _opt(x: list[Any], i: int) -> Any:
    return x[i] if len(x) > i else None


def _to_4d(t: np.ndarray, heads: Any) -> np.ndarray:
    if t.ndim == 4:
        return t
    if heads is None:
        raise UnsupportedVariant("3-D Attention input without num_heads")
    b, s, hidden = t.shape
    return t.reshape(b, s, int(heads), hidden // int(heads)).transpose(0, 2, 1, 3)


def _bias(n: NodeInfo, mask: Any, q_len: int, kv_len: int, past: int) -> np.ndarray:
    """Additive bias (0 or -inf, or the float mask), causal part aligned bottom-right to the cache."""
    bias = np.zeros((q_len, kv_len), np.float32)
    if mask is not None:
        pad = kv_len - mask.shape[-1]
        if pad > 0:
            fill = False if mask.dtype == np.bool_ else -np.inf
            mask = np.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, pad)], constant_values=fill)
        if mask.dtype == np.bool_:
            mask = np.where(mask, np.float32(0), np.float32(-np.inf))
        bias = bias + mask.astype(np.float32)
    if n.get("is_causal", 0):
        allowed = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + past
        bias = bias + np.where(allowed, np.float32(0), np.float32(-np.inf))
    return bias


def attention(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Attention: Y (and present key/value) from Q, K, V, mask and cache."""
    if _opt(x, 6) is not None or n.get("left_window_size", -1) >= 0 or n.get("right_window_size", -1) >= 0:
        raise UnsupportedVariant("Attention with nonpad_kv_seqlen or a sliding window")
    if len(n.node.output) > 3 and n.node.output[3]:
        raise UnsupportedVariant("Attention qk_matmul_output")
    r = num.r
    q, k, v = x[0], x[1], x[2]
    three_d = q.ndim == 3
    q = _to_4d(q, n.get("q_num_heads"))
    k, v = _to_4d(k, n.get("kv_num_heads")), _to_4d(v, n.get("kv_num_heads"))
    past_k, past_v = _opt(x, 4), _opt(x, 5)
    past = past_k.shape[2] if past_k is not None else 0
    if past_k is not None:
        k, v = np.concatenate([past_k, k], axis=2), np.concatenate([past_v, v], axis=2)
    present_k, present_v = k, v
    scale = n.get("scale")
    root = np.float32(np.sqrt(scale if scale is not None else 1.0 / np.sqrt(q.shape[3])))
    root = r(root)
    if q.shape[1] != k.shape[1]:  # grouped-query attention: each KV head serves several query heads
        k, v = np.repeat(k, q.shape[1] // k.shape[1], axis=1), np.repeat(v, q.shape[1] // k.shape[1], axis=1)
    scores = r(np.matmul(r(q * root), np.swapaxes(r(k * root), 2, 3)))  # FP32 accumulation, rounded
    cap = n.get("softcap")
    if cap:
        scores = r(r(np.tanh(r(scores / np.float32(cap)))) * np.float32(cap))
    bias = _bias(n, _opt(x, 3), q.shape[2], k.shape[2], past)
    scores = r(scores + r(bias))
    soft = num if n.get("softmax_precision") in (None, 0) else Numerics(_softmax_precision(n, num))
    probs = _softmax(scores, soft)
    masked = np.isneginf(np.max(bias, axis=-1, keepdims=True))  # rows with no key to attend: 0
    probs = r(np.where(masked, np.float32(0), probs))
    y = np.matmul(probs, v)
    if three_d:
        y = y.transpose(0, 2, 1, 3).reshape(y.shape[0], y.shape[2], -1)
    return [y, present_k, present_v]


def _softmax_precision(n: NodeInfo, num: Numerics) -> Precision:
    from onnx import TensorProto

    table: dict[int, Precision] = {
        int(TensorProto.FLOAT): Precision.FP32,
        int(TensorProto.FLOAT16): Precision.FP16,
        int(TensorProto.BFLOAT16): Precision.BF16,
    }
    return table.get(int(n.get("softmax_precision")), num.precision)


def _softmax(s: np.ndarray, num: Numerics) -> np.ndarray:
    r = num.r
    top = np.max(s, axis=-1, keepdims=True)
    top = np.where(np.isneginf(top), np.float32(0), top)
    e = r(np.exp(r(s - top)))
    total = r(np.sum(e, axis=-1, keepdims=True))
    return r(e / np.where(total == 0, np.float32(1), total))


KERNELS = {"Attention": attention}
