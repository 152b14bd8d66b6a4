"""Strict FP16/BF16 numerics on CPU: a converted model run by :class:`GraphEmulator`.

Every node computes in the dtype of its float inputs: an FP16 node rounds each elementary step to FP16
(matrix products accumulate in FP32, like tensor cores), Casts do what they say. ONNX Runtime's CPU
provider instead keeps FP32 intermediates between the Casts it inserts around ops without FP16 kernels,
and cannot run BF16 MatMul/Conv at all; this runner is how mpinfer checks FP16/BF16 models on a CPU.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.backends.base import Runner
from mpinfer.errors import BackendUnavailableError, format_message
from mpinfer.modelio import load_onnx
from mpinfer.precision.emulator.emulate import GraphEmulator
from mpinfer.specs import TensorSpec, specs_from_onnx

logger = logging.getLogger(__name__)


def low_precisions_in(model: Any) -> list[str]:
    """The low float dtypes ("fp16", "bf16") a model stores or casts to, in that order."""
    from onnx import AttributeProto, TensorProto

    found: set[int] = set()

    def walk(graph: Any) -> None:
        for t in graph.initializer:
            found.add(t.data_type)
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            found.add(vi.type.tensor_type.elem_type)
        for node in graph.node:
            for a in node.attribute:
                if a.name == "to" and a.type == AttributeProto.INT:
                    found.add(a.i)
                elif a.type == AttributeProto.TENSOR:
                    found.add(a.t.data_type)
                elif a.type == AttributeProto.GRAPH:
                    walk(a.g)
                elif a.type == AttributeProto.GRAPHS:
                    for g in a.graphs:
                        walk(g)

    walk(model.graph)
    names = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}
    return [names[k] for k in (TensorProto.FLOAT16, TensorProto.BFLOAT16) if k in found]


class StrictRunner(Runner):
    """Runs a (mixed-precision) ONNX model with strict per-node FP16/BF16 arithmetic in numpy.

    Args:
        model: Path to a .onnx file or an ``onnx.ModelProto``.
        name: Display name (defaults to the file name).
    """

    def __init__(self, model: Any, name: str | None = None) -> None:
        default = os.path.basename(str(model)) if isinstance(model, (str, os.PathLike)) else "onnx-model"
        super().__init__(name or default)
        self._model = model
        self._emulator: Any = None
        self._proto: Any = None
        self._specs: list[TensorSpec] = []

    def _activate(self) -> None:

        start = time.perf_counter()
        base_dir = ""
        if isinstance(self._model, (str, os.PathLike)):  # external weights: memory-mapped per node, never loaded
            proto, base_dir = load_onnx(self._model, load_external_data=False), str(Path(self._model).resolve().parent)
        else:
            proto = self._model
        emulator = GraphEmulator(proto, follow_input_dtypes=True, base_dir=base_dir)
        missing = emulator.unsupported_ops()
        if missing:
            raise BackendUnavailableError(
                format_message(
                    f"Strict numerics for '{self.name}'",
                    f"ops without a strict kernel: {', '.join(sorted(missing))}",
                    "standard ONNX ops",
                    "use ONNX Runtime numerics (--numerics ort) for this model",
                )
            )
        self._proto, self._emulator = proto, emulator
        self._specs = specs_from_onnx(proto)
        logger.debug("strict runner '%s' ready in %.2fs", self.name, time.perf_counter() - start)

    def input_specs(self) -> list[TensorSpec]:
        """The model's graph inputs."""
        return list(self._specs)

    def output_names(self) -> list[str]:
        """The model's graph outputs, in order."""
        return [o.name for o in self._proto.graph.output]

    def _infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self._emulator.run(feeds).outputs
        return {name: outputs[name] for name in self.output_names()}

    def _deactivate(self) -> None:
        self._emulator = None

    def describe(self) -> dict[str, Any]:
        """Backend facts: ``backend`` mpinfer-strict, ``numerics`` strict-fp16 / strict-bf16 / strict-fp32."""
        info = super().describe()
        proto = self._proto
        if proto is None:

            proto = (
                load_onnx(self._model, load_external_data=False)
                if isinstance(self._model, (str, os.PathLike))
                else self._model
            )
        lows = low_precisions_in(proto)
        info.update(
            {
                "backend": "mpinfer-strict",
                "device": "cpu",
                "numerics": "strict-" + ("+".join(lows) if lows else "fp32"),
            }
        )
        if self._emulator is not None:
            info["fallback_nodes"] = len(self._emulator.fallback_ops())
        return info
