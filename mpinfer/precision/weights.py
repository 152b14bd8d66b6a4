"""The input's embedded weights: their bytes, and the staged output's weights brought back into its .onnx."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mpinfer.modelio import (
    DATA_ALIGNMENT,
    EXTERNAL_DATA_THRESHOLD,
    data_file,
    iter_graphs,
    load_onnx,
    small_enough_to_size,
)


def embedded_bytes(model: Any) -> int:
    """The bytes of the initializers stored in ``model``'s proto itself (bodies included)."""
    return sum(len(t.raw_data) for g in iter_graphs(model.graph) for t in g.initializer)


def _embed_weights(path: Path) -> None:
    """Bring the staged output's weights back into its .onnx when the whole fits one file (under 2 GB).

    What the in-memory path writes (:func:`mpinfer.modelio.save_onnx`'s rule): the converted weights are read once,
    the model serialized once, and the data file removed.
    """
    data = data_file(path)
    if not data.exists():
        return
    graph = load_onnx(path, load_external_data=False)
    tensors = [t for g in iter_graphs(graph.graph) for t in g.initializer if t.external_data]
    if data.stat().st_size - DATA_ALIGNMENT * len(tensors) >= EXTERNAL_DATA_THRESHOLD:
        return  # (the tensors alone pass 2 GB, whatever their padding)
    del graph, tensors
    model = load_onnx(path)
    for g in iter_graphs(model.graph):
        for t in g.initializer:
            t.ClearField("data_location")  # (load_external_data_for_model sets it to DEFAULT: as if never external)
    if not small_enough_to_size(model) or model.ByteSize() >= EXTERNAL_DATA_THRESHOLD:
        return
    tmp = path.with_name(path.name + ".embedded")
    tmp.write_bytes(model.SerializeToString(deterministic=True))
    del model
    os.replace(tmp, path)
    data.unlink()
