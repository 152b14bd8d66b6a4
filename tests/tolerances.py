"""Tolerances derived from the floating-point format, for values that kernels may compute in another order.

Two correct float computations of the same value need not agree bit for bit: onnxruntime, torch and BLAS
split sums across threads, pick kernels by CPU features and shapes, block and vectorise reductions, and fuse
multiply-adds. A test comparing such values must allow what rounding allows, and no more, or it flakes (or
hides bugs). The bound used here (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1
and §4.2): with unit roundoff ``u = eps / 2`` of the format (``eps`` from ``finfo``: 2**-23 for float32), a sum
of ``n`` terms ``t_i`` evaluated in *any* order, products included (a dot product, one output of a MatMul or a
Conv, with or without FMA), satisfies

    |fl(sum t_i) - sum t_i| <= gamma_n * sum |t_i|,     gamma_n = n u / (1 - n u).

Two evaluations (two thread counts, two libraries) are each within that of the exact value, so they differ by
at most ``2 gamma_n sum|t_i|``: the ulp of the format, at the magnitude of the terms, times the reduction
length. ``magnitude`` is ``sum|t_i|`` (or a bound on it); where the terms do not cancel (all of one sign) it is
simply ``|value|``. A computation of ``stages`` such reductions in a chain (layers of a network whose
activations stay at about ``magnitude`` and whose other steps are 1-Lipschitz: ReLU, GELU, softmax, a
LayerNorm whose inputs are not a large common offset plus a small spread) adds the stages' bounds.

This is a worst-case bound, so a test using it cannot flake on arithmetic order; rounding errors usually
partly cancel (typically ``sqrt(n) u`` rather than ``n u``), so the bound is looser than what is observed. A
test should keep the bound small against the change it exists to detect (say so next to the assert).

Whole networks (tens of chained reductions, normalisations between them) make the worst case too loose to
tell FP32 from FP16 arithmetic. :func:`network_atol` uses the statistical bound instead: the rounding errors
of a reordered sum are independent, zero-mean and at most ``u`` relative each (uniform: a standard deviation
of ``u / sqrt(3)``), so one evaluation strays by a standard deviation of at most ``u sqrt(n / 3)`` times the
magnitude, two evaluations differ by ``sqrt(2)`` times that, and ``stages`` chained reductions add in
quadrature. The tolerance ``10 eps sqrt(n stages)`` times the magnitude is about 24 such standard
deviations: no run reaches it by chance. :func:`onnx_reductions` reads ``n`` and ``stages`` off an ONNX graph.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from mpinfer.report.plan_check import error_amplitude  # (the one conversion: compare's plan check uses it)


def eps(dtype: Any = np.float32) -> float:
    """Machine epsilon of ``dtype`` (the gap from 1.0 to the next value): 2**-23 float32, 2**-10 float16."""
    return float(ml_dtypes.finfo(np.dtype(dtype)).eps)


def gamma(n: int, dtype: Any = np.float32) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative bound of an ``n``-term sum in ``dtype``."""
    nu = max(int(n), 1) * eps(dtype) / 2
    assert nu < 1, f"a {n}-term sum in {np.dtype(dtype)} has no error bound (n u >= 1)"
    return nu / (1 - nu)


def reorder_atol(dtype: Any = np.float32, *, n: int = 1, magnitude: float = 1.0, stages: int = 1) -> float:
    """Largest difference two evaluation orders can make to a value (see the module docstring).

    Args:
        dtype: The format the arithmetic runs in (float32 for FP32 kernels, float16 for FP16 ones).
        n: The reduction length (the inner dimension of a MatMul, ``C_in * kH * kW`` of a Conv, the axis
            length of a ReduceSum or LayerNorm); 1 for elementwise results, which differ only by their own
            final rounding.
        magnitude: ``sum |t_i|`` of the reduction, or a bound on it (``|value|`` when terms do not cancel).
        stages: How many such reductions are chained (their bounds add).

    Returns:
        The absolute tolerance: ``stages * (2 gamma_n + eps) * magnitude`` (``eps``: each side's final
        rounding to ``dtype``, half an ulp each).
    """
    return stages * (2 * gamma(n, dtype) + eps(dtype)) * float(magnitude)


