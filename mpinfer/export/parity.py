"""Parity torch vs ONNX Runtime on seeded inputs of several shapes inside the dynamic ranges."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.data.decode import greedy_decode
from mpinfer.data.feeds import random_batch
from mpinfer.export.outputs import flatten_outputs
from mpinfer.modelio import ort_session
from mpinfer.specs import TensorSpec, batch_symbols


@dataclass
class ParityRun:
    """One parity input: its shapes and per-output max abs / rel error."""

    shapes: dict[str, list[int]]
    # output -> max_abs, max_rel, passed (or ONNX Runtime's error when it failed)
    errors: dict[str, dict[str, Any]]
    passed: bool
    # Why the run was not compared: the torch model itself rejects inputs of these shapes (a convolution
    # longer than the audio, ...), so they are outside what the model takes; None when compared.
    skipped: str | None = None
    # What the run is, when not just a shape (a decoder's ``prefill`` or ``decode step 2``).
    label: str | None = None


@dataclass
class ParityReport:
    """All parity runs."""

    runs: list[ParityRun] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every compared run is within tolerance (and at least one was compared)."""
        compared = [r for r in self.runs if r.skipped is None]
        return bool(compared) and all(r.passed for r in compared)

    @property
    def max_abs(self) -> float:
        """Worst absolute error over runs and outputs."""
        return max((e["max_abs"] for r in self.runs for e in r.errors.values()), default=0.0)

    def worst_summary(self) -> str:
        """One phrase naming the worst output and shape."""
        failed = next(((e["error"], r.shapes) for r in self.runs for e in r.errors.values() if "error" in e), None)
        if failed is not None:
            return f"ONNX Runtime failed at input shapes {failed[1]} ({failed[0]})"
        # The first failing output of the first failing run: with a tolerance of 0 every output may fail, and
        # its error need not be the largest (the largest can be within rtol of a large value).
        failing = next(((name, e, r.shapes) for r in self.runs if r.skipped is None and not r.passed
                        for name, e in r.errors.items() if not e.get("passed", True)), None)
        if failing is None:  # keyed on the error alone: shapes (dicts) cannot be ordered on a tie
            failing = max(((name, e, r.shapes) for r in self.runs for name, e in r.errors.items()),
                          key=lambda t: float(t[1]["max_abs"]), default=None)
        if failing is None:
            return "no parity run was compared"
        name, err, shapes = failing
        return (f"output '{name}' max abs error {float(err['max_abs']):.3g}, max rel error "
                f"{float(err['max_rel']):.3g} at input shapes {shapes}")

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"passed": self.passed, "max_abs": self.max_abs,
                "runs": [{"shapes": r.shapes, "outputs": r.errors, "passed": r.passed}
                         | ({"skipped": r.skipped} if r.skipped else {}) | ({"label": r.label} if r.label else {})
                         for r in self.runs]}


