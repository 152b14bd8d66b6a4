"""Precisions and tensor specs shared by every stage.

A tensor spec is written ``name:dims:dtype[:low..high]`` on the command line, e.g.
``x:batchx3x64x64:float32`` or ``input_ids:batchxseq:int64:0..1000``. A dim is an integer or a symbol
(``batch``, ``seq``); a symbol may carry an example size, ``batch=4``. Integer inputs (token ids,
indices) carry their value range so that random data stays valid.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.inputhints import index_ranges, pinned_dims

# Example size used for a symbolic dim when neither the spec nor the caller gives one.
DEFAULT_DIM_SIZE = 2
# Default value range for integer inputs without one: small, so any embedding table of >= 16 rows is valid.
DEFAULT_INT_RANGE = (0, 16)
# Default value range for float inputs: standard-normal-ish data, a common post-normalisation range.
DEFAULT_FLOAT_RANGE = (-1.0, 1.0)

_DTYPES = {
    "float32": np.float32,
    "float": np.float32,
    "fp32": np.float32,
    "float16": np.float16,
    "half": np.float16,
    "fp16": np.float16,
    "float64": np.float64,
    "double": np.float64,
    "int64": np.int64,
    "long": np.int64,
    "int32": np.int32,
    "int": np.int32,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}


E = TypeVar("E", bound=enum.Enum)


def parse_enum(cls: type[E], value: str | E, what: str, aliases: Mapping[str, str] | None = None) -> E:
    """Return the member of the str-valued enum ``cls`` named by ``value`` (case-insensitive, with aliases).

    Raises:
        InvalidInputError: For an unknown name, listing the valid ones.
    """
    if isinstance(value, cls):
        return value
    key = str(value).strip().lower()
    key = (aliases or {}).get(key, key)
    try:
        return cls(key)
    except ValueError as err:
        choices = ", ".join(str(m.value) for m in cls)
        raise InvalidInputError(format_message(what, repr(value), f"one of {choices}")) from err


class Precision(str, enum.Enum):
    """Numeric precision of a node, a tensor or a whole model."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @classmethod
    def parse(cls, value: str | Precision) -> Precision:
        """Return the Precision for ``value`` ('fp16', 'float16', 'bf16', ...).

        Raises:
            InvalidInputError: For an unknown precision name.
        """
        aliases = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
        return parse_enum(cls, value, "Precision", aliases)

    @property
    def onnx_dtype(self) -> int:
        """The ``onnx.TensorProto`` element type."""
        from onnx import TensorProto

        return {
            Precision.FP32: TensorProto.FLOAT,
            Precision.FP16: TensorProto.FLOAT16,
            Precision.BF16: TensorProto.BFLOAT16,
        }[self]

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype (bf16 through ml_dtypes)."""
        if self is Precision.BF16:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(np.float32 if self is Precision.FP32 else np.float16)

    @property
    def is_low(self) -> bool:
        """True for the reduced precisions (fp16, bf16)."""
        return self is not Precision.FP32


Dim = int | str


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape (ints or symbols), dtype and value range of one model input.

    Attributes:
        name: Input name.
        shape: Dims; a str is a symbolic (dynamic) dim.
        dtype: Numpy dtype.
        value_range: ``(low, high)`` for generated data; integers draw from ``[low, high)``.
        dim_sizes: Example size for symbolic dims named in the spec (``batch=4``).
        graph_sizes: Sizes the graph fixes for symbolic dims (a recurrent state of fixed size fixes the batch):
            random data takes them over its default batch size.
    """

    name: str
    shape: tuple[Dim, ...]
    dtype: np.dtype
    value_range: tuple[float, float] | None = None
    dim_sizes: Mapping[str, int] = field(default_factory=dict)
    graph_sizes: Mapping[str, int] = field(default_factory=dict)

    @property
    def is_integer(self) -> bool:
        """True for integer (and bool) inputs: token ids, indices, masks."""
        return self.dtype.kind in "iub"

    @property
    def symbols(self) -> tuple[str, ...]:
        """The symbolic dims in order of appearance."""
        return tuple(d for d in self.shape if isinstance(d, str))

    def resolved_range(self) -> tuple[float, float]:
        """The value range, or the default one for the dtype."""
        if self.value_range is not None:
            return self.value_range
        if self.dtype.kind == "b":
            return (0, 2)
        return DEFAULT_INT_RANGE if self.is_integer else DEFAULT_FLOAT_RANGE

    def concrete_shape(self, dims: Mapping[str, int] | None = None) -> tuple[int, ...]:
        """Shape with symbols replaced by ``dims``, then the spec's example sizes, then the default."""
        dims = dims or {}
        out = []
        for d in self.shape:
            if isinstance(d, int):
                out.append(d)
            else:
                out.append(int(dims.get(d, self.dim_sizes.get(d, DEFAULT_DIM_SIZE))))
        return tuple(out)

    def matches(self, shape: Sequence[int]) -> bool:
        """True when ``shape`` has the spec's rank and equals every fixed dim."""
        if len(shape) != len(self.shape):
            return False
        return all(isinstance(d, str) or d == s for d, s in zip(self.shape, shape))

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.shape) if self.shape else "scalar"
        text = f"{self.name}:{dims}:{np.dtype(self.dtype).name}"
        if self.value_range is not None:
            lo, hi = self.value_range
            text += f":{_fmt_num(lo)}..{_fmt_num(hi)}"
        return text


