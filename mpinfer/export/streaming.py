"""Export without copies of the weights: the TorchScript graph exported alone, the weights streamed to disk.

``torch.onnx.export(dynamo=False)`` holds a model's weights three more times at its peak: the C++ ``ModelProto``
it builds, that proto serialized to bytes, and the proto parsed again from those bytes (to add onnxscript
functions), all beside the torch model (4.2x a 1 GB Llama's size in RSS). :func:`export_torchscript_streamed`
asks it for the graph alone (``export_params=False``: every weight is a graph input) and keeps the exporter's own
``params_dict`` (its ``_model_to_graph`` wrapped for the call): name -> tensor, the same names the graph's inputs
have, constant-folded weights included (a Linear's transposed weight is a view of the parameter, not a copy).
:func:`attach_weights` then turns those inputs into initializers whose data is written to an external-data file
one tensor at a time, in slices of at most :data:`SLICE_BYTES`: the weights are never copied whole, and the
torch model is the only full copy in memory.

When the exporter's internals cannot be wrapped (another torch), the weights are exported the usual way.
:func:`release_dynamo_weights` lets the torch weights go after a dynamo export (onnxscript kept them alive).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from mpinfer.errors import ExportError
from mpinfer.modelio import DATA_ALIGNMENT, EXTERNAL_DATA_SIZE_THRESHOLD, data_file

logger = logging.getLogger(__name__)

# Weights at least this big are left out of the params the exporter's ONNX shape inference sees: it turns every
# weight a node reads into a Constant of a one-node model and serializes that (three transient copies of a 262 MB
# embedding: +0.75x a 1 GB Llama's size at the peak). A weight's values never steer a shape; its type and shape,
# which the graph input keeps, are what inference needs.
SHAPE_INFERENCE_MAX_BYTES = 2**20
# Largest piece of a weight made contiguous at a time (a transposed view is copied slice by slice): small next to
# any model worth streaming, big enough that the writes are not per row.
SLICE_BYTES = 16 * 2**20


def _exporter_module() -> Any:
    """The module whose ``_export`` calls ``_model_to_graph`` (moved under ``_internal`` in torch 2.9)."""
    try:
        from torch.onnx._internal.torchscript_exporter import utils
    except ImportError:  # torch < 2.9
        from torch.onnx import utils  # type: ignore[no-redef]
    return utils if callable(getattr(utils, "_model_to_graph", None)) else None


@contextlib.contextmanager
def _captured_params(utils: Any) -> Iterator[dict[str, Any]]:
    """The TorchScript exporter's weights, captured while the block runs.

    The dict yielded receives the ``params_dict`` of the exporter's ``_model_to_graph``: name -> tensor, the names
    of the graph inputs the weights become under ``export_params=False``.
    """
    original = utils._model_to_graph
    captured: dict[str, Any] = {}

    def model_to_graph(*args: Any, **kwargs: Any) -> Any:
        graph, params, out = original(*args, **kwargs)
        captured.clear()
        captured.update(params)
        return graph, params, out

    utils._model_to_graph = model_to_graph
    try:
        yield captured
    finally:
        utils._model_to_graph = original


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if hasattr(t, "element_size") else 0


@contextlib.contextmanager
def _small_params_for_shape_inference(jit: Any) -> Iterator[None]:
    """The exporter's graph shape inference given only the params under SHAPE_INFERENCE_MAX_BYTES in the block.

    The others stay graph inputs of known type and shape to it.
    """
    original = jit._jit_pass_onnx_graph_shape_type_inference

    def shape_type_inference(graph: Any, params: Mapping[str, Any], *args: Any) -> Any:
        return original(graph, {k: v for k, v in params.items() if _nbytes(v) < SHAPE_INFERENCE_MAX_BYTES}, *args)

    jit._jit_pass_onnx_graph_shape_type_inference = shape_type_inference
    try:
        yield
    finally:
        jit._jit_pass_onnx_graph_shape_type_inference = original


def _stand_ins(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with a distinct one-element stand-in for each big weight no other one has the layout of.

    The stand-ins are int64 of shape ``(1,) * rank``, a layout no weight has (``rank`` grows until none does), so
    the deduplication only compares them with each other, and their values differ.
    """
    import torch

    def layout(t: Any) -> tuple[Any, ...]:
        return (t.dtype, tuple(t.shape), tuple(t.stride()))

    tensors = [t for t in params.values() if isinstance(t, torch.Tensor)]
    counts: dict[tuple[Any, ...], int] = {}
    for t in tensors:
        counts[layout(t)] = counts.get(layout(t), 0) + 1
    rank = 1
    while (torch.int64, (1,) * rank, (1,) * rank) in counts:
        rank += 1
    light = dict(params)
    for i, (name, t) in enumerate(params.items()):
        if isinstance(t, torch.Tensor) and counts[layout(t)] == 1 and _nbytes(t) >= SHAPE_INFERENCE_MAX_BYTES:
            light[name] = torch.full((1,) * rank, i, dtype=torch.int64)
    return light


