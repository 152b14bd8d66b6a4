"""Op tables of the precision policy: which ONNX op types go low, stay FP32, or follow their inputs.

Seeded from torch.amp's CUDA autocast lists (``autocast_mode.cpp``: ops that autocast to lower precision, and
ops that autocast to float32) mapped to ONNX op types; the rules of :mod:`mpinfer.precision.rules.classify` read
them.
"""

from __future__ import annotations

# torch.amp CUDA "lower_precision_fp" list, as ONNX ops: matrix engines, FP32 accumulate on tensor cores.
FP16_SAFE_OPS = frozenset(
    {
        "Conv",
        "ConvTranspose",
        "MatMul",
        "Gemm",
        "Einsum",
        "PRelu",
        "LSTM",
        "GRU",
        "RNN",
        "Attention",
        "DeformConv",
        "ConvInteger",
    }
)
# torch.amp CUDA "fp32" list, as ONNX ops: transcendental functions whose range overflows FP16,
# reductions and normalisations (long accumulations), softmax, losses, cumulative ops.
KEEP_FP32_OPS = frozenset(
    {
        "Exp",
        "Log",
        "Pow",
        "Reciprocal",
        "Acos",
        "Asin",
        "Acosh",
        "Asinh",
        "Atanh",
        "Cosh",
        "Sinh",
        "Tan",
        "Softplus",
        "Softmax",
        "LogSoftmax",
        "CumSum",
        "ReduceSum",
        "ReduceMean",
        "ReduceProd",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceSumSquare",
        "ReduceL1",
        "ReduceL2",
        "LpNormalization",
        "LayerNormalization",
        "GroupNormalization",
        "InstanceNormalization",
        "MeanVarianceNormalization",
        "RMSNormalization",
        "SkipLayerNormalization",
        "SoftmaxCrossEntropyLoss",
        "NegativeLogLikelihoodLoss",
        "LpPool",
        "GlobalLpPool",
        "Det",
        "DFT",
        "STFT",
        "MelWeightMatrix",
        "BlackmanWindow",
        "HammingWindow",
        "HannWindow",
    }
)
# Ops that compute indices, positions or shapes: rounding their float inputs moves boxes and pixels.
INDEX_LIKE_OPS = frozenset(
    {
        "Range",
        "TopK",
        "NonMaxSuppression",
        "ArgMax",
        "ArgMin",
        "NonZero",
        "Unique",
        "RoiAlign",
        "GridSample",
        "AffineGrid",
        "Multinomial",
        "Bernoulli",
    }
)
# Ops that cannot run low at all: bit reinterpretation (BitCast needs equal widths) and function ops whose
# ONNX Runtime expansion has FP32-only constants (MeanVarianceNormalization).
NEVER_LOW_OPS = frozenset({"BitCast", "MeanVarianceNormalization"})
# Control flow: the container keeps an FP32 interface; the nodes of its bodies are planned one by one.
CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan"})
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