def assert_reorder_close(
    actual: Any, desired: Any, dtype: Any = np.float32, *, n: int = 1, magnitude: Any = None, stages: int = 1,
    rtol: float = 0.0, err_msg: str = "",
) -> None:
    """Every value within :func:`reorder_atol` (plus ``rtol * |desired|``) of ``desired``; NaN/inf must match.

    ``magnitude`` may be an array broadcast against the values (each output's own ``sum |t_i|``, e.g. the
    same MatMul or Conv run on absolute values); it defaults to the largest ``|desired|`` (right when the
    reduction's terms do not cancel).
    """
    act, want = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    assert act.shape == want.shape, (err_msg, act.shape, want.shape)
    if magnitude is None:
        finite = np.abs(want[np.isfinite(want)])
        magnitude = float(finite.max()) if finite.size else 0.0
    atol = stages * (2 * gamma(n, dtype) + eps(dtype)) * np.asarray(magnitude, np.float64)
    with np.errstate(invalid="ignore"):
        ok = (np.abs(act - want) <= atol + rtol * np.abs(want)) | (act == want) | (np.isnan(act) & np.isnan(want))
    if not ok.all():
        bad = np.flatnonzero(~np.broadcast_to(ok, want.shape))
        i = bad[np.argmax(np.abs(act - want).reshape(-1)[bad])]
        tol = np.broadcast_to(atol + rtol * np.abs(want), want.shape).reshape(-1)[i]
        raise AssertionError(
            f"{err_msg}: {bad.size} of {want.size} values differ by more than float reordering allows; worst at "
            f"flat index {i}: {act.reshape(-1)[i]!r} vs {want.reshape(-1)[i]!r}, tolerance {tol:.3g}"
        )


# Ops whose outputs are sums over an axis (their rounding depends on the order kernels add in).
REDUCING_OPS = frozenset({
    "MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "LayerNormalization", "GroupNormalization",
    "InstanceNormalization", "Softmax", "LogSoftmax", "ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL2",
    "ReduceLogSumExp", "GlobalAveragePool", "AveragePool", "LpNormalization", "Attention",
})


def onnx_reductions(model: Any) -> tuple[int, int]:
    """``(n, stages)`` of an ONNX model: a bound on its longest reduction, and how many reducing nodes it has.

    ``n`` is the largest dimension of any initializer or graph input, or ``prod(dims[1:])`` of a Conv's
    weight (``C_in kH kW``), so it bounds every MatMul/Gemm/Conv inner dimension and normalised axis; nodes
    inside If/Loop bodies count once each.
    """
    dims: list[int] = [1]
    stages = 0

    def walk(graph: Any) -> None:
        nonlocal stages
        conv_weights = {n.input[1] for n in graph.node if n.op_type in ("Conv", "ConvTranspose")}
        for t in graph.initializer:
            shape = [int(d) for d in t.dims]
            if shape:
                dims.append(int(np.prod(shape[1:])) if t.name in conv_weights else max(shape))
        for vi in graph.input:
            dims.extend(int(d.dim_value) for d in vi.type.tensor_type.shape.dim if d.dim_value > 0)
        for node in graph.node:
            stages += node.op_type in REDUCING_OPS
            for attr in node.attribute:
                if attr.g.node:
                    walk(attr.g)
                for g in attr.graphs:
                    walk(g)

    walk(model.graph)
    return max(dims), max(stages, 1)


def network_atol(dtype: Any = np.float32, *, n: int, stages: int, magnitude: float) -> float:
    """Statistical tolerance of a deep chain of reductions (see the module docstring): ``10 eps sqrt(n stages) M``."""
    return 10 * eps(dtype) * float(np.sqrt(max(n, 1) * max(stages, 1))) * float(magnitude)


