"""Data feeds: one iterator of ``{input name: array}`` batches for every stage.

Sources (:func:`load_feeds`):

* ``None`` / ``"random"`` / ``"random:N"``: seeded random batches that respect each spec (dtype, value
  range, dynamic dims);
* a ``.npz`` file, or a folder of them: arrays keyed by input name, first axis = samples; keys starting
  with ``_`` (e.g. ``_labels``) are side data, not inputs;
* a folder of ``<input>.npy`` files;
* a folder of images (PNG/JPEG/BMP) with a :class:`ImagePreprocess` spec.

Batches are produced lazily: one batch of one file is in memory at a time, beside the arrays of a source whose files
are small enough to keep (the memory budget's ``data_files`` slice: read once, not once per pass). Every batch is
the caller's own (writable, shared with no later pass).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from mpinfer.data import decode
from mpinfer.data.layout import FileLayout, file_layout, fixed_batch, sample_axes, split_batches, take_samples
from mpinfer.data.source import FeedSource, read_npz
from mpinfer.errors import InvalidInputError, format_message
from mpinfer.memory import current_budget
from mpinfer.specs import DEFAULT_DIM_SIZE, TensorSpec, batch_symbols, parse_range

logger = logging.getLogger(__name__)

# Samples per batch when neither the caller nor a fixed batch dim says otherwise: large enough for stable
# statistics, small enough that intermediate tensors of a ResNet-sized model stay in a few hundred MB.
DEFAULT_BATCH_SIZE = 16
# Random batches generated when no data is given.
DEFAULT_RANDOM_BATCHES = 8
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")


@dataclass(frozen=True)
class ImagePreprocess:
    """How to turn an image file into a model input.

    Written as ``size=64x64,mean=0.485/0.456/0.406,std=0.229/0.224/0.225,scale=255,layout=nchw,mode=RGB``.
    Pixel values are divided by ``scale``, then normalised with ``mean``/``std`` per channel. Without a
    ``mode``, a model input with one channel reads images as grayscale (``L``), any other as ``RGB``.
    """

    size: tuple[int, int] | None = None
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    scale: float = 255.0
    layout: str = "nchw"
    mode: str | None = None

    @classmethod
    def parse(cls, text: str | None) -> ImagePreprocess:
        """Parse the comma-separated ``key=value`` form.

        Raises:
            InvalidInputError: For unknown keys or malformed values.
        """
        if not text:
            return cls()
        kw: dict[str, object] = {}
        try:
            for item in text.split(","):
                key, _, value = item.partition("=")
                key = key.strip()
                if key == "size":
                    h, w = value.lower().split("x")
                    kw["size"] = (int(h), int(w))
                elif key in ("mean", "std"):
                    kw[key] = tuple(float(v) for v in value.split("/"))
                elif key == "scale":
                    kw["scale"] = float(value)
                elif key == "layout" and value.lower() in ("nchw", "nhwc"):
                    kw["layout"] = value.lower()
                elif key == "mode" and value.upper() in ("RGB", "L", "BGR"):
                    kw["mode"] = value.upper()
                else:
                    raise ValueError(key)
        except ValueError as err:
            raise InvalidInputError(
                format_message("Image preprocessing spec", repr(text),
                               "size=HxW,mean=a/b/c,std=a/b/c,scale=255,layout=nchw|nhwc,mode=RGB|L|BGR")
            ) from err
        return cls(**kw)  # type: ignore[arg-type]


def random_batch(specs: Sequence[TensorSpec], rng: np.random.Generator,
                 dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """One batch of random data that respects each spec's dtype, range and dims."""
    out = {}
    for spec in specs:
        shape = spec.concrete_shape(dims)
        lo, hi = spec.resolved_range()
        if spec.dtype.kind == "b":
            arr = rng.integers(0, 2, size=shape).astype(np.bool_)
        elif spec.is_integer:
            arr = rng.integers(int(lo), max(int(hi), int(lo) + 1), size=shape).astype(spec.dtype)
        else:
            arr = rng.uniform(lo, hi, size=shape).astype(spec.dtype)
        out[spec.name] = arr
    return out