@contextlib.contextmanager
def _cheap_deduplication(jit: Any) -> Iterator[None]:
    """The exporter's initializer deduplication given stand-ins for the big weights nothing could equal, in the block.

    A weight no other one shares its dtype, sizes and strides with cannot be merged (by data or by value), yet
    the pass copied one such weight whole (+0.27 GB of anonymous memory on the 3-layer 1.1B Llama: the folded,
    transposed LM head is 262 MB); each gets a stand-in instead (:func:`_stand_ins`). The pass's result is kept
    (the names it keeps, the Identity nodes it adds for equal weights), not the values it returns:
    :func:`attach_weights` takes the values from the exporter's own params.
    """
    original = jit._jit_pass_onnx_deduplicate_initializers

    def deduplicate(graph: Any, params: Mapping[str, Any], *args: Any) -> Any:
        return original(graph, _stand_ins(params), *args)

    jit._jit_pass_onnx_deduplicate_initializers = deduplicate
    try:
        yield
    finally:
        jit._jit_pass_onnx_deduplicate_initializers = original


def export_torchscript_streamed(module: Any, args: tuple[Any, ...], path: Path, **kwargs: Any) -> Path:
    """``torch.onnx.export(module, args, path, dynamo=False, **kwargs)`` with the weights streamed.

    The graph is written to ``path`` without its weights; they go to ``path``'s data file
    (:func:`mpinfer.modelio.data_file`) as external data, tensors under EXTERNAL_DATA_SIZE_THRESHOLD bytes
    embedded. Falls back to the plain export (weights in the proto) when the exporter cannot be wrapped.

    Returns:
        ``path``.
    """
    import torch

    utils = _exporter_module()
    if utils is None:
        logger.info("the TorchScript exporter's internals are not the ones known here: weights exported in the proto")
        with _legacy_exporter_chosen():
            torch.onnx.export(module, args, str(path), dynamo=False, **kwargs)
        return path
    with (_captured_params(utils) as params, _small_params_for_shape_inference(utils._C),
          _cheap_deduplication(utils._C), _legacy_exporter_chosen()):
        torch.onnx.export(module, args, str(path), dynamo=False, export_params=False, **kwargs)
    attach_weights(path, params, kwargs.get("input_names") or ())
    return path


def _write_tensor(f: Any, tensor: Any) -> int:
    """Append ``tensor``'s bytes (C order, little-endian as ONNX stores them) to ``f``; returns the byte count.

    A non-contiguous view (a folded transpose) is made contiguous SLICE_BYTES at a time along its first dim.
    """
    import torch

    t = tensor.detach()
    t = t.reshape(1) if t.dim() == 0 else t
    if t.numel() == 0:
        return 0
    row = max(1, t[0].numel() * t.element_size())
    step = max(1, SLICE_BYTES // row)
    written = 0
    for start in range(0, t.shape[0], step):
        piece = t[start:start + step].contiguous().reshape(-1).view(torch.uint8).numpy()
        f.write(memoryview(piece))
        written += piece.nbytes
    return written


def _raw_bytes(tensor: Any) -> bytes:
    import io

    buf = io.BytesIO()
    _write_tensor(buf, tensor)
    return buf.getvalue()


def attach_weights(path: Path, params: Mapping[str, Any], input_names: Sequence[str] = ()) -> None:
    """Turn the graph inputs of ``path`` named in ``params`` into initializers with those tensors' values.

    Tensors of EXTERNAL_DATA_SIZE_THRESHOLD bytes or more are written to ``path``'s data file one at a time
    (aligned to DATA_ALIGNMENT, as :func:`mpinfer.modelio.save_streamed` writes them), smaller ones embedded.

    Raises:
        ExportError: A graph input is neither a model input (``input_names``) nor a weight, or a weight's type
            disagrees with its tensor.
    """
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    unknown = [vi.name for vi in graph.input if vi.name not in params and vi.name not in input_names]
    if input_names and unknown:
        raise ExportError(f"The TorchScript exporter's graph takes inputs {unknown[:5]} that are neither the model's "
                          f"inputs {list(input_names)} nor its weights. Hint: this is a bug in mpinfer's streamed "
                          "export; try --exporter dynamo.")
    data = data_file(path)
    weights = [vi for vi in graph.input if vi.name in params]
    keep = [vi for vi in graph.input if vi.name not in params]
    with open(data, "wb") as f:
        for vi in weights:
            graph.initializer.append(_initializer(vi, params[vi.name], f, data.name))
    del graph.input[:]
    graph.input.extend(keep)
    if not data.stat().st_size:
        data.unlink()
    path.write_bytes(model.SerializeToString())  # the graph alone: its weights are in the data file
    logger.debug("attached %d weights to %s", len(weights), path.name)


def _initializer(vi: Any, tensor: Any, f: Any, location: str) -> Any:
    """The initializer of graph input ``vi`` holding ``tensor``; its data appended to ``f`` unless small."""
    import onnx

    elem = vi.type.tensor_type.elem_type
    try:
        size = onnx.helper.tensor_dtype_to_np_dtype(elem).itemsize if elem != onnx.TensorProto.BFLOAT16 else 2
    except KeyError:  # no type, or one without a numpy equivalent
        size = -1
    if size != tensor.element_size():
        raise ExportError(f"Weight '{vi.name}': the graph says ONNX type {elem} ({size} bytes), the torch tensor is "
                          f"{tensor.dtype}. Hint: this is a bug in mpinfer's streamed export; try --exporter dynamo.")
    init = onnx.TensorProto(name=vi.name, data_type=elem, dims=list(tensor.shape))
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < EXTERNAL_DATA_SIZE_THRESHOLD:
        init.raw_data = _raw_bytes(tensor)
        return init
    offset = f.tell()
    if nbytes >= DATA_ALIGNMENT and offset % DATA_ALIGNMENT:
        f.write(b"\0" * (DATA_ALIGNMENT - offset % DATA_ALIGNMENT))
        offset = f.tell()
    written = _write_tensor(f, tensor)
    init.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(written))):
        init.external_data.add(key=key, value=value)
    return init


