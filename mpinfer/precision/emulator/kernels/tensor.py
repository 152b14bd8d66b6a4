"""Shape, data-movement and indexing kernels (no arithmetic, so precision only affects their dtype)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mpinfer.precision.emulator.kernels.numerics import NodeInfo, Numerics, RejectedInput, UnsupportedVariant


def _ints(v: Any) -> list[int]:
    return [int(i) for i in np.asarray(v).ravel()]


def _opt(x: list[Any], i: int) -> Any:
    return x[i] if len(x) > i and x[i] is not None else None


def np_dtype(onnx_type: int) -> np.dtype:
    """Numpy dtype of an ONNX element type (bfloat16 through ml_dtypes)."""
    from onnx import helper

    return np.dtype(helper.tensor_dtype_to_np_dtype(onnx_type))


def reshape(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Reshape (0 copies the input dim unless allowzero)."""
    v = x[0]
    shape = _ints(x[1]) if n.opset >= 5 else list(n.get("shape"))
    if not n.get("allowzero", 0):
        shape = [v.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return [v.reshape(shape)]


def flatten(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Flatten to 2-D at ``axis``."""
    v = x[0]
    axis = int(n.get("axis", 1))
    axis = axis + v.ndim if axis < 0 else axis
    return [v.reshape(int(np.prod(v.shape[:axis])), -1)]


def transpose(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Transpose (default: reverse the axes)."""
    perm = n.get("perm")
    return [np.ascontiguousarray(np.transpose(x[0], perm))]


def _axes_arg(n: NodeInfo, x: list[Any], opset_input: int = 13) -> list[int] | None:
    if n.opset >= opset_input:
        a = _opt(x, 1)
        return _ints(a) if a is not None else None
    a = n.get("axes")
    return list(a) if a is not None else None


def squeeze(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Squeeze the given axes, or every size-1 axis."""
    v = x[0]
    axes = _axes_arg(n, x)
    if axes is None:
        return [np.squeeze(v)]
    return [np.squeeze(v, axis=tuple(a % v.ndim for a in axes))]


def unsqueeze(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Insert size-1 axes (negative axes count from the output rank)."""
    v = x[0]
    axes = _axes_arg(n, x) or []
    rank = v.ndim + len(axes)
    return [np.expand_dims(v, tuple(sorted(a % rank for a in axes)))]


def concat(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Concat along ``axis`` (empty inputs allowed)."""
    return [np.concatenate([v for v in x if v is not None], axis=int(n.get("axis")))]


def split(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Split by explicit sizes, or into equal parts (ceil for the last with num_outputs)."""
    v = x[0]
    axis = int(n.get("axis", 0)) % v.ndim
    parts = _ints(_opt(x, 1)) if n.opset >= 13 and _opt(x, 1) is not None else n.get("split")
    count = len(n.node.output)
    if not parts:
        length = v.shape[axis]
        size = -(-length // count)
        parts = [min(size, length - i * size) for i in range(count)]
    bounds = np.cumsum(parts)[:-1]
    return list(np.split(v, bounds, axis=axis))


def slice_(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Slice (attribute form before opset 10, input form after; clamped like numpy)."""
    v = x[0]
    if n.opset < 10:
        starts, ends = list(n.get("starts")), list(n.get("ends"))
        axes = list(n.get("axes") or range(len(starts)))
        steps = [1] * len(starts)
    else:
        starts, ends = _ints(x[1]), _ints(x[2])
        axes = _ints(x[3]) if _opt(x, 3) is not None else list(range(len(starts)))
        steps = _ints(x[4]) if _opt(x, 4) is not None else [1] * len(starts)
    slc = [slice(None)] * v.ndim
    for s, e, a, st in zip(starts, ends, axes, steps, strict=False):
        slc[a % v.ndim] = slice(s, e, st)  # numpy clamps out-of-range starts/ends as ONNX does
    return [np.ascontiguousarray(v[tuple(slc)])]


def gather(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Gather along ``axis`` (negative indices wrap, as ONNX allows)."""
    return [np.take(x[0], np.asarray(x[1], dtype=np.int64), axis=int(n.get("axis", 0)))]


def gather_elements(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """GatherElements."""
    v, idx = x
    axis = int(n.get("axis", 0)) % v.ndim
    idx = np.where(idx < 0, idx + v.shape[axis], idx)
    return [np.take_along_axis(v, idx, axis=axis)]


def expand(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Expand (bidirectional broadcast)."""
    v = x[0]
    shape = np.broadcast_shapes(v.shape, tuple(_ints(x[1])))
    return [np.array(np.broadcast_to(v, shape))]


def tile(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Tile."""
    return [np.tile(x[0], _ints(x[1]))]


def pad(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Pad (constant, reflect, edge, wrap; negative pads crop; opset 18 axes)."""
    v = x[0]
    mode = n.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if n.opset < 11:
        pads, value = list(n.get("pads")), n.get("value", 0.0)
        axes = list(range(v.ndim))
    else:
        pads = _ints(x[1])
        cv = _opt(x, 2)
        value = np.asarray(cv).ravel()[0] if cv is not None and np.asarray(cv).size else 0
        axes = [a % v.ndim for a in _ints(x[3])] if _opt(x, 3) is not None else list(range(v.ndim))
    k = len(axes)
    width = [(0, 0)] * v.ndim
    for i, a in enumerate(axes):
        width[a] = (pads[i], pads[i + k])
    pos = [(max(b, 0), max(e, 0)) for b, e in width]
    if mode == "constant":
        out = np.pad(v, pos, mode="constant", constant_values=np.asarray(value, dtype=v.dtype))
    elif mode in ("reflect", "edge", "wrap"):
        if mode == "reflect" and any(max(b, e) >= dim for (b, e), dim in zip(pos, v.shape, strict=True) if b or e):
            raise RejectedInput(f"reflect pads {pos} do not fit in shape {v.shape} (each must be below its dim)")
        out = np.pad(v, pos, mode=mode)  # type: ignore[call-overload, arg-type]
    else:
        raise UnsupportedVariant(f"Pad mode={mode}")
    crop = tuple(slice(-b if b < 0 else None, e if e < 0 else None) for b, e in width)
    return [np.ascontiguousarray(out[crop])]


def shape(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Shape (with start/end)."""
    s = np.asarray(x[0].shape, dtype=np.int64)
    start, end = n.get("start", 0), n.get("end")
    return [s[start:end]]


def size(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Size."""
    return [np.asarray(x[0].size, dtype=np.int64)]


def constant_of_shape(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """ConstantOfShape (default value float32 0)."""
    value = n.get("value")
    value = np.zeros(1, np.float32) if value is None else np.asarray(value).ravel()
    return [np.full(_ints(x[0]), value[0], dtype=value.dtype)]


def constant(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Constant (tensor, float(s) or int(s) forms)."""
    for key, dtype in (
        ("value", None),
        ("value_float", np.float32),
        ("value_floats", np.float32),
        ("value_int", np.int64),
        ("value_ints", np.int64),
    ):
        if key in n.attrs:
            return [np.asarray(n.attrs[key], dtype=dtype)]
    raise UnsupportedVariant("Constant form")


def range_(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Range: start + i * delta for i < ceil((limit - start) / delta)."""
    start, limit, delta = (np.asarray(v).ravel()[0] for v in x)
    count = max(int(np.ceil((limit - start) / delta)), 0)
    return [(start + np.arange(count, dtype=np.asarray(x[0]).dtype) * delta).astype(np.asarray(x[0]).dtype)]


def cast(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Cast to the ``to`` type (float -> int truncates toward zero)."""
    return [_cast_to(x[0], np_dtype(int(n.get("to"))))]


def _cast_to(v: np.ndarray, to: np.dtype) -> np.ndarray:
    # strings, and float8/int4 types (saturation rules), go to onnx.reference
    if (
        to.kind in "OSUV"
        or v.dtype.kind in "OSUV"
        or to.itemsize < 2
        and to.kind == "f"
        or to.name.startswith(("float8", "float4", "int4", "uint4"))
        or v.dtype.name.startswith(("float8", "float4", "int4", "uint4"))
    ):
        raise UnsupportedVariant(f"Cast to {to}")
    return v.astype(to)


def cast_like(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """CastLike (the target dtype of the second input)."""
    return [_cast_to(x[0], x[1].dtype)]


def identity(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Identity, and Dropout in inference (output, then an all-true mask if asked)."""
    out = [x[0]]
    if len(n.node.output) > 1:
        out.append(np.ones(x[0].shape, dtype=bool))
    return out


def topk(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """TopK (ties: the lower index first)."""
    v = x[0]
    k = int(np.asarray(x[1]).ravel()[0]) if n.opset >= 10 else int(n.get("k"))
    axis = int(n.get("axis", -1)) % v.ndim
    key = -v if n.get("largest", 1) else v
    if v.dtype.kind == "u" and n.get("largest", 1):
        key = v.max() - v
    idx = np.argsort(key, axis=axis, kind="stable")
    idx = np.take(idx, np.arange(k), axis=axis)
    return [np.take_along_axis(v, idx, axis=axis), idx.astype(np.int64)]


def _arg(fn: Any) -> Any:
    def k(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
        v = x[0]
        axis = int(n.get("axis", 0)) % v.ndim
        if n.get("select_last_index", 0):
            idx = v.shape[axis] - 1 - fn(np.flip(v, axis), axis=axis)
        else:
            idx = fn(v, axis=axis)
        idx = idx.astype(np.int64)
        return [np.expand_dims(idx, axis) if n.get("keepdims", 1) else idx]

    return k


def scatter_nd(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """ScatterND (reduction none/add/mul/max/min)."""
    data, idx, upd = x
    out = data.copy()
    k = idx.shape[-1]
    flat = idx.reshape(-1, k)
    flat = np.where(flat < 0, flat + np.asarray(data.shape[:k]), flat)
    upd = upd.reshape((flat.shape[0],) + data.shape[k:])
    where = tuple(flat.T)
    red = n.get("reduction", "none")
    red = red.decode() if isinstance(red, bytes) else red
    ops = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}
    if red == "none":
        out[where] = upd
    else:
        ops[red].at(out, where, upd)
    return [out]


def scatter_elements(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """ScatterElements (reduction none/add/mul/max/min)."""
    data, idx, upd = x
    axis = int(n.get("axis", 0)) % data.ndim
    idx = np.where(idx < 0, idx + data.shape[axis], idx)
    out = data.copy()
    grids = list(np.indices(idx.shape, sparse=True))
    grids[axis] = idx
    red = n.get("reduction", "none")
    red = red.decode() if isinstance(red, bytes) else red
    ops = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}
    if red == "none":
        out[tuple(grids)] = upd
    else:
        ops[red].at(out, tuple(grids), upd)
    return [out]


def nonzero(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """NonZero (indices as a 2-D int64 array)."""
    v = x[0]
    if v.ndim == 0:
        return [np.zeros((0, int(bool(v))), np.int64)]
    return [np.asarray(np.nonzero(v), dtype=np.int64).reshape(v.ndim, -1)]


KERNELS = {
    "Reshape": reshape,
    "Flatten": flatten,
    "Transpose": transpose,
    "Squeeze": squeeze,
    "Unsqueeze": unsqueeze,
    "Concat": concat,
    "Split": split,
    "Slice": slice_,
    "Gather": gather,
    "GatherElements": gather_elements,
    "Expand": expand,
    "Tile": tile,
    "Pad": pad,
    "Shape": shape,
    "Size": size,
    "ConstantOfShape": constant_of_shape,
    "Constant": constant,
    "Range": range_,
    "Cast": cast,
    "CastLike": cast_like,
    "Identity": identity,
    "Dropout": identity,
    "TopK": topk,
    "ArgMax": _arg(np.argmax),
    "ArgMin": _arg(np.argmin),
    "ScatterND": scatter_nd,
    "ScatterElements": scatter_elements,
    "Scatter": scatter_elements,  # deprecated alias (opset 9-10) of ScatterElements
    "NonZero": nonzero,
}