def _batch_dims(specs: Sequence[TensorSpec], batch_size: int) -> dict[str, int]:
    """Map the batch dims (:func:`mpinfer.specs.batch_symbols`) to ``batch_size``."""
    return dict.fromkeys(batch_symbols(specs), batch_size)


def _guessed_dims(specs: Sequence[TensorSpec], dims: Mapping[str, int]) -> list[str]:
    """Symbolic dims that random data sizes by the bare default (no --dim, batch or spec size): "'h' (input 'x')"."""
    out: list[str] = []
    for s in specs:
        for d in s.shape:
            if isinstance(d, str) and d not in dims and d not in s.dim_sizes:
                label = f"'{d}' (input '{s.name}')"
                if not any(o.startswith(f"'{d}' ") for o in out):
                    out.append(label)
    return out


def _check_dim_names(specs: Sequence[TensorSpec], dims: Mapping[str, int]) -> None:
    """Every ``--dim`` name is a symbolic dim of some input (a typo would otherwise be ignored in silence)."""
    known = list(dict.fromkeys(d for s in specs for d in s.shape if isinstance(d, str)))
    unknown = [name for name in dims if name not in known]
    if unknown:
        hint = "'?' is not a name: each dim the model calls '?' is named <input>.dim<axis>" if "?" in unknown else ""
        raise InvalidInputError(
            format_message(
                "--dim",
                ", ".join(repr(n) for n in unknown) + (" (no such symbolic dim)"),
                "one of " + ", ".join(repr(n) for n in known) if known else "none: the model's inputs have no "
                "symbolic dims",
                hint,
            )
        )


def _random_source(specs: Sequence[TensorSpec], num_batches: int, batch_size: int | None, seed: int,
                   dims: Mapping[str, int] | None) -> FeedSource:
    bs = batch_size or DEFAULT_BATCH_SIZE
    pinned = {d: n for s in specs for d, n in s.graph_sizes.items()}  # a fixed-size state fixes the batch
    all_dims = {**_batch_dims(specs, bs), **pinned, **(dims or {})}
    guessed = _guessed_dims(specs, all_dims)
    if guessed:
        logger.warning(
            "Random data: no size is known for symbolic dim(s) %s, so each is set to %d. A model run at sizes "
            "it is not used at computes other ranges (a CNN's feature maps shrink to a pixel, a sequence model "
            "sees 2 tokens); pass --dim NAME=N for each (e.g. --dim '%s=224'), or real data.",
            ", ".join(guessed),
            DEFAULT_DIM_SIZE,
            guessed[0].split("'")[1],
        )

    def gen() -> Iterator[dict[str, np.ndarray]]:
        rng = np.random.default_rng(seed)
        for _ in range(num_batches):
            yield random_batch(specs, rng, all_dims)

    n = specs[0].concrete_shape(all_dims)[0] if specs and specs[0].shape else 1
    return FeedSource("random", f"seeded random data (seed {seed}, {num_batches} batches)", specs, gen,
                      num_batches, num_batches * n, guessed_dims=tuple(guessed))


def check_labels(labels: np.ndarray, num_samples: int, origin: str) -> np.ndarray:
    """Validate a file's ``_labels``: integer class indices >= 0, one per sample (1-D).

    Returns:
        The labels as int64.

    Raises:
        InvalidInputError: For another dtype, rank or length, or a negative label.
    """
    what = f"Data '{origin}': _labels"
    hint = "save one integer class index per sample, e.g. np.savez(..., _labels=y.astype(np.int64))"
    if labels.dtype.kind not in "iu":
        raise InvalidInputError(format_message(what, f"dtype {labels.dtype}", "integer class indices", hint))
    if labels.ndim != 1:
        raise InvalidInputError(
            format_message(what, f"shape {tuple(labels.shape)}", f"a 1-D array of {num_samples} labels", hint)
        )
    if labels.shape[0] != num_samples:
        raise InvalidInputError(
            format_message(what, f"{labels.shape[0]} labels", f"one per sample ({num_samples})", hint)
        )
    if labels.size and int(labels.min()) < 0:
        raise InvalidInputError(
            format_message(what, f"a negative label ({int(labels.min())})", "class indices >= 0", hint)
        )
    return labels.astype(np.int64, copy=False)