def parity_dims(specs: Sequence[TensorSpec], runs: int) -> list[dict[str, int]]:
    """Dim sizes for each run: the example size, then smaller, then example + 1, ... (deterministic).

    "Smaller" is 1 for a batch dim (a symbol some input has first) and half the example for the others: one
    sample is a size every batched model takes, one audio sample or one pixel is not.
    """
    symbols = sorted({s for spec in specs for s in spec.symbols})
    batch = batch_symbols(specs)
    out = []
    for i in range(runs):
        dims = {}
        for sym in symbols:
            ex = next((spec.dim_sizes[sym] for spec in specs if sym in spec.dim_sizes), 2)
            dims[sym] = [ex, 1 if sym in batch else max(1, ex // 2), ex + 1, 2 * ex + 1][i % 4]
        out.append(dims)
    return out


def _errors(ref: np.ndarray, got: np.ndarray, atol: float, rtol: float) -> tuple[dict[str, Any], bool]:
    ref64 = ref.astype(np.float64) if ref.dtype.kind in "fc" else ref.astype(np.float64)
    got64 = got.astype(np.float64)
    if ref64.shape != got64.shape:
        return {"max_abs": float("inf"), "max_rel": float("inf")}, False
    diff = np.abs(ref64 - got64)
    scale = np.maximum(np.abs(ref64), 1e-6)
    ok = bool(np.all(diff <= atol + rtol * np.abs(ref64)) and np.array_equal(np.isnan(ref64), np.isnan(got64)))
    diff = np.nan_to_num(diff, nan=0.0)
    return {"max_abs": float(diff.max(initial=0.0)), "max_rel": float((diff / scale).max(initial=0.0))}, ok


@dataclass
class ParityCase:
    """One parity input and the torch model's outputs on it (computed before ONNX Runtime loads the model)."""

    feeds: dict[str, np.ndarray]
    shapes: dict[str, list[int]]
    ref: list[np.ndarray] | None  # None when skipped
    skipped: str | None = None
    label: str | None = None


def check_parity(module: Any, onnx_path: Path, specs: Sequence[TensorSpec], out_names: Sequence[str], *,
                 runs: int = 3, atol: float = 1e-4, rtol: float = 1e-3, seed: int = 1) -> ParityReport:
    """Run torch and ONNX Runtime on ``runs`` seeded inputs and compare every output.

    :func:`parity_reference` then :func:`compare_parity` (export calls them apart, to free the torch model
    between the two).

    Args:
        module: The torch model (Module, ScriptModule or ExportedProgram).
        onnx_path: The exported model.
        specs: Input specs (symbols vary across runs).
        out_names: ONNX output names, in torch output order.
        runs: Number of inputs.
        atol: Absolute tolerance.
        rtol: Relative tolerance.
        seed: Base seed.

    Returns:
        The parity report. A run whose inputs the torch model itself rejects (other than the first, at the
        example size the export ran) is skipped with the reason; one ONNX Runtime rejects fails.
    """
    cases = parity_reference(module, specs, runs=runs, seed=seed)
    return compare_parity(cases, onnx_path, out_names, atol=atol, rtol=rtol)


def parity_reference(module: Any, specs: Sequence[TensorSpec], *, runs: int = 3, seed: int = 1) -> list[ParityCase]:
    """The torch side of parity: ``runs`` seeded inputs and the torch model's outputs on each.

    A decoder wrapped with its KV cache (a module with a ``kv_layout``) gets :func:`kv_parity_reference`
    instead, ``runs`` being its decode steps.
    """
    import logging

    import torch

    layout = getattr(module, "kv_layout", None)
    if layout is not None:  # a decoder wrapped with its KV cache (mpinfer.export.kv)
        return kv_parity_reference(module, layout, specs, steps=runs, seed=seed)
    fn = module.module() if isinstance(module, torch.export.ExportedProgram) else module
    cases = []
    for i, dims in enumerate(parity_dims(specs, runs)):
        batch = random_batch(specs, np.random.default_rng(seed + i), dims)
        shapes = {s.name: list(batch[s.name].shape) for s in specs}
        try:
            with torch.no_grad():
                ref = [t.detach().cpu().numpy() for t in flatten_outputs(fn(*[torch.from_numpy(batch[s.name])
                                                                              for s in specs]))]
        except Exception as err:  # torch raises many types for inputs a model cannot take
            if i == 0:
                raise
            why = f"the torch model rejects these shapes ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
            logging.getLogger(__name__).warning("parity run at %s skipped: %s", shapes, why)
            cases.append(ParityCase(batch, shapes, None, skipped=why))
            continue
        cases.append(ParityCase(batch, shapes, ref))
    return cases


def compare_parity(cases: Sequence[ParityCase], onnx_path: Path, out_names: Sequence[str], *, atol: float = 1e-4,
                   rtol: float = 1e-3) -> ParityReport:
    """The ONNX Runtime side of parity: run the model on each case's feeds and compare with the torch outputs."""
    sess = ort_session(onnx_path)
    result = ParityReport()
    for case in cases:
        if case.ref is None:
            result.runs.append(ParityRun(case.shapes, {}, True, skipped=case.skipped, label=case.label))
            continue
        result.runs.append(_compare_run(case.ref, sess, case.feeds, out_names, atol, rtol, case.label))
    return result


def _compare_run(ref: Sequence[np.ndarray], sess: Any, feeds: dict[str, np.ndarray], out_names: Sequence[str],
                 atol: float, rtol: float, label: str | None) -> ParityRun:
    shapes = {k: list(v.shape) for k, v in feeds.items()}
    try:
        got = sess.run(list(out_names), feeds)
    except Exception as err:  # onnxruntime's own exception types
        failed = {"max_abs": float("inf"), "max_rel": float("inf"), "error": str(err).splitlines()[0][:300]}
        return ParityRun(shapes, {name: failed for name in out_names}, False, label=label)
    errors, ok = {}, True
    for name, r, g in zip(out_names, ref, got):
        errors[name], passed = _errors(r, np.asarray(g), atol, rtol)
        errors[name]["passed"] = passed
        ok = ok and passed
    return ParityRun(shapes, errors, ok, label=label)


def kv_parity_prompts(specs: Sequence[TensorSpec], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two prompts of the example length, the second left-padded by two tokens (a mask that is not all ones)."""
    ids_spec = next(s for s in specs if s.name == "input_ids")
    lo, hi = ids_spec.resolved_range()
    seq = max(3, int(ids_spec.dim_sizes.get("seq", 6)))
    ids = np.random.default_rng(seed).integers(int(lo), int(hi), (2, seq)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


def check_kv_parity(module: Any, onnx_path: Path, layout: Any, specs: Sequence[TensorSpec], *, steps: int = 3,
                    atol: float = 1e-4, rtol: float = 1e-3, seed: int = 1) -> ParityReport:
    """Parity of a decoder with a KV cache: :func:`kv_parity_reference`, then :func:`compare_parity`."""
    cases = kv_parity_reference(module, layout, specs, steps=steps, seed=seed)
    return compare_parity(cases, onnx_path, layout.output_names, atol=atol, rtol=rtol)


def kv_parity_reference(module: Any, layout: Any, specs: Sequence[TensorSpec], *, steps: int = 3,
                        seed: int = 1) -> list[ParityCase]:
    """The torch side of a decoder's parity: a prefill on an empty past, then ``steps`` greedy decode steps.

    Both runtimes get the same feeds at every step: the prompts (one left-padded), then the torch model's
    greedy token and its presents as the past, so an error shows where it arises instead of compounding.
    Every output (logits and each present) is compared.

    Args:
        module: The wrapped torch decoder (flat inputs in ``layout.input_names`` order).
        layout: Its :class:`mpinfer.data.decode.KvLayout`.
        specs: Its input specs (the token range and example length).
        steps: Decode steps after the prefill.
        seed: Seed of the prompts.

    Returns:
        One case per model call, labelled ``prefill`` and ``decode step i``.
    """
    import torch

    names = layout.output_names
    refs: list[list[np.ndarray]] = []

    def run_torch(feeds: Any) -> dict[str, np.ndarray]:
        with torch.no_grad():
            out = flatten_outputs(module(*[torch.from_numpy(np.ascontiguousarray(feeds[n]))
                                           for n in layout.input_names]))
        refs.append([t.detach().cpu().numpy() for t in out])
        return dict(zip(names, refs[-1]))

    cases = []
    ids, mask = kv_parity_prompts(specs, seed)
    for item in greedy_decode(run_torch, layout, ids, mask, steps):
        label = "prefill" if item.step == 0 else f"decode step {item.step}"
        cases.append(ParityCase(item.feeds, {k: list(v.shape) for k, v in item.feeds.items()}, refs[-1],
                                label=label))
    return cases
