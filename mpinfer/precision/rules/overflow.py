"""``--keep-fp32-from overflow.json``: map the AMP trainer's overflowing torch modules to ONNX nodes.

Module paths map to nodes through :func:`mpinfer.export.names.nodes_for_module` (TorchScript node names
such as ``/features/features.3/Conv``, dynamo's ``pkg.torch.onnx.name_scopes`` metadata).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.export.names import nodes_for_module

logger = logging.getLogger(__name__)


def match_module(model: Any, module: str) -> list[str]:
    """Addresses of the nodes whose torch module scope is ``module`` or inside it."""
    return list(nodes_for_module(model, module))


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