def assert_onnx_outputs_close(
    actual: Any, desired: Any, model: Any, err_msg: str = "", dtype: Any = np.float32
) -> float:
    """Two runs of ``model`` (two runtimes, thread counts) agree within :func:`network_atol`.

    ``dtype``: the arithmetic that differs, float32 for two FP32 runs, float16 for an FP16 conversion against
    its FP32 model. The magnitude is the largest ``|desired|`` of the output (at least 1: normalised
    activations feed it).
    """
    n, stages = onnx_reductions(model)
    want = np.asarray(desired, np.float64)
    finite = np.abs(want[np.isfinite(want)])
    magnitude = max(float(finite.max()) if finite.size else 0.0, 1.0)
    atol = network_atol(dtype, n=n, stages=stages, magnitude=magnitude)
    np.testing.assert_allclose(np.asarray(actual, np.float64), want, rtol=0, atol=atol, err_msg=err_msg)
    return atol


def torch_reorder_atol(module: Any, *inputs: Any, **kwargs: Any) -> float:
    """:func:`reorder_atol` of a torch module's FP32 forward on ``inputs``/``kwargs``, the magnitudes measured.

    Hooks on its Linear and Conv layers give each one's reduction length (``in_features``, ``C_in/groups *
    kernel``) and ``max(|x| @ |W|^T + |b|)``, the sum of absolute terms its outputs round at (the same layer run
    on absolute values); the bound uses the longest reduction, the largest magnitude and one stage per layer.
    Valid where normalisations see inputs of about unit spread: a LayerNorm input that is a large common offset
    plus a small spread multiplies the rounding by offset / spread (avoid such weights in a test).
    """
    import torch

    found: list[tuple[int, float]] = []

    def hook(m: Any, args: tuple[Any, ...], _out: Any) -> None:
        x, bias = args[0].detach().abs(), None if m.bias is None else m.bias.abs()
        if isinstance(m, torch.nn.Linear):
            terms, n = torch.nn.functional.linear(x, m.weight.abs(), bias), m.in_features
        else:
            terms, n = m._conv_forward(x, m.weight.abs(), bias), int(m.weight[0].numel())
        found.append((n, float(terms.max())))

    layers = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    handles = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, layers)]
    try:
        with torch.no_grad():
            module(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    if not found:
        return reorder_atol(np.float32)
    n = max(k for k, _ in found)
    return reorder_atol(np.float32, n=n, magnitude=max(v for _, v in found), stages=len(found))


# Error figures (mpinfer.metrics) that are a function of the error d = candidate - baseline alone, each mapped to
# the error size it measures: absolute ones in the outputs' units, the others relative to the baseline's rms.
ABSOLUTE_ERROR_FIGURES = ("max_abs", "mean_abs")
RELATIVE_ERROR_FIGURES = ("rel_l2", "snr_db", "cosine", "cosine_min")


def assert_error_figures_agree(
    want: Any, got: Any, *, atol: float, rms: float, sample_rms: float | None = None,
    metrics: Any = ABSOLUTE_ERROR_FIGURES + RELATIVE_ERROR_FIGURES[:3], err_msg: str = "",
) -> None:
    """Two measurements of one output's error figures (two code paths, kernels or thread counts) agree.

    ``atol`` bounds how far the error ``d`` of one element moves between the two (twice :func:`reorder_atol`
    of the model when both the baseline and the candidate are recomputed), so ``max_abs`` and ``mean_abs`` move
    by at most ``atol``, and
    ``rel_l2``, ``snr_db`` and ``cosine`` (as :func:`error_amplitude`) by ``atol / rms`` (``rms``: the
    baseline's root mean square; ``cosine_min``, a per-sample figure, by ``atol / sample_rms``, the smallest
    sample's rms). A real difference (other samples, numerics or model) moves them by the error
    itself; a figure at the float noise floor (an SNR of 140 dB) is compared as the noise it is.
    """
    for metric in metrics:
        a, b = float(want[metric]), float(got[metric])
        if metric == "cosine_min" and sample_rms is None:
            raise ValueError("cosine_min needs sample_rms, the smallest rms of one sample of the baseline")
        tol = atol if metric in ABSOLUTE_ERROR_FIGURES else atol / (sample_rms if metric == "cosine_min" else rms)
        ea, eb = error_amplitude(metric, a), error_amplitude(metric, b)
        assert abs(ea - eb) <= tol, f"{err_msg}: {metric} {a!r} vs {b!r}: as error {ea:.3g} vs {eb:.3g}, tol {tol:.3g}"
