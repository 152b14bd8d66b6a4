"""A torch model's outputs (tensors, tuples, dicts, model-output objects) as one flat list of tensors.

The exporter names the ONNX outputs in this order and parity compares in it, so both take it from here.
"""

from __future__ import annotations

from typing import Any


def flatten_outputs(out: Any) -> list[Any]:
    """Flatten a model's (nested) outputs into a list of tensors."""
    import torch
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(out)
    return [x for x in leaves if isinstance(x, torch.Tensor)]
