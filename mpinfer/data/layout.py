"""How the arrays of a data file map to a model's inputs: which axis holds samples, and how batches are cut.

The rule (the README's Data section):

* **One batch**: when every array has exactly its input's shape (no symbolic dims to fill, every fixed dim
  equal), the file is one batch, every input fed as it is (``Add`` with ``x [3,4,5]`` and ``y [5]``).
* **Samples**: otherwise an input holds samples on its sample axis: the first axis when its first dim is
  symbolic; for another input, the first dim named like those (a recurrent state ``[2, batch, 128]``: axis 1);
  for a model whose inputs have no symbolic first dim (a fixed batch), the first axis.
* **Fed whole**: an input without a sample axis (a scalar, a fixed table), and, in a model with a fixed batch, an
  input saved at exactly its static shape beside inputs that hold more samples (a detector's ``[2]`` image-size
  input next to ``[N, 3, 640, 640]`` images), is fed whole with every batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.specs import TensorSpec, batch_symbols, unnamed_dim


def sample_axes(
    specs: Sequence[TensorSpec], arrays: Mapping[str, np.ndarray] | None = None
) -> dict[str, int | None]:
    """The axis of each input that holds samples in data files, or None for an input fed whole with every batch.

    Inputs whose first dim is symbolic hold samples on it, and their names are the batch dims; another input
    holds samples on the first dim with one of those names (a recurrent state ``[2, batch, 128]`` on axis 1)
    or, having none, is fed whole (a scalar sample rate, a fixed table). When no input has a symbolic first
    dim, every input with a first dim holds samples there (a model with a fixed batch size).

    With the data's ``arrays``, a state whose dims have no names (``[2, ?, 128]`` beside ``input [?, ?]``)
    holds samples on its one unnamed dim whose size is the others' sample count (several samples, and no
    other unnamed dim of that size); otherwise it is fed whole. In a model with no symbolic first dim, an
    array of exactly its input's static shape is fed whole (all of them: the file is one batch).
    """
    batch_names = batch_symbols(specs)
    out = _declared_axes(specs, batch_names)
    if arrays is None:
        return out
    if not batch_names:  # (every array exactly its input's static shape: all fed whole, the file is one batch)
        for s in specs:
            if s.name in arrays and s.matches(np.shape(arrays[s.name])):
                out[s.name] = None
        return out
    return _unnamed_state_axes(specs, arrays, out)


def _declared_axes(specs: Sequence[TensorSpec], batch_names: set[str]) -> dict[str, int | None]:
    """Each input's sample axis from the model alone: a symbolic first dim, else the first batch-named dim."""
    out: dict[str, int | None] = {}
    for s in specs:
        if not s.shape:
            out[s.name] = None
        elif not batch_names or isinstance(s.shape[0], str):
            out[s.name] = 0
        else:
            out[s.name] = next((i for i, d in enumerate(s.shape) if d in batch_names), None)
    return out


def _unnamed_state_axes(
    specs: Sequence[TensorSpec], arrays: Mapping[str, np.ndarray], out: dict[str, int | None]
) -> dict[str, int | None]:
    """``out`` with each input that has no sample axis yet given its one unnamed dim of the data's sample count."""
    counts = {np.shape(arrays[n])[a] for n, a in out.items() if a is not None and n in arrays}
    n = counts.pop() if len(counts) == 1 else 0
    for s in specs:
        if out[s.name] is not None or not s.shape or s.name not in arrays or n < 2:
            continue
        shape = np.shape(arrays[s.name])
        axes = [i for i, d in enumerate(s.shape) if d == unnamed_dim(s.name, i) and i < len(shape) and shape[i] == n]
        if len(axes) == 1 and len(shape) == len(s.shape):
            out[s.name] = axes[0]
    return out


def take_samples(value: np.ndarray, axis: int | None, start: int, stop: int) -> np.ndarray:
    """Samples ``start:stop`` of ``value`` along its sample ``axis`` (contiguous); the whole value when None."""
    if axis is None:
        return value
    return np.ascontiguousarray(value[(slice(None),) * axis + (slice(start, stop),)])


def fixed_batch(specs: Sequence[TensorSpec]) -> int | None:
    """The model's fixed batch size: the first dim of its inputs when none of them is symbolic."""
    if batch_symbols(specs):
        return None
    return next((s.shape[0] for s in specs if s.shape and isinstance(s.shape[0], int)), None)


