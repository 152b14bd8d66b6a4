"""Load and save ONNX models safely, and give every node a stable address.

* :func:`load_onnx` refuses files that are not ONNX, truncated files, missing external data and external
  data paths that leave the model's folder (a path-traversal guard for untrusted models).
* :func:`save_onnx` writes atomically, sets an IR version the installed onnxruntime can read, and switches
  to external data above 2 GB.
* :func:`name_nodes` names unnamed nodes deterministically; :func:`iter_nodes` walks If/Loop/Scan bodies
  and yields each node with its qualified address (``If_3/then_branch/Add_1``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpinfer.errors import InvalidInputError, ModelLoadError, format_message
from mpinfer.fileio import make_temp_dir, user_file_mode

if TYPE_CHECKING:
    import onnx

logger = logging.getLogger(__name__)

# Protobuf cannot serialise a message of 2 GiB or more; leave headroom for the graph itself.
EXTERNAL_DATA_THRESHOLD = 2_000_000_000
# Highest ONNX IR version that onnxruntime 1.20+ loads; models are written at the lowest IR their opsets
# allow, never above this.
MAX_ORT_IR_VERSION = 10
# Highest default-domain opset `export --opset` and `convert --opset` write (onnxruntime 1.31 loads up to 26;
# the `--opset` hint of convert never names a higher one).
MAX_OPSET = 25
# Tensors at least this big go to the external data file when a model is saved with external data.
EXTERNAL_DATA_SIZE_THRESHOLD = 1024


def _check_external_data(model: onnx.ModelProto, base_dir: Path, path: Path) -> None:
    import onnx

    assert isinstance(model, onnx.ModelProto)
    base = base_dir.resolve()
    for tensor, info, target in _external_tensors(model, base):
        loc = info.get("location", "")
        if os.path.isabs(loc) or (base != target and base not in target.parents):
            raise ModelLoadError(
                format_message(
                    f"ONNX model '{path}': tensor '{tensor.name}' has external data path '{loc}'",
                    "a path outside the model's folder",
                    f"a relative path inside '{base}'",
                    "untrusted models may try to read other files; move the data next to the model",
                )
            )
        if not target.is_file():
            raise ModelLoadError(
                format_message(
                    f"ONNX model '{path}': external data file '{loc}' for tensor '{tensor.name}'",
                    "a missing file",
                    f"the file at '{target}'",
                    f"copy the data file that came with the model to '{loc}' beside it",
                )
            )
        try:
            end = int(info.get("offset") or 0) + int(info["length"]) if "length" in info else None
        except ValueError:
            end = None  # onnx's own loader names a malformed offset/length
        size = target.stat().st_size
        if end is not None and end > size:
            raise ModelLoadError(
                format_message(
                    f"ONNX model '{path}': external data file '{loc}' for tensor '{tensor.name}'",
                    f"a file of {size} bytes",
                    f"at least {end} bytes (the tensor's offset + length)",
                    "the data file is truncated or belongs to another model: copy it again",
                )
            )


def external_data_files(path: str | os.PathLike[str]) -> list[Path]:
    """The external data files the ONNX model at ``path`` reads (resolved; none for a self-contained model).

    A writer checks its outputs against these too: a model's ``<out>.data`` may be the input's own data file.
    """
    import onnx

    p = Path(path)
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception:  # noqa: BLE001 - unreadable models are refused by load_onnx with its own words
        return []
    return sorted({target for _, _, target in _external_tensors(model, p.parent)})


def _external_tensors(model: onnx.ModelProto, base: Path) -> Iterator[tuple[onnx.TensorProto, dict[str, str], Path]]:
    """Each tensor stored outside the model, its external-data entries and the file they name (resolved)."""
    from onnx.external_data_helper import uses_external_data

    for tensor in _all_tensors(model):
        if uses_external_data(tensor):
            info = {e.key: e.value for e in tensor.external_data}
            yield tensor, info, (base / info.get("location", "")).resolve()


def data_file(path: str | os.PathLike[str]) -> Path:
    """Where mpinfer keeps a model's external data: ``<name>.data`` beside ``<name>`` (``m.onnx.data``)."""
    p = Path(path)
    return p.with_name(p.name + ".data")