def _array_source(kind: str, desc: str, loader: object, files: list[Path], specs: Sequence[TensorSpec],
                  batch_size: int, num_batches: int | None) -> FeedSource:
    # Validate and count up front, one file at a time, then stream. The files' arrays are kept while they fit the
    # budget's data_files slice: every pass then reads them from memory, not from the files again, and each batch is
    # the caller's own copy, as a batch read from the file was (writing to it changes no later pass).
    total, nb = 0, 0
    labels = []
    layouts: list[FileLayout] = []
    kept: list[Mapping[str, np.ndarray]] | None = []
    room = current_budget().data_files
    for f in files:
        arrays = loader(f)  # type: ignore[operator]
        if kept is not None:
            room -= sum(np.asarray(a).nbytes for a in arrays.values())
            if room >= 0:
                kept.append(arrays)
            else:
                kept = None  # (read again on each pass, file by file, as the arrays came)
        layout = file_layout(arrays, specs, str(f))
        layouts.append(layout)
        total += layout.samples
        nb += layout.batches(batch_size)
        if "_labels" in arrays:
            labels.append(check_labels(np.asarray(arrays["_labels"]), layout.samples, str(f)))
    if labels and len(labels) != len(files):
        raise InvalidInputError(
            format_message(f"Data '{desc}'", f"_labels in {len(labels)} of {len(files)} files",
                           "_labels in every file or in none", "labels must cover every sample")
        )
    if num_batches is not None:
        nb = min(nb, num_batches)

    def gen() -> Iterator[dict[str, np.ndarray]]:
        left = num_batches
        for i, (f, layout) in enumerate(zip(files, layouts, strict=True)):
            arrays = kept[i] if kept is not None else loader(f)  # type: ignore[operator]
            for batch in split_batches(arrays, specs, layout, batch_size, left):
                yield batch if kept is None else {k: np.array(v) for k, v in batch.items()}
                if left is not None:
                    left -= 1
            if left is not None and left <= 0:
                return

    lab = np.concatenate(labels) if labels else None
    return FeedSource(kind, desc, specs, gen, nb, total, labels=lab)


def _image_arrays(folder: Path, specs: Sequence[TensorSpec], pre: ImagePreprocess) -> dict[str, np.ndarray]:
    if len(specs) != 1 or spec_rank(specs[0]) != 4:
        got = f"a model with inputs {[str(s) for s in specs]}"
        raise InvalidInputError(format_message(f"Image folder '{folder}'", got, "one 4-D image input",
                                               "use .npz data for other models"))
    spec = specs[0]
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    size = pre.size
    if size is None:
        dims = spec.shape[2:4] if pre.layout == "nchw" else spec.shape[1:3]
        if all(isinstance(d, int) for d in dims):
            size = (int(dims[0]), int(dims[1]))
    channels = spec.shape[1] if pre.layout == "nchw" else spec.shape[3]
    mode = pre.mode or ("L" if channels == 1 else "RGB")
    images = [_image_array(f, size, mode, pre) for f in files]
    if not images:
        raise InvalidInputError(format_message(f"Image folder '{folder}'", "no image files",
                                               "files ending in " + "/".join(IMAGE_SUFFIXES)))
    return {spec.name: np.stack(images).astype(spec.dtype)}


