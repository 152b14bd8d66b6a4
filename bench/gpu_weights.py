"""Weight skeletons: an ONNX model carried without its large weights, rebuilt bit-exactly on the other side.

The lent GPU machine takes at most 64 MiB per call, so the prepared models (issue 30) travel as skeletons:
the graph, the small initializers, and for every initializer of ``MIN_ELEMS`` or more elements a recipe in
``<model>.weights.json``:

* ``{"regen": [seed, mean, std]}``: a seeded uniform draw with that mean and std from PCG64's raw bits (the
  benchmark's FP32 models with random weights are *defined* by these draws: :func:`regenerate_weights` replaces
  the exported weights with them before anything is converted);
* ``{"cast": SOURCE, "dtype": "float16"}``: the FP32 model's initializer ``SOURCE`` cast to ``dtype`` (how the
  FP16 models of mpinfer and AutoCast hold their weights), matched bit for bit when packed, with a ``patch``
  (element indices and values) where a few elements differ from numpy's rounding;

A published model's FP32 file (trained weights) travels whole; its FP16 models travel as cast recipes.

Each recipe keeps the CRC-32 of the tensor's bytes; :func:`unpack` checks every rebuilt tensor against it.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np

MIN_ELEMS = 4096  # smaller tensors (biases, norms, shapes) stay in the skeleton: they cost little to carry
PATCH_SHARE = 0.001  # a cast whose elements differ from numpy's astype in at most this share travels as a patch
REGEN_KEY = "bench.gpu_weights.regen"  # metadata_props entry: initializer -> [seed, mean, std] of its draw


def _arrays(model: Any) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).tobytes())


def _draw(name: str, shape: tuple[int, ...], mean: float, std: float) -> np.ndarray:
    """Uniform values with ``mean`` and ``std``, from PCG64's raw bits (a stream numpy keeps stable across versions)
    through exact float32 steps and two correctly rounded ones: the same bits on any machine and numpy."""
    raw = np.random.PCG64(zlib.crc32(name.encode())).random_raw(int(np.prod(shape, dtype=np.int64)))
    u = (raw >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24) - np.float32(0.5)  # exact, in [-0.5, 0.5)
    return (u * np.float32(std * 12**0.5) + np.float32(mean)).astype(np.float32).reshape(shape)


def regenerate_weights(model: Any, min_elems: int = MIN_ELEMS) -> Any:
    """A copy of ``model`` whose float32 initializers of ``min_elems`` or more elements are seeded draws with the
    originals' mean and std (recorded in the model's metadata)."""
    import onnx
    from onnx import numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    params = {}
    for t in out.graph.initializer:
        if t.data_type != onnx.TensorProto.FLOAT or int(np.prod(t.dims)) < min_elems:
            continue
        a = numpy_helper.to_array(t)
        params[t.name] = [zlib.crc32(t.name.encode()), float(a.mean()), float(a.std())]
        t.CopyFrom(numpy_helper.from_array(_draw(t.name, a.shape, *params[t.name][1:]), t.name))
    onnx.helper.set_model_props(out, {**{p.key: p.value for p in out.metadata_props}, REGEN_KEY: json.dumps(params)})
    return out


def _recipes_of_fp32(
    model: Any, regenerated: bool, min_elems: int
) -> tuple[dict[str, dict], dict[tuple[str, str], str]]:
    """The FP32 model's own recipes, and an index (dtype, sha1 of the cast bytes) -> initializer name."""
    recipes: dict[str, dict] = {}
    index: dict[tuple[str, str], str] = {}
    props = {p.key: p.value for p in model.metadata_props}
    if regenerated and REGEN_KEY not in props:
        raise RuntimeError("the FP32 model has no seeded draws: call regenerate_weights first")
    params = json.loads(props.get(REGEN_KEY, "{}"))
    for name, a in _arrays(model).items():
        if a.dtype != np.float32 or a.size < min_elems:
            continue
        if regenerated:
            _, mean, std = params[name]
            if _crc(_draw(name, a.shape, mean, std)) != _crc(a):
                raise RuntimeError(f"initializer {name} is not its recorded seeded draw")
            recipes[name] = {"regen": params[name], "crc": _crc(a)}
        for dt in ("float32", "float16"):
            index.setdefault((dt, hashlib.sha1(a.astype(dt).tobytes()).hexdigest()), name)
    return recipes, index


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(f"u{a.dtype.itemsize}")


