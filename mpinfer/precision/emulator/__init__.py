"""The strict emulator: mpinfer's numpy executor of ONNX graphs with FP16/BF16 rounding per node.

``emulate.GraphEmulator`` runs a graph node by node at a chosen precision per node; ``kernels/`` holds one
module per op family and the numerics they share (``kernels/numerics.py``: rounding, storage, loading),
with ONNX Runtime's CPU kernels for the steps whose result is fixed (``kernels/ortexec.py``). What "strict"
promises and what it does not: docs/numerics.md.
"""

from __future__ import annotations

from mpinfer.precision.emulator.castgraph import (
    ENGINE_CASTS,
    ENGINE_EMULATOR,
    EXACT_OPS,
    ROUNDED_OPS,
    SHAPE_OPS,
    CastGraph,
    CastGraphSession,
    StrictModelRunner,
    cast_graph,
    may_qualify,
    open_cast_session,
)
from mpinfer.precision.emulator.emulate import (
    CONTROL_FLOW,
    EXPLICIT_DTYPE_OPS,
    SKIP_ROUNDING,
    EmulatorRun,
    GraphEmulator,
    Observer,
)
from mpinfer.precision.emulator.kernels import ortexec
from mpinfer.precision.emulator.kernels.numerics import is_float, is_low_float
from mpinfer.precision.emulator.runner import StrictRunner, low_precisions_in

__all__ = [
    "CONTROL_FLOW",
    "CastGraph",
    "CastGraphSession",
    "ENGINE_CASTS",
    "ENGINE_EMULATOR",
    "EXACT_OPS",
    "EXPLICIT_DTYPE_OPS",
    "EmulatorRun",
    "GraphEmulator",
    "Observer",
    "ROUNDED_OPS",
    "SHAPE_OPS",
    "SKIP_ROUNDING",
    "StrictModelRunner",
    "StrictRunner",
    "cast_graph",
    "is_float",
    "is_low_float",
    "low_precisions_in",
    "may_qualify",
    "open_cast_session",
    "ortexec",
]