def default_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain (``ai.onnx``) opset, 0 when it imports none."""
    return next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of every initializer (bodies too): embedded, its serialized size; external, its recorded length."""
    total = 0
    for graph in iter_graphs(model.graph):
        for tensor in graph.initializer:
            length = next((int(e.value) for e in tensor.external_data if e.key == "length"), None)
            total += tensor.ByteSize() if length is None else length
    return total


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The If/Loop/Scan bodies held directly by ``node`` (GRAPH and GRAPHS attributes)."""
    import onnx

    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def iter_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every body nested inside it, depth first."""
    yield graph
    for node in graph.node:
        for body in subgraphs(node):
            yield from iter_graphs(body)


def _all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    import onnx

    for graph in iter_graphs(model.graph):
        yield from graph.initializer
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t


def load_onnx(path: str | os.PathLike[str], *, load_external_data: bool = True) -> onnx.ModelProto:
    """Load an ONNX model with clear errors for the ways a file can be wrong.

    Args:
        path: The .onnx file.
        load_external_data: Load external tensors into the proto (after the path check).

    Returns:
        The ``onnx.ModelProto``.

    Raises:
        ModelLoadError: Missing, unreadable, not ONNX, truncated, or bad external data.
    """
    import onnx
    from google.protobuf.message import DecodeError

    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(format_message(f"ONNX model '{path}'", "no such file", "an existing .onnx file"))
    try:
        data = p.read_bytes()
    except OSError as err:
        raise ModelLoadError(format_message(f"ONNX model '{path}'", f"an unreadable file ({err.strerror})",
                                            "a readable .onnx file")) from err
    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as err:
        raise ModelLoadError(
            format_message(f"ONNX model '{path}'", f"a file that does not parse as ONNX ({err})",
                           "a complete ONNX protobuf", "the file may be truncated or not an ONNX model")
        ) from err
    if not model.graph.node and not model.graph.output:
        raise ModelLoadError(
            format_message(f"ONNX model '{path}'", "an empty graph (no nodes, no outputs)",
                           "an ONNX model", "the file may be truncated or not an ONNX model")
        )
    _check_external_data(model, p.parent, p)
    if load_external_data:
        from onnx.external_data_helper import load_external_data_for_model

        load_external_data_for_model(model, str(p.parent))
    return model


def ir_version_for(model: onnx.ModelProto) -> int:
    """The lowest IR version that supports every opset the model imports, capped for onnxruntime."""
    import onnx
    from onnx import helper

    assert isinstance(model, onnx.ModelProto)
    needed = 3
    for imp in model.opset_import:
        domain = imp.domain or "ai.onnx"
        if domain not in ("ai.onnx", "ai.onnx.ml"):
            continue
        best = None
        for _rel, ir, onnx_opset, ml_opset, *_rest in helper.VERSION_TABLE:
            have = onnx_opset if domain == "ai.onnx" else ml_opset
            if have is not None and have >= imp.version:
                best = ir if best is None else min(best, ir)
        if best is not None:
            needed = max(needed, best)
    return min(max(needed, 7), max(MAX_ORT_IR_VERSION, needed))


def _serialized(model: onnx.ModelProto) -> bytes:
    """The bytes :func:`save_onnx` writes for ``model`` already at its IR version (one file, no external data)."""
    return model.SerializeToString(deterministic=True)


def saved_bytes(model: onnx.ModelProto) -> bytes:
    """The exact bytes :func:`save_onnx` writes for ``model`` as one file (at an onnxruntime-loadable IR version).

    For a model that :func:`small_enough_to_size` and below ``EXTERNAL_DATA_THRESHOLD`` (save_onnx's default then
    writes no external data): the validity gate checks the model parsed from these bytes, and the file later
    published holds them (:func:`mpinfer.precision.graph.validate.gate_published` compares digests).
    """
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.ir_version = ir_version_for(m)
    return _serialized(m)