def adopt_external_data(model: Any, source_dir: Path, staged: Path, data_name: str) -> bool:
    """Write ``model`` (its graph) at ``staged`` with the exporter's data file moved, not copied, to ``data_name``.

    Only when every external tensor of ``model`` is in one file of ``source_dir`` (what both exporters write
    here); False, with nothing done, otherwise. Embedded tensors stay embedded.
    """
    from onnx.external_data_helper import uses_external_data as external

    from mpinfer.modelio import ir_version_for, iter_graphs

    tensors = [t for g in iter_graphs(model.graph) for t in g.initializer if external(t)]
    locations = {e.value for t in tensors for e in t.external_data if e.key == "location"}
    if len(locations) != 1:
        return False
    source = Path(source_dir) / locations.pop()
    if not source.is_file() or source.resolve().parent != Path(source_dir).resolve():
        return False
    source.replace(staged.parent / data_name)
    for t in tensors:
        for e in t.external_data:
            if e.key == "location":
                e.value = data_name
    model.ir_version = ir_version_for(model)
    staged.write_bytes(model.SerializeToString())
    return True


# What an onnxscript pattern matcher keeps of its last match (onnxscript 0.7: the graph, the node, the tracer); its
# next match sets them again.
_MATCHER_STATE = ("_graph", "_current_node", "_tracer")


def release_dynamo_weights(prog: Any) -> None:
    """Let the torch weights go with the torch model once the dynamo export is saved.

    The program's initializers wrap the torch weights (views, no copies), and onnxscript's rewrite rules,
    module-level objects, keep the last node and match they saw, hence the graph and the values they reach, after
    the export returns: the weights outlived the torch model (a 1 GB model's export peaked at 2.5x its size with
    ONNX Runtime's parity session on top). The rules' matchers drop their last match (each new match resets
    them), and the program's initializers let go of their data.
    """
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("onnxscript.rewriter"):
            continue
        for obj in list(vars(mod).values()):
            for rule in obj if isinstance(obj, (list, tuple)) else (obj,):
                matcher = getattr(rule, "_matcher", None)
                if matcher is None:
                    continue
                for attr in _MATCHER_STATE:
                    if getattr(matcher, attr, None) is not None:
                        setattr(matcher, attr, None)
                match = getattr(matcher, "_match", None)
                if match is not None:
                    matcher._match = type(match)()
    graph = getattr(getattr(prog, "model", None), "graph", None)
    for value in getattr(graph, "initializers", {}).values():
        value.const_value = None


@contextlib.contextmanager
def _legacy_exporter_chosen() -> Iterator[None]:
    """Silence torch's "legacy TorchScript-based ONNX export" deprecation: mpinfer took that exporter on purpose.

    It runs only as the fallback ``--exporter auto`` names the reason for, or because the user asked for
    ``--exporter torchscript``; torch's warning would only repeat that, once per export.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using the legacy TorchScript-based ONNX export",
                                category=DeprecationWarning)
        yield
