"""The strict emulator: mpinfer's numpy executor of ONNX graphs with FP16/BF16 rounding per node.

``emulate.GraphEmulator`` runs a graph node by node at a chosen precision per node; ``kernels/`` holds one
module per op family and the numerics they share (``kernels/numerics.py``: rounding, storage, loading),
with ONNX Runtime's CPU kernels for the steps whose result is fixed (``kernels/ortexec.py``). What "strict"
promises and what it does not: docs/numerics.md.
"""
