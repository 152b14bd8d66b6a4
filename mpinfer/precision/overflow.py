"""``--keep-fp32-from overflow.json``: map the AMP trainer's overflowing torch modules to ONNX nodes.

Uses :func:`mpinfer.export.names.nodes_for_module` when the export stage provides it, else a matcher for
the two exporters' conventions: TorchScript names nodes by scope (``/features/features.3/Conv``), dynamo
records ``pkg.torch.onnx.name_scopes`` (``['', 'features', 'features.3', 'conv2d']``) per node.
"""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path
from typing import Any

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.modelio import iter_nodes

logger = logging.getLogger(__name__)


def _torchscript_module(name: str) -> str:
    """``/features/features.3/Conv`` → ``features.3``; ``/layer1/conv1/Conv`` → ``layer1.conv1``."""
    parts = [p for p in name.split("/") if p][:-1]
    path = ""
    for seg in parts:
        if path and seg.startswith(path + "."):
            path = seg
        elif "." in seg and not path:
            path = seg
        else:
            path = f"{path}.{seg}" if path else seg
    return path


def _scopes(node: Any) -> list[str]:
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                value = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return []
            return [str(v) for v in value] if isinstance(value, (list, tuple)) else []
    return []


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def match_module(model: Any, module: str) -> list[str]:
    """Addresses of the nodes whose torch module scope is ``module`` or inside it."""
    try:
        from mpinfer.export.names import nodes_for_module  # type: ignore[import-not-found]
    except ImportError:
        nodes_for_module = None
    if nodes_for_module is not None:
        return list(nodes_for_module(model, module))
    out = []
    for ref in iter_nodes(model.graph):
        scopes = _scopes(ref.node)
        if scopes:
            if any(_inside(s, module) for s in scopes):
                out.append(ref.address)
        elif ref.node.name.startswith("/") and _inside(_torchscript_module(ref.node.name), module):
            out.append(ref.address)
    return out


def overflow_nodes(model: Any, path: Path) -> dict[str, str]:
    """Node address → detail for every module listed in an overflow.json.

    Raises:
        InvalidInputError: Unreadable or malformed file.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        modules = data["modules"]
        if not isinstance(modules, list):
            raise TypeError("modules is not a list")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InvalidInputError(
            format_message(
                f"Overflow file '{path}'",
                f"an unreadable or malformed file ({err})",
                'JSON with "modules": [{"module": "features.3", ...}] as written by `mpinfer train`',
            )
        ) from err
    out: dict[str, str] = {}
    unmatched = []
    for entry in modules:
        module = str(entry.get("module", "")) if isinstance(entry, dict) else ""
        if not module:
            continue
        nodes = match_module(model, module)
        if not nodes:
            unmatched.append(module)
        frac = entry.get("overflow_frac", 0.0)
        for addr in nodes:
            out.setdefault(
                addr,
                f"module '{module}' overflowed FP16 in training ({entry.get('kind', 'activation')}, "
                f"{float(frac):.2%} of steps)",
            )
    if unmatched:
        logger.warning("overflow.json modules with no matching ONNX node: %s", ", ".join(unmatched[:10]))
    return out
