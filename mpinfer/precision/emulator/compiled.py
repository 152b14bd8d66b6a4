"""The emulator's compiled graph: steps, graphs (If/Loop/Scan bodies included), external weights, node order.

:class:`~mpinfer.precision.emulator.emulate.GraphEmulator` compiles a graph once into :class:`_Graph` (its steps in
producer-first order, each with its kernel and bodies) and runs it per call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpinfer.modelio import tensor_array
from mpinfer.precision.emulator.kernels import NodeInfo


@dataclass
class _Step:
    info: NodeInfo
    inputs: list[str]
    outputs: list[str]
    kernel: Callable[..., list[np.ndarray]] | None
    bodies: dict[str, _Graph]
    reads: set[str]


@dataclass
class _Graph:
    prefix: str
    steps: list[_Step]
    inputs: list[str]
    outputs: list[str]
    output_types: list[int]
    initializers: dict[str, Any]  # arrays, or _External weights mapped when a node reads them
    outer_reads: set[str]


class _External:
    """A weight kept in external data: memory-mapped each time a node reads it, unmapped when the node is done."""

    __slots__ = ("base_dir", "tensor")

    def __init__(self, tensor: Any, base_dir: str) -> None:
        self.tensor, self.base_dir = tensor, base_dir

    def array(self) -> np.ndarray:
        """The weight's array, memory-mapped from the external data file."""
        return np.asarray(tensor_array(self.tensor, self.base_dir))


def _resolved(value: Any) -> Any:
    """``value``, or the array of an external weight."""
    return value.array() if isinstance(value, _External) else value


def _toposort(graph: Any, inits: Mapping[str, Any]) -> list[Any]:
    """Graph nodes in an order where producers come first (ONNX requires it; some exporters forget)."""
    produced = {o for node in graph.node for o in node.output if o}
    ready = set(inits) | {vi.name for vi in graph.input}
    pending, order = list(graph.node), []
    while pending:
        rest = []
        for node in pending:
            if all(i in ready or i not in produced for i in node.input if i):
                order.append(node)
                ready.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):  # a cycle or a dangling name: keep the file's order
            order.extend(rest)
            break
        pending = rest
    return order


def _addresses_under(step: _Step) -> list[str]:
    out = [step.info.address]
    todo = list(step.bodies.values())
    while todo:
        g = todo.pop()
        for s in g.steps:
            out.append(s.info.address)
            todo.extend(s.bodies.values())
    return out


def _last_uses(graph: _Graph) -> dict[str, int]:
    last: dict[str, int] = {}
    for idx, step in enumerate(graph.steps):
        for name in step.reads:
            last[name] = idx
    for name in graph.outputs:
        last[name] = len(graph.steps)  # never freed
    return last