def _fmt_num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


_SPEC_HINT = "write name:dims:dtype[:low..high], e.g. x:batchx3x64x64:float32 or ids:batchxseq:int64:0..1000"
_DIM_RE = re.compile(r"^(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)(?:=(\d+))?)$")


def parse_dtype(text: str) -> np.dtype:
    """Parse a dtype name ('float32', 'int64', ...).

    Raises:
        InvalidInputError: For an unknown name.
    """
    key = text.strip().lower()
    if key not in _DTYPES:
        raise InvalidInputError(
            format_message("Dtype", repr(text), "one of " + ", ".join(sorted(set(_DTYPES))))
        )
    return np.dtype(_DTYPES[key])


def parse_tensor_spec(text: str) -> TensorSpec:
    """Parse ``name:dims:dtype[:low..high]`` into a TensorSpec.

    Args:
        text: The spec, e.g. ``x:batchx3x64x64:float32``.

    Returns:
        The parsed spec.

    Raises:
        InvalidInputError: If the spec is malformed.
    """
    parts = text.strip().split(":")
    if len(parts) not in (3, 4) or not parts[0]:
        raise InvalidInputError(format_message(f"Input spec '{text}'", f"{len(parts)} ':'-separated fields",
                                               "3 or 4", _SPEC_HINT))
    name, dims_text, dtype_text = parts[0], parts[1], parts[2]
    shape: list[Dim] = []
    sizes: dict[str, int] = {}
    if dims_text not in ("", "scalar"):
        for tok in dims_text.split(",") if "," in dims_text else dims_text.split("x"):
            m = _DIM_RE.match(tok)
            if not m:
                raise InvalidInputError(format_message(f"Input spec '{text}': dim '{tok}'", None,
                                                       "an integer or a symbol such as batch or batch=4",
                                                       _SPEC_HINT))
            if m.group(1) is not None:
                if int(m.group(1)) <= 0:
                    raise InvalidInputError(format_message(f"Input spec '{text}': dim '{tok}'", None,
                                                           "a positive size", _SPEC_HINT))
                shape.append(int(m.group(1)))
            else:
                shape.append(m.group(2))
                if m.group(3) is not None:
                    sizes[m.group(2)] = int(m.group(3))
    try:
        dtype = parse_dtype(dtype_text)
    except InvalidInputError as err:
        raise InvalidInputError(f"Input spec '{text}': {err} Hint: {_SPEC_HINT}") from err
    value_range = None
    if len(parts) == 4:
        value_range = parse_range(parts[3], what=f"Input spec '{text}': value range")
    return TensorSpec(name=name, shape=tuple(shape), dtype=dtype, value_range=value_range, dim_sizes=sizes)


def parse_range(text: str, *, what: str = "Range") -> tuple[float, float]:
    """Parse ``low..high`` into a (low, high) pair with low < high.

    Raises:
        InvalidInputError: If malformed or empty.
    """
    m = re.match(r"^\s*(-?[\d.eE+-]+)\s*\.\.\s*(-?[\d.eE+-]+)\s*$", text)
    try:
        lo, hi = (float(m.group(1)), float(m.group(2))) if m else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or hi is None or not lo < hi:
        raise InvalidInputError(format_message(what, repr(text), "low..high with low < high, e.g. 0..1000"))
    return (lo, hi)


