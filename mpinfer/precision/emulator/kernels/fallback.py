"""Fallback for ops without an mpinfer kernel: onnx.reference computes them in FP32, the executor rounds.

The result is honest for ops whose arithmetic is one elementary step (a gather, a comparison, a
rearrangement); for multi-step arithmetic ops it understates low-precision error the way ORT-CPU does, and
:meth:`GraphEmulator.fallback_ops` lists such nodes so reports can say so.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from mpinfer.precision.emulator.kernels.numerics import NodeInfo, Numerics


@functools.lru_cache(maxsize=1024)
def reference_available(domain: str, op_type: str, opset: int) -> bool:
    """True when onnx.reference has an implementation of the op."""
    from onnx.reference.ops import load_op

    try:
        load_op(domain or "", op_type, opset)
    except Exception:  # onnx raises ValueError/RuntimeError/NotImplementedError for unknown ops  # noqa: BLE001
        return False
    return True


def reference_kernel(n: NodeInfo, num: Numerics, x: list[Any]) -> list[Any]:
    """Run one node through onnx.reference on the (already rounded, float32) inputs."""
    ev = n.cache.get("reference")
    if ev is None:
        from onnx.reference import ReferenceEvaluator

        ev = ReferenceEvaluator(n.node, opsets={n.domain or "": n.opset})
        n.cache["reference"] = ev
    feeds = {name: v for name, v in zip(n.node.input, x, strict=False) if name}
    outs = ev.run(None, feeds)
    return [o if isinstance(o, (list, type(None))) else np.asarray(o) for o in outs]