@dataclass(frozen=True)
class FileLayout:
    """How one data file's arrays are cut into batches.

    Attributes:
        axes: Input name -> sample axis, None for an input fed whole.
        samples: Samples in the file (a file that is one batch: the model's fixed batch, or 1).
        step: Samples per batch the model takes (a fixed batch), or None for any number.
    """

    axes: dict[str, int | None]
    samples: int
    step: int | None

    def batches(self, batch_size: int) -> int:
        """Batches the file gives at ``batch_size`` (a fixed batch drops a short tail)."""
        if all(a is None for a in self.axes.values()):
            return 1
        if self.step:
            return self.samples // self.step
        return -(-self.samples // batch_size)


def layout_hint(specs: Sequence[TensorSpec]) -> str:
    """How to lay the data out for these inputs, for an error's hint."""
    axes = sample_axes(specs)
    parts = []
    for s in specs:
        axis = axes[s.name]
        shape = "x".join(str(d) for d in s.shape) or "scalar"
        parts.append(f"{s.name} [{shape}]: " + ("fed whole" if axis is None else f"samples on axis {axis}"))
    static = all(not s.symbols for s in specs)
    one_batch = "one batch, every array exactly its input's shape; or " if static else ""
    return (
        f"save {one_batch}samples on each input's sample axis ({'; '.join(parts)}), with an input that is the "
        "same for every sample saved at exactly its shape (fed whole with every batch); see the README's Data "
        "section"
    )


def file_layout(arrays: Mapping[str, np.ndarray], specs: Sequence[TensorSpec], origin: str) -> FileLayout:
    """Check a file's arrays against the inputs (names, dtypes, shapes, values) and lay them out in samples.

    Raises:
        InvalidInputError: Naming the input and how the data should be laid out.
    """
    _check_names(arrays, specs, origin)
    axes = sample_axes(specs, arrays)
    for spec in specs:
        _check_array(np.asarray(arrays[spec.name]), spec, axes[spec.name], origin, specs)
    held = {s.name: int(np.shape(arrays[s.name])[a]) for s in specs if (a := axes[s.name]) is not None}
    if len(set(held.values())) > 1:
        per = ", ".join(f"{n}: {c} on axis {axes[n]}" for n, c in held.items())
        raise InvalidInputError(
            format_message(f"Data '{origin}'", f"sample counts {sorted(set(held.values()))} ({per})",
                           "the same number of samples for every input", layout_hint(specs))
        )
    steps = {d for s in specs if (a := axes[s.name]) is not None and isinstance(d := s.shape[a], int)}
    if len(steps) > 1:
        raise InvalidInputError(
            format_message(f"Data '{origin}'", f"samples for inputs whose fixed batch dims differ {sorted(steps)}",
                           "one batch size", layout_hint(specs))
        )
    step = steps.pop() if steps else None
    samples = next(iter(held.values())) if held else (fixed_batch(specs) or 1)
    return FileLayout(axes, samples, step)


def _check_names(arrays: Mapping[str, np.ndarray], specs: Sequence[TensorSpec], origin: str) -> None:
    names = [s.name for s in specs]
    present = [k for k in arrays if not k.startswith("_")]
    missing = [n for n in names if n not in arrays]
    extra = [k for k in present if k not in names]
    if missing or extra:
        raise InvalidInputError(
            format_message(
                f"Data '{origin}'", f"arrays {sorted(present)}", f"one array per model input {names}",
                ("missing: " + ", ".join(missing) + "; " if missing else "")
                + ("not model inputs: " + ", ".join(extra) + "; " if extra else "")
                + "name side data with a leading '_' (e.g. _labels)",
            )
        )


def widens_exactly(have: np.dtype, want: np.dtype) -> bool:
    """True when float data of dtype ``have`` converts to ``want`` without changing a value (FP16 → float32).

    Such data is taken and cast as it is fed: a model that declares FP16 inputs and is brought back to FP32
    (``convert --force``) still takes the FP16 arrays saved for it, and FP16 data feeds an FP32 model exactly.
    """
    return have != want and have.kind == want.kind == "f" and np.can_cast(have, want, "safe")


def _check_array(arr: np.ndarray, spec: TensorSpec, axis: int | None, origin: str,
                 specs: Sequence[TensorSpec]) -> None:
    what = f"Data '{origin}': input '{spec.name}'"
    if arr.dtype != spec.dtype and not widens_exactly(arr.dtype, np.dtype(spec.dtype)):
        raise InvalidInputError(format_message(what, f"dtype {arr.dtype}", f"{spec.dtype}",
                                               f"save it as {spec.dtype} (e.g. arr.astype(np.{spec.dtype}))"))
    # the sample axis may hold any count (batches are cut to the batch size); every other fixed dim must match
    want = list(arr.shape)
    if axis is not None and len(arr.shape) == len(spec.shape):
        want[axis] = spec.concrete_shape()[axis]
    if len(arr.shape) != len(spec.shape) or not spec.matches(want):
        layout = ("fed whole with every batch" if axis is None
                  else f"with samples on axis {axis}" if axis else "with samples on the first axis")
        raise InvalidInputError(format_message(what, f"shape {tuple(arr.shape)}", f"{tuple(spec.shape)} {layout}",
                                               "str dims are dynamic; fixed dims must match. "
                                               + layout_hint(specs)))
    if axis is not None and arr.shape[axis] == 0:
        raise InvalidInputError(format_message(what, f"an empty array (no samples on axis {axis})",
                                               "at least one sample"))
    if arr.dtype.kind == "f" and np.isnan(arr).any():
        bad = int(np.count_nonzero(np.isnan(arr)))
        raise InvalidInputError(format_message(what, f"{bad} NaN values",
                                               "numbers (±Inf is taken: masks use it; NaN is not)",
                                               "clean the data; NaN would poison every statistic"))


def _as_declared(value: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """``value`` in its input's dtype: float data of a narrower float type (checked by :func:`_check_array`) cast."""
    return value if value.dtype == spec.dtype else value.astype(spec.dtype)


def split_batches(arrays: Mapping[str, np.ndarray], specs: Sequence[TensorSpec], layout: FileLayout,
                  batch_size: int, limit: int | None) -> Iterator[dict[str, np.ndarray]]:
    """The file's batches: ``batch_size`` samples each (the model's fixed batch, when it has one)."""
    if all(a is None for a in layout.axes.values()):
        if limit is None or limit > 0:
            yield {s.name: _as_declared(np.asarray(arrays[s.name]), s) for s in specs}
        return
    step = layout.step or batch_size
    for count, start in enumerate(range(0, layout.samples, step)):
        if limit is not None and count >= limit:
            return
        if layout.step and start + step > layout.samples:
            return  # a model with a fixed batch dim cannot take a short last batch
        yield {s.name: _as_declared(take_samples(arrays[s.name], layout.axes[s.name], start, start + step), s)
               for s in specs}