def _image_array(f: Path, size: tuple[int, int] | None, mode: str, pre: ImagePreprocess) -> np.ndarray:
    """One image file, resized to ``size`` (height, width) when given, normalised, in the input's layout."""
    from PIL import Image

    try:
        img = Image.open(f).convert("L" if mode == "L" else "RGB")
    except OSError as err:
        raise InvalidInputError(format_message(f"Image '{f}'", "an unreadable image", "PNG/JPEG/BMP")) from err
    if size is not None:
        img = img.resize((size[1], size[0]))
    arr: np.ndarray = np.asarray(img, dtype=np.float32)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if mode == "BGR":
        arr = arr[:, :, ::-1]
    arr = (arr / np.float32(pre.scale) - np.asarray(pre.mean, np.float32)) / np.asarray(pre.std, np.float32)
    arr = arr.astype(np.float32)
    return arr.transpose(2, 0, 1) if pre.layout == "nchw" else arr


def spec_rank(spec: TensorSpec) -> int:
    """Rank of a spec."""
    return len(spec.shape)


def load_feeds(
    source: str | Path | None,
    specs: Sequence[TensorSpec],
    *,
    model: object = None,
    batch_size: int | None = None,
    num_batches: int | None = None,
    seed: int = 0,
    dims: Mapping[str, int] | None = None,
    image_preprocess: str | ImagePreprocess | None = None,
    input_ranges: Sequence[str] | Mapping[str, Sequence[float]] | None = None,
) -> FeedSource:
    """Open a data source for a model with the given input specs.

    Args:
        source: Path, ``"random"``/``"random:N"`` or None (random).
        specs: The model's inputs.
        model: The FP32 model (ModelProto, path, or a run function) that decodes prompts for a model with a KV cache
            (``prompts:FILE[:steps=N]``, or an .npz of ``input_ids`` only; see :mod:`mpinfer.data.decode`).
        batch_size: Samples per batch (default 16, or the model's fixed batch dim).
        num_batches: Cap on the number of batches.
        seed: Seed for random data.
        dims: Sizes for symbolic dims of random data (``{"seq": 32}``).
        image_preprocess: Preprocessing for an image folder.
        input_ranges: Value ranges of random data per input (``["ids=0..1000"]``), over the model's own.

    Returns:
        A FeedSource (iterable of batches).

    Raises:
        InvalidInputError: For a missing source, wrong names/dtypes/shapes, NaN/Inf or empty data.
    """
    _check_dim_names(specs, dims or {})
    if input_ranges:
        specs = _with_ranges(specs, parse_input_ranges(input_ranges))
    bs = batch_size or DEFAULT_BATCH_SIZE
    _check_batching(batch_size, num_batches)
    if decode.wants_decode(source, specs):
        return decode.decode_source(str(source), specs, model, batch_size=bs, num_batches=num_batches)
    dims = decode.kv_dims(specs, dims)
    if source is None or str(source) == "random" or str(source).startswith("random:"):
        n = _random_batches("" if source is None else str(source), num_batches)
        return _random_source(specs, n if specs else 1, batch_size, seed, dims)  # no inputs: one run is all
    return _file_source(source, specs, bs, num_batches, image_preprocess)


def _check_batching(batch_size: int | None, num_batches: int | None) -> None:
    if batch_size is not None and batch_size <= 0:
        raise InvalidInputError(format_message("Batch size", batch_size, "a positive integer"))
    if num_batches is not None and num_batches < 1:
        raise InvalidInputError(format_message("Number of batches", num_batches, "a positive integer",
                                               "omit it to use every batch of the data"))


def _random_batches(text: str, num_batches: int | None) -> int:
    """The batch count of ``random`` / ``random:N`` (capped by ``num_batches``)."""
    n = num_batches or DEFAULT_RANDOM_BATCHES
    if ":" in text:
        try:
            n = int(text.split(":", 1)[1])
        except ValueError as err:
            raise InvalidInputError(format_message("Data source", repr(text), "random or random:N")) from err
        if n < 1:
            raise InvalidInputError(format_message("Data source", repr(text), "random:N with N >= 1 batches",
                                                   "e.g. random:8"))
        n = min(n, num_batches) if num_batches is not None else n
    return n