def save_onnx(
    model: onnx.ModelProto,
    path: str | os.PathLike[str],
    *,
    external_data: bool | None = None,
) -> Path:
    """Write a model atomically at an onnxruntime-loadable IR version.

    Args:
        model: The ``onnx.ModelProto`` (not modified: a copy is saved).
        path: Destination .onnx path.
        external_data: Force external data on/off; None switches it on above 2 GB.

    Returns:
        The destination path.
    """
    import onnx

    assert isinstance(model, onnx.ModelProto)
    out = Path(path)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.ir_version = ir_version_for(m)
    if external_data is None:
        external_data = m.ByteSize() >= EXTERNAL_DATA_THRESHOLD if small_enough_to_size(m) else True
    tmpdir = make_temp_dir(out)
    try:
        tmp_model = tmpdir / out.name
        data_name = data_file(out).name
        if external_data:
            save_with_external_data(m, tmp_model, data_name)
            if (tmpdir / data_name).exists():  # onnx writes it 0600: like any file the user creates instead
                os.chmod(tmpdir / data_name, user_file_mode())
                os.replace(tmpdir / data_name, out.parent / data_name)
        else:
            tmp_model.write_bytes(_serialized(m))
        os.chmod(tmp_model, user_file_mode())
        os.replace(tmp_model, out)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return out


def save_with_external_data(model: onnx.ModelProto, path: Path, data_name: str) -> None:
    """``onnx.save_model`` with every initializer of at least EXTERNAL_DATA_SIZE_THRESHOLD bytes in ``data_name``.

    Tensors are marked here rather than by ``save_model(save_as_external_data=True, location=...)``: that
    refuses to save when a file named ``location`` exists in the *current* folder (onnx checks the location
    relative to the process, not to the model), so re-converting in the output's own folder failed. ``path``
    is a fresh file in a fresh folder: the data file is written next to it, tensor by tensor.
    """
    import sys

    import onnx
    from onnx.external_data_helper import set_external_data

    for graph in iter_graphs(model.graph):
        for tensor in graph.initializer:
            if tensor.HasField("raw_data") and sys.getsizeof(tensor.raw_data) >= EXTERNAL_DATA_SIZE_THRESHOLD:
                set_external_data(tensor, data_name)
    onnx.save_model(model, str(path))


# Tensors of at least this many bytes start at a multiple of it in a streamed data file, so ONNX Runtime can
# memory-map them (it maps an external tensor only at an offset aligned to the page size).
DATA_ALIGNMENT = 4096
# Bytes copied per step when a weight moves from the input's data file to the output's.
COPY_CHUNK_BYTES = 64 * 2**20


def save_streamed(
    model: onnx.ModelProto, path: str | os.PathLike[str], data_name: str, base_dir: str | os.PathLike[str] = ""
) -> Path:
    """Write ``model`` and its weights to ``path`` + ``data_name`` beside it, one tensor at a time.

    For models whose weights are external (``base_dir``: the folder their data is relative to) or too big to hold
    twice: each initializer of at least EXTERNAL_DATA_SIZE_THRESHOLD bytes goes to the data file, copied in
    chunks from its external file or moved out of the proto (whose ``raw_data`` is then cleared), so the proto
    left in ``model`` is the graph alone, pointing at the new data file. Not atomic: ``path`` is a fresh file in
    a temporary folder (the caller renames it into place).
    """
    import numpy as np
    import onnx
    from onnx.external_data_helper import load_external_data_for_tensor
    from onnx.external_data_helper import uses_external_data as external

    out = Path(path)
    with open(out.parent / data_name, "wb") as f:
        for graph in iter_graphs(model.graph):
            for tensor in graph.initializer:
                if external(tensor) and tensor.data_type in _MAPPABLE:
                    raw = np.asarray(tensor_array(tensor, base_dir)).reshape(-1).view(np.uint8)
                elif external(tensor):  # bfloat16, strings, ...: their bytes as they are
                    load_external_data_for_tensor(tensor, str(base_dir))
                    raw = np.frombuffer(tensor.raw_data, np.uint8)
                elif tensor.HasField("raw_data") and len(tensor.raw_data) >= EXTERNAL_DATA_SIZE_THRESHOLD:
                    raw = np.frombuffer(tensor.raw_data, np.uint8)
                else:
                    continue
                offset = f.tell()
                if raw.nbytes >= DATA_ALIGNMENT and offset % DATA_ALIGNMENT:
                    f.write(b"\0" * (DATA_ALIGNMENT - offset % DATA_ALIGNMENT))
                    offset = f.tell()
                for start in range(0, raw.nbytes, COPY_CHUNK_BYTES):
                    f.write(raw[start : start + COPY_CHUNK_BYTES].tobytes())
                del raw
                tensor.ClearField("raw_data")
                del tensor.external_data[:]
                tensor.data_location = onnx.TensorProto.EXTERNAL
                entries = (("location", data_name), ("offset", str(offset)), ("length", str(f.tell() - offset)))
                for key, value in entries:
                    tensor.external_data.add(key=key, value=value)
    if not (out.parent / data_name).stat().st_size:
        (out.parent / data_name).unlink()  # every tensor small: a self-contained model
    model.ir_version = ir_version_for(model)
    out.write_bytes(model.SerializeToString())
    return out


