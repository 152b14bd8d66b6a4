"""ONNX Runtime as the emulator's vector unit, for steps whose result does not depend on who computes them.

* Casts: rounding float32 to FP16 or BF16 (and back), and FP16 <-> float32 storage. These are exact
  operations (round to nearest, ties to even; overflow to inf; FP16 subnormals), so any correct
  implementation returns the same bits; ONNX Runtime's vectorised Cast does them 10-20x faster than numpy,
  whose float16 conversion is a scalar loop. On first use each cast is checked bit for bit against numpy
  on every FP16 bit pattern, the midpoints between them, BF16 ties and 16K float32 bit patterns spread over
  the whole range (inf, NaN, subnormals included); a cast that differs is never used.
* Conv and ConvTranspose in float32: the emulator's tensor-core model (:mod:`linalg`) rounds the inputs to
  the low dtype, accumulates the products in float32 and rounds the output once. Products of FP16 or BF16
  values are exact in float32, so ONNX Runtime's float32 kernels compute the same model, 3-25x faster than
  numpy im2col. One session per attribute set, shared by the nodes that have it; at every size
  (:data:`KERNEL_MIN_SIZE`), so the cast graph (:mod:`castgraph`), which runs every convolution in ONNX Runtime,
  gives the emulator's bits on small ones too.
* Erf in float32 (:func:`numerics.erf`: a function evaluated accurately, then rounded by the node).

Every helper returns None when ONNX Runtime cannot do the step (not installed, an attribute combination it
refuses, an input that is not a float32 array, a cast that failed its check, an array too small to be
worth a call); the caller then computes it with numpy.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mpinfer.memory import usable_cpus
from mpinfer.modelio import ort_log_level

logger = logging.getLogger(__name__)

# Arrays with fewer values go through numpy: below this the gain is under ~0.1 ms a call, and a model whose
# tensors are all this small never pays for building and checking the sessions (~25 ms once).
MIN_SIZE = 1 << 14
# ... except the ops whose float32 kernels define the emulator's numerics (:func:`kernel`: Conv, ConvTranspose,
# MatMul, Gemm, the pools, Tanh, Sigmoid, softmax's steps), run here at every size: the cast graph (castgraph.py)
# computes them in ONNX Runtime whatever their size, and gives the emulator's bits only where the emulator calls
# the same kernel.
KERNEL_MIN_SIZE = 0
# Sessions kept for float32 ops (one per op type, attribute set and input ranks); the oldest is dropped.
# (layout_cdla, 1493 nodes, needs 15.)
MAX_OP_SESSIONS = 64
# Threads of each session's pool: every session has its own, so a many-core machine must not multiply its
# cores by the number of sessions; the emulator runs one step at a time.
MAX_THREADS = 4
_OPSET = 17
_IR_VERSION = 8

# name -> (input element type, then the Cast targets in order); ONNX TensorProto element types.
_FLOAT, _FLOAT16, _BFLOAT16 = 1, 10, 16
CASTS: dict[str, tuple[int, tuple[int, ...]]] = {
    "round_fp16": (_FLOAT, (_FLOAT16, _FLOAT)),
    "round_bf16": (_FLOAT, (_BFLOAT16, _FLOAT)),
    "to_fp16": (_FLOAT, (_FLOAT16,)),
    "from_fp16": (_FLOAT16, (_FLOAT,)),
}
_INPUT_DTYPE = {_FLOAT: np.dtype(np.float32), _FLOAT16: np.dtype(np.float16)}

_lock = threading.Lock()
_casts: dict[str, Any] = {}  # cast name -> session, or None when unavailable
_ops: dict[tuple[Any, ...], Any] = {}  # op key -> session, or None when ONNX Runtime refused it


def _session(model: Any) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = ort_log_level()
    so.intra_op_num_threads = min(MAX_THREADS, usable_cpus())
    # Many small sessions live side by side: their threads must not spin between calls.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.enable_cpu_mem_arena = False  # many sessions: none keeps an arena sized for its largest output
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any]) -> Any:
    from onnx import helper

    graph = helper.make_graph(nodes, "mpinfer_emulator_step", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)])
    model.ir_version = _IR_VERSION
    return model


def _build_cast(name: str) -> Any:
    from onnx import helper

    src, targets = CASTS[name]
    nodes, prev = [], "x"
    for i, to in enumerate(targets):
        out = "y" if i == len(targets) - 1 else f"t{i}"
        nodes.append(helper.make_node("Cast", [prev], [out], to=to))
        prev = out
    io = [helper.make_tensor_value_info("x", src, None)], [helper.make_tensor_value_info("y", targets[-1], None)]
    return _session(_model(nodes, *io))


@functools.lru_cache(maxsize=1)
def _check_values() -> np.ndarray:
    """float32 values that exercise every rounding case: all FP16 patterns, their midpoints, random bits."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    finite = np.sort(every[np.isfinite(every)])
    mid = (finite[:-1].astype(np.float64) + finite[1:]) / 2  # exact ties of FP16 rounding
    # 16K float32 bit patterns spread over the whole range (a multiplicative hash; numpy.random not needed)
    hashed = np.arange(1, 1 + (1 << 14), dtype=np.uint64) * np.uint64(2654435761)
    bits = (hashed & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    bf16_ties = (bits & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exact ties of BF16 rounding
    extra = np.array([65504.0, 65519.0, 65520.0, 65536.0, 1e38, 2.0**-24, 2.0**-25, 2.0**-26, 2.0**-149], np.float32)
    randoms = [bits.view(np.float32), bf16_ties.view(np.float32)]
    return np.concatenate([every, mid.astype(np.float32), *randoms, extra, -extra])


def _reference_cast(name: str, x: np.ndarray) -> np.ndarray:
    if name == "round_fp16":
        return x.astype(np.float16).astype(np.float32)
    if name == "round_bf16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    if name == "to_fp16":
        return x.astype(np.float16)
    return x.astype(np.float32)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, except that any NaN matches any NaN (payloads are not specified)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        return False
    width = np.uint16 if a.dtype.itemsize == 2 else np.uint32
    return bool(np.array_equal(a.view(width)[~nan_a], b.view(width)[~nan_b]))


def cast_matches_numpy(name: str, run: Callable[[np.ndarray], np.ndarray]) -> bool:
    """True when ``run`` (an ONNX Runtime cast ``name`` of :data:`CASTS`) gives numpy's bits on every check value.

    The check values: every FP16 pattern, the ties between them, BF16 ties, 16K float32 bit patterns over the
    whole range (inf, NaN, subnormals). Any NaN matches any NaN.
    """
    values = _check_values()
    with np.errstate(over="ignore", invalid="ignore"):  # the check values overflow FP16 on purpose
        if CASTS[name][0] == _FLOAT16:
            values = values.astype(np.float16)
        got = run(values)
        want = _reference_cast(name, values)
    return _same_bits(got, want)


def _open_cast(name: str) -> Any:
    try:
        sess = _build_cast(name)
        if not cast_matches_numpy(name, lambda v: sess.run(None, {"x": v})[0]):
            logger.debug("ONNX Runtime's %s differs from numpy's: numpy does it", name)
            return None
        return sess
    except Exception as err:  # no onnxruntime / ml_dtypes, or a build without the cast
        logger.debug("ONNX Runtime cannot do %s (%s): numpy does it", name, err)
        return None


def cast(x: np.ndarray, name: str) -> np.ndarray | None:
    """``x`` through the cast ``name`` (see :data:`CASTS`) in ONNX Runtime, or None (numpy's turn)."""
    src = _INPUT_DTYPE[CASTS[name][0]]
    if not isinstance(x, np.ndarray) or x.dtype != src or x.size < MIN_SIZE:
        return None
    sess = _casts.get(name, False)
    if sess is False:
        with _lock:
            sess = _casts.get(name, False)
            if sess is False:
                sess = _casts[name] = _open_cast(name)
    if sess is None:
        return None
    return sess.run(None, {"x": np.ascontiguousarray(x)})[0].reshape(x.shape)  # 0-d comes back as (1,)


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    return value


def _build_op(op_type: str, attrs: Mapping[str, Any], ranks: Sequence[int]) -> Any:
    from onnx import helper

    names = [f"x{i}" for i in range(len(ranks))]
    node = helper.make_node(op_type, names, ["y"], **dict(attrs))
    inputs = [helper.make_tensor_value_info(n, _FLOAT, [None] * r) for n, r in zip(names, ranks, strict=True)]
    return _session(_model([node], inputs, [helper.make_tensor_value_info("y", _FLOAT, None)]))


def kernel(op_type: str, attrs: Mapping[str, Any], inputs: Sequence[Any]) -> np.ndarray | None:
    """:func:`float32_op` at every size (:data:`KERNEL_MIN_SIZE`), the missing optional inputs left out.

    For the ops whose ONNX Runtime float32 kernel is the emulator's definition of them; None where numpy must do it.
    """
    return float32_op(op_type, attrs, [v for v in inputs if v is not None], min_size=KERNEL_MIN_SIZE)


def first(
    op_type: str, *, attrs: bool = True
) -> Callable[[Callable[..., list[np.ndarray]]], Callable[..., list[np.ndarray]]]:
    """Decorate an emulator kernel ``(node, numerics, inputs)`` to try ONNX Runtime's ``op_type`` first.

    :func:`kernel`, with the node's attributes unless ``attrs`` is False, where it runs the node; the decorated
    numpy kernel where not.
    """

    def wrap(numpy_kernel: Callable[..., list[np.ndarray]]) -> Callable[..., list[np.ndarray]]:
        @functools.wraps(numpy_kernel)
        def k(n: Any, num: Any, x: list[Any]) -> list[np.ndarray]:
            fast = kernel(op_type, n.attrs if attrs else {}, x)
            return [fast] if fast is not None else numpy_kernel(n, num, x)

        return k

    return wrap


def float32_op(
    op_type: str, attrs: Mapping[str, Any], inputs: Sequence[Any], *, min_size: int | None = None
) -> np.ndarray | None:
    """The single output of ai.onnx ``op_type`` on float32 ``inputs``, computed by ONNX Runtime, or None.

    Only for ops whose float32 kernels are the emulator's model of them (Conv, ConvTranspose: float32
    accumulation; Erf: an accurate float32 value). None when an input is missing or not float32, its first
    input has fewer than ``min_size`` values (default :data:`MIN_SIZE`), or ONNX Runtime refuses the node.
    """
    if not inputs or any(not isinstance(v, np.ndarray) or v.dtype != np.float32 for v in inputs):
        return None
    if inputs[0].size < (MIN_SIZE if min_size is None else min_size):
        return None
    key = (op_type, tuple(sorted((k, _hashable(v)) for k, v in attrs.items())), tuple(v.ndim for v in inputs))
    sess = _ops.get(key, False)
    if sess is False:
        with _lock:
            sess = _ops.get(key, False)
            if sess is False:
                try:
                    sess = _build_op(op_type, attrs, [v.ndim for v in inputs])
                except Exception as err:  # onnxruntime raises its own types
                    logger.debug("ONNX Runtime refuses %s %s (%s): numpy does it", op_type, dict(attrs), err)
                    sess = None
                if len(_ops) >= MAX_OP_SESSIONS:
                    _ops.pop(next(iter(_ops)))
                _ops[key] = sess
    if sess is None:
        return None
    try:
        return sess.run(None, {f"x{i}": np.ascontiguousarray(v) for i, v in enumerate(inputs)})[0]
    except Exception as err:  # shapes ONNX Runtime rejects at run time: numpy decides (and reports)
        logger.debug("ONNX Runtime failed on %s (%s): numpy does it", op_type, err)
        return None