def _file_source(
    source: str | Path,
    specs: Sequence[TensorSpec],
    bs: int,
    num_batches: int | None,
    image_preprocess: str | ImagePreprocess | None,
) -> FeedSource:
    """The FeedSource of an .npz file, or a folder of .npz files, .npy files (one per input) or images."""
    path = Path(source)
    if not path.exists():
        raise InvalidInputError(format_message(f"Data '{source}'", "no such file or folder",
                                               "an .npz file, a folder of .npz/.npy files or images, or 'random'"))
    if path.is_file():
        if path.suffix != ".npz":
            raise InvalidInputError(format_message(f"Data file '{source}'", f"a '{path.suffix}' file",
                                                   "an .npz file", "or pass a folder of .npy files/images"))
        return _array_source("npz", str(path), read_npz, [path], specs, bs, num_batches)
    npz = sorted(path.glob("*.npz"))
    if npz:
        return _array_source("npz", f"{path} ({len(npz)} .npz files)", read_npz, npz, specs, bs, num_batches)
    npy = {p.stem: p for p in path.glob("*.npy")}
    if npy:
        def load_npy(_f: Path) -> dict[str, np.ndarray]:
            return {k: np.load(p, allow_pickle=False) for k, p in npy.items()}
        return _array_source("npy", f"{path} (.npy per input)", load_npy, [path], specs, bs, num_batches)
    if any(p.suffix.lower() in IMAGE_SUFFIXES for p in path.iterdir()):
        pre = (image_preprocess if isinstance(image_preprocess, ImagePreprocess)
               else ImagePreprocess.parse(image_preprocess))
        arrays = _image_arrays(path, specs, pre)
        return _array_source("images", f"{path} (images)", lambda _f: arrays, [path], specs, bs, num_batches)
    raise InvalidInputError(format_message(f"Data folder '{source}'", "no .npz, .npy or image files",
                                           "one of those", "or pass 'random'"))


def parse_input_ranges(items: Sequence[str] | Mapping[str, Sequence[float]]) -> dict[str, tuple[float, float]]:
    """Parse ``ids=0..1000`` items (``--input-range``) into ``{"ids": (0, 1000)}``; integers draw from ``[lo, hi)``.

    Raises:
        InvalidInputError: For a malformed item.
    """
    if isinstance(items, Mapping):
        items = [f"{k}={v[0]}..{v[1]}" for k, v in items.items()]
    out = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise InvalidInputError(format_message("--input-range", repr(item), "name=lo..hi, e.g. input_ids=0..30522"))
        out[key.strip()] = parse_range(value, what=f"--input-range {key.strip()}")
    return out


def _with_ranges(specs: Sequence[TensorSpec], ranges: Mapping[str, tuple[float, float]]) -> list[TensorSpec]:
    """The specs with the given value ranges (every name an input of the model)."""
    names = [s.name for s in specs]
    unknown = [n for n in ranges if n not in names]
    if unknown:
        got = ", ".join(repr(n) for n in unknown) + " (no such input)"
        raise InvalidInputError(format_message("--input-range", got, "one of " + ", ".join(repr(n) for n in names)))
    return [replace(s, value_range=ranges[s.name]) if s.name in ranges else s for s in specs]


def parse_dims(items: Sequence[str]) -> dict[str, int]:
    """Parse ``seq=32`` items into ``{"seq": 32}``.

    Raises:
        InvalidInputError: For a malformed item.
    """
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value.isdigit() or int(value) <= 0:
            raise InvalidInputError(format_message("Dim size", repr(item), "name=N with N > 0, e.g. seq=32"))
        out[key] = int(value)
    return out


__all__ = [
    "FeedSource",
    "ImagePreprocess",
    "fixed_batch",
    "load_feeds",
    "parse_dims",
    "parse_input_ranges",
    "parse_range",
    "random_batch",
    "read_npz",
    "sample_axes",
    "take_samples",
]