def _cast_recipe(a: np.ndarray, name: str, index: dict[tuple[str, str], str],
                 sources: dict[str, np.ndarray]) -> dict | None:
    """``a`` as a cast of an FP32 initializer: exact, or with a patch of at most ``PATCH_SHARE`` of its elements
    (AutoCast replaces FP16-underflowing weights by the smallest subnormal, where numpy rounds them to zero)."""
    src = index.get((a.dtype.name, hashlib.sha1(a.tobytes()).hexdigest()))
    if src is not None:
        return {"cast": src, "dtype": a.dtype.name, "crc": _crc(a)}
    names = [name] if name in sources else []
    names += [n for n, v in sources.items() if v.shape == a.shape and n != name]
    for src in names:
        if sources[src].shape != a.shape:
            continue
        diff = np.flatnonzero(_bits(sources[src].astype(a.dtype)) != _bits(a))
        if diff.size <= PATCH_SHARE * a.size:
            flat = a.reshape(-1)
            return {"cast": src, "dtype": a.dtype.name, "crc": _crc(a),
                    "patch": [diff.tolist(), flat[diff].astype(np.float64).tolist()]}
    return None


def pack(path: Path, fp32: Path, dest: Path, *, regenerated: bool, min_elems: int = MIN_ELEMS) -> dict[str, int]:
    """Write the skeleton of ``path`` (FP32 model ``fp32``) to ``dest`` and its recipes to ``dest.weights.json``.

    ``path`` may be ``fp32`` itself when ``regenerated`` (its large weights become regen recipes). Returns the
    bytes kept inline and the bytes turned into recipes.
    """
    import onnx
    from onnx import numpy_helper

    base = onnx.load(str(fp32))
    own, index = _recipes_of_fp32(base, regenerated, min_elems)
    base_arrays = _arrays(base)
    model = onnx.load(str(path))
    recipes: dict[str, dict] = {}
    kept = stripped = 0
    for t in model.graph.initializer:
        a = numpy_helper.to_array(t) if t.dims else None
        if a is None or a.size < min_elems or a.dtype not in (np.float32, np.float16):
            kept += t.ByteSize()
            continue
        if path == fp32:
            if not regenerated:
                raise ValueError(f"{fp32.name}: an FP32 model with its own weights travels whole, not packed")
            recipe = own[t.name]
        else:
            recipe = _cast_recipe(a, t.name, index, base_arrays)
            if recipe is None:
                kept += t.ByteSize()
                continue
        recipes[t.name] = recipe
        stripped += a.nbytes
        t.ClearField("raw_data")
        for field in ("float_data", "int32_data"):
            t.ClearField(field)
    dest.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(dest))
    Path(f"{dest}.weights.json").write_text(json.dumps(recipes))
    return {"inline_bytes": kept, "recipe_bytes": stripped}


def unpack(skeleton: Path, dest: Path, *, fp32: Path | None = None) -> Path:
    """Rebuild the model of ``skeleton`` into ``dest``; ``fp32``: the (rebuilt) FP32 model the casts read.

    Raises RuntimeError when a rebuilt tensor's CRC-32 differs from the packed one (another numpy draws
    differently).
    """
    import onnx
    from onnx import numpy_helper

    from mpinfer.modelio import save_onnx

    recipes = json.loads(Path(f"{skeleton}.weights.json").read_text())
    model = onnx.load(str(skeleton))
    sources = _arrays(onnx.load(str(fp32))) if fp32 is not None else {}
    for t in model.graph.initializer:
        r = recipes.get(t.name)
        if r is None:
            continue
        shape = tuple(t.dims)
        if "regen" in r:
            _, mean, std = r["regen"]
            a = _draw(t.name, shape, mean, std)
        else:
            a = sources[r["cast"]].astype(r["dtype"])
            if "patch" in r:
                idx, vals = r["patch"]
                a.reshape(-1)[np.asarray(idx, np.int64)] = np.asarray(vals, a.dtype)
        if _crc(a) != r["crc"]:
            raise RuntimeError(f"{skeleton.name}: initializer {t.name} rebuilt with other bits than packed")
        t.CopyFrom(numpy_helper.from_array(a.reshape(shape), t.name))
    save_onnx(model, dest)
    return dest