def is_float_dtype(dtype: Any) -> bool:
    """True for numpy's floats and ml_dtypes' bfloat16 (whose numpy kind is ``V``, not ``f``)."""
    dt = np.dtype(dtype)
    return dt.kind == "f" or dt.name == "bfloat16"


def batch_symbols(specs: Sequence[TensorSpec]) -> set[str]:
    """The batch dims: the symbolic dims some input has first.

    Random data, sample axes, parity runs and default TensorRT profiles all size these as the batch.
    """
    return {s.shape[0] for s in specs if s.shape and isinstance(s.shape[0], str)}


def unnamed_dim(input_name: str, axis: int) -> str:
    """The symbol of a dynamic dim the model leaves unnamed: one per input and axis (``x.dim0``).

    Two inputs' unnamed dims at the same position need not be the same size.
    """
    return f"{input_name}.dim{axis}"


def dim_symbol(input_name: str, axis: int, param: str | None) -> str:
    """The symbol of a dynamic dim: its ``dim_param``, or :func:`unnamed_dim` when it has no real name.

    No name: empty, or punctuation only (Paddle's exports call every dynamic dim ``?``: a batch, a height and
    a width would otherwise be one dim, set to one size).
    """
    if param and any(ch.isalnum() or ch == "_" for ch in param):
        return param
    return unnamed_dim(input_name, axis)


def specs_from_onnx(model: object) -> list[TensorSpec]:
    """Return the graph inputs (initializers excluded) of an ``onnx.ModelProto`` as TensorSpecs.

    Symbolic dims keep their names; unnamed dynamic dims (and those named ``?``) become ``<input>.dim<i>``
    (:func:`dim_symbol`; one name each: two inputs' unnamed dims at the same position need not be the same
    size). Value ranges come from the
    model's ``mpinfer.input_ranges`` metadata entry when export wrote one, example sizes of symbolic dims
    (``dim_sizes``) from its ``mpinfer.dim_sizes`` entry. An integer input without a range there that indexes
    something of N entries gets ``[0, N)`` (:func:`mpinfer.inputhints.index_ranges`), and a dim a recurrent
    state fixes gets its size in ``graph_sizes`` (:func:`mpinfer.inputhints.pinned_dims`).
    """
    import onnx

    assert isinstance(model, onnx.ModelProto)
    init_names = {i.name for i in model.graph.initializer}
    meta = {p.key: p.value for p in model.metadata_props}
    ranges = _metadata_entry(meta, "mpinfer.input_ranges")
    sizes = {k: int(v) for k, v in _metadata_entry(meta, "mpinfer.dim_sizes").items() if isinstance(v, int) and v > 0}
    derived: dict[str, Any] = index_ranges(model)
    pinned = pinned_dims(model)
    specs = []
    for vi in model.graph.input:
        if vi.name in init_names:
            continue
        dtype, shape = _dtype_and_shape(vi)
        rng = ranges.get(vi.name) or derived.get(vi.name)
        known = {d: sizes[d] for d in shape if isinstance(d, str) and d in sizes}
        fixed = {d: pinned[(vi.name, i)] for i, d in enumerate(shape) if isinstance(d, str) and (vi.name, i) in pinned}
        specs.append(TensorSpec(vi.name, tuple(shape), dtype, tuple(rng) if rng else None, known, fixed))  # type: ignore[arg-type]
    return specs


def _metadata_entry(meta: Mapping[str, str], key: str) -> dict[str, Any]:
    """A JSON object from the model's metadata (``{}`` when absent, unreadable or not an object)."""
    try:
        value = json.loads(meta.get(key, "{}"))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _dtype_and_shape(vi: Any) -> tuple[np.dtype, list[Dim]]:
    """A graph input's numpy dtype (float32 when unknown) and dims (symbols for dynamic ones)."""
    from onnx import helper

    tt = vi.type.tensor_type
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
    except (KeyError, TypeError, ValueError):
        dtype = np.dtype(np.float32)
    shape: list[Dim] = []
    for i, d in enumerate(tt.shape.dim):
        if d.HasField("dim_value") and d.dim_value >= 0:  # 0: an empty dim, as static as any
            shape.append(int(d.dim_value))
        else:
            shape.append(dim_symbol(vi.name, i, d.dim_param if d.HasField("dim_param") else None))
    return dtype, shape
