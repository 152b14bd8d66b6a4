"""Map torch module paths (``features.3``) to the ONNX nodes exported from them.

Both exporters leave the module path behind: the dynamo exporter in each node's metadata
(``pkg.torch.onnx.name_scopes``, a list of module paths from the root), the TorchScript exporter in node
names (``/features/features.3/Conv``). This is how ``overflow.json`` from the trainer, which names modules,
turns into ``--keep-node`` decisions in ``convert``.
"""

from __future__ import annotations

import ast
from typing import Any

from mpinfer.modelio import iter_nodes


def node_module_paths(node: Any) -> list[str]:
    """The module paths a node was exported from, outermost first (empty when unknown)."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                scopes = []
            # the last entry is the FX node's own name, not a module
            return [s for s in scopes[:-1] if s]
    name = node.name or ""
    if not name.startswith("/"):
        return []
    segments = name.strip("/").split("/")[:-1]
    paths: list[str] = []
    current = ""
    for seg in segments:
        if current and seg.startswith(current + "."):
            current = seg  # TorchScript repeats the full dotted path for container children
        elif "." in seg and not current:
            current = seg
        else:
            current = f"{current}.{seg}" if current else seg
        paths.append(current)
    return paths


def nodes_for_module(model: Any, module_path: str) -> list[str]:
    """Addresses of main-graph and subgraph nodes exported from ``module_path`` or its children.

    Args:
        model: An ``onnx.ModelProto`` (nodes named, as export writes them).
        module_path: A dotted torch module path, e.g. ``features.3`` or ``blocks.0.attn``.

    Returns:
        Node addresses in graph order.
    """
    target = module_path.strip(".")
    refs = list(iter_nodes(model.graph))

    def inside(node: Any, path: str) -> bool:
        return any(p == path or p.startswith(path + ".") for p in node_module_paths(node))

    hits = [r.address for r in refs if inside(r.node, target)]
    if hits:
        return hits
    # The dynamo exporter folds an eval-mode BatchNorm into the Conv before it and credits the fused Conv to
    # the BatchNorm module (``features.4`` for ``features.3``'s Conv). Follow that one fusion: the next
    # sibling's Conv/ConvTranspose/Gemm node is this module's computation.
    parent, _, index = target.rpartition(".")
    if index.isdigit():
        sibling = f"{parent}.{int(index) + 1}" if parent else str(int(index) + 1)
        return [r.address for r in refs if inside(r.node, sibling) and r.node.op_type in _FUSION_TARGETS]
    return []


# Ops a following BatchNorm is folded into by the dynamo exporter's optimizer.
_FUSION_TARGETS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