def small_enough_to_size(model: onnx.ModelProto) -> bool:
    """True when the proto can be serialized whole (under 2 GiB of tensor data).

    ByteSize works up to 2 GiB; summing raw_data first avoids an overflow error on giant models.
    """
    total = 0
    for t in _all_tensors(model):
        total += len(t.raw_data)
        if total >= EXTERNAL_DATA_THRESHOLD:
            return False
    return True


@dataclass(frozen=True)
class NodeRef:
    """A node and where it lives.

    Attributes:
        address: Qualified, stable name: ``name`` in the main graph, ``If_3/then_branch/Add_1`` inside bodies.
        node: The ``onnx.NodeProto``.
        graph: The ``onnx.GraphProto`` holding it.
        depth: 0 for the main graph, 1 for a body, and so on.
    """

    address: str
    node: onnx.NodeProto
    graph: onnx.GraphProto
    depth: int


def iter_nodes(graph: onnx.GraphProto, prefix: str = "", depth: int = 0) -> Iterator[NodeRef]:
    """Yield every node of ``graph`` and of its subgraphs (depth first, in graph order)."""
    import onnx

    assert isinstance(graph, onnx.GraphProto)
    for node in graph.node:
        addr = f"{prefix}{node.name}"
        yield NodeRef(addr, node, graph, depth)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_nodes(attr.g, f"{addr}/{attr.name}/", depth + 1)
            elif attr.type == onnx.AttributeProto.GRAPHS:  # addresses carry the attribute name and index
                for i, g in enumerate(attr.graphs):
                    yield from iter_nodes(g, f"{addr}/{attr.name}_{i}/", depth + 1)


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of ``model`` in which every node has a name unique within its graph.

    Unnamed nodes become ``<OpType>_<index>`` (index = position in its graph); a duplicate name gets a
    ``_<n>`` suffix. Names already present are kept, so the result is stable across runs.
    """
    import onnx

    assert isinstance(model, onnx.ModelProto)
    m = onnx.ModelProto()
    m.CopyFrom(model)

    def fix(graph: onnx.GraphProto) -> None:
        seen: set[str] = set()
        for i, node in enumerate(graph.node):
            name = node.name or f"{node.op_type}_{i}"
            base, n = name, 1
            while name in seen:
                name = f"{base}_{n}"
                n += 1
            seen.add(name)
            node.name = name
            for body in subgraphs(node):
                fix(body)

    fix(m.graph)
    return m


def ort_log_level() -> int:
    """ONNX Runtime's log severity for mpinfer's sessions: fatal only, warnings with ``-vv``.

    Every error ONNX Runtime raises reaches the user in mpinfer's own message; its log line would say it twice.
    """
    import logging

    return 2 if logging.getLogger("mpinfer").isEnabledFor(logging.DEBUG) else 4


def ort_session(
    model: onnx.ModelProto | str | os.PathLike[str],
    providers: list[str] | None = None,
    options: Any = None,
    *,
    base_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """Create an onnxruntime InferenceSession from a ModelProto or path (CPU unless told otherwise).

    ``options`` is an ``onnxruntime.SessionOptions`` (default: logging at :func:`ort_log_level`).
    ``base_dir``: the folder a ModelProto's external data is relative to (the model file's folder): ONNX Runtime
    memory-maps the weights from there, the proto stays graph-only (no copy of the weights).

    Raises:
        ModelLoadError: If onnxruntime refuses the model.
    """
    import onnx
    import onnxruntime as ort

    so = options
    if so is None:
        so = ort.SessionOptions()
        so.log_severity_level = ort_log_level()
    providers = providers or ["CPUExecutionProvider"]
    try:
        if isinstance(model, onnx.ModelProto):
            if small_enough_to_size(model):
                if base_dir and uses_external_data(model):
                    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(base_dir))
                return ort.InferenceSession(model.SerializeToString(), so, providers=providers)
            with tempfile.TemporaryDirectory() as td:
                p = save_onnx(model, Path(td) / "model.onnx", external_data=True)
                return ort.InferenceSession(str(p), so, providers=providers)
        return ort.InferenceSession(str(model), so, providers=providers)
    except Exception as err:  # onnxruntime raises its own Fail/InvalidGraph/... types
        raise ModelLoadError(f"ONNX Runtime could not load the model: {err}") from err


def uses_external_data(model: onnx.ModelProto) -> bool:
    """True when some tensor of ``model`` (bodies included) keeps its data in an external file."""
    from onnx.external_data_helper import uses_external_data as external

    return any(external(t) for t in _all_tensors(model))


# Element types whose external bytes are the numpy array as it is (little-endian, no packing): memory-mapped.
_MAPPABLE = {1: "<f4", 2: "u1", 3: "i1", 4: "<u2", 5: "<i2", 6: "<i4", 7: "<i8", 9: "?", 10: "<f2", 11: "<f8",
             12: "<u4", 13: "<u8"}


def tensor_array(tensor: onnx.TensorProto, base_dir: str | os.PathLike[str] = "") -> Any:
    """``tensor``'s values as a numpy array; external data is memory-mapped read-only, not read.

    The mapping lives as long as the array (and its views): pages are read when touched and belong to the page
    cache, so a weight held only while a node runs costs no memory after it. Other tensors (embedded data,
    packed or big-endian types) come from ``onnx.numpy_helper.to_array``.
    """
    import numpy as np
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data as external

    dtype = _MAPPABLE.get(tensor.data_type)
    if not external(tensor) or dtype is None:
        return numpy_helper.to_array(tensor, str(base_dir))
    info = {e.key: e.value for e in tensor.external_data}
    shape = tuple(int(d) for d in tensor.dims)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return numpy_helper.to_array(tensor, str(base_dir))
    path = Path(base_dir) / info["location"]
    arr = np.memmap(path, dtype=np.dtype(dtype), mode="r", offset=int(info.get("offset") or 0), shape=(count,))
    return arr.view(np.ndarray).reshape(shape)  # a plain ndarray (its base keeps the mapping open)


def require_file(path: str | os.PathLike[str], what: str) -> Path:
    """Return ``path`` as a Path, or raise InvalidInputError naming ``what`` when it is no file."""
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(format_message(f"{what} '{path}'", "no such file", "an existing file"))
    return p


# The first opset that has RMSNormalization: export writes decoders at it and convert upgrades to it when their
# RMSNorm chains fuse (both only where the installed ONNX Runtime runs it: :func:`ort_runs_rms_normalization`).
RMS_NORM_OPSET = 23


@cache  # (one probe per opset and process: the installed runtime does not change)
def ort_runs_rms_normalization(opset: int = RMS_NORM_OPSET) -> bool:
    """True when the installed ONNX Runtime loads and runs ``RMSNormalization`` at ``opset`` (probed, not assumed).

    A one-node model per float type a converted decoder feeds it (float32, and float16 as convert lowers it),
    run on the CPU provider; any refusal (an opset past the runtime's, no kernel) is a False.
    """
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    try:
        for elem, dtype in ((TensorProto.FLOAT, np.float32), (TensorProto.FLOAT16, np.float16)):
            node = helper.make_node("RMSNormalization", ["x", "scale"], ["y"], axis=-1, epsilon=1e-5, stash_type=1)
            graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("x", elem, [2, 4])],
                                      [helper.make_tensor_value_info("y", elem, [2, 4])],
                                      [onnx.numpy_helper.from_array(np.ones(4, dtype), "scale")])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
            model.ir_version = ir_version_for(model)
            sess = ort_session(model)
            y = sess.run(None, {"x": np.full((2, 4), 2, dtype)})[0]
            if not np.allclose(y.astype(np.float32), 1.0, atol=1e-2):
                return False
    except Exception as err:  # ModelLoadError, onnxruntime's own errors (no kernel, opset too new)
        logger.debug("ONNX Runtime does not run RMSNormalization at opset %d: %s", opset, err)
        return False
    return True
