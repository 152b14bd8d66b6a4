"""Run the converter over ONNX's own operator test cases (shared by the conformance test and the bench)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FP16_RTOL = 2e-2  # ~20 FP16 ulps: a handful of roundings per element, as a GPU shows
FP16_MAX = 65504.0
FP16_ATOL = 2e-2  # scaled by the output's magnitude (max(1, max|expected|))


@dataclass
class Outcome:
    name: str
    status: str  # converted-match, converted-mismatch, kept-fp32, ort-cannot-run-original, crash, invalid
    low_nodes: int = 0
    detail: str = ""


@dataclass
class Counts:
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    def counter(self) -> Counter:
        return Counter(o.status for o in self.outcomes)


def float_cases(select=None) -> list[Any]:
    """Node test cases whose model has FP32 tensors and no FP16/BF16 ones."""
    import warnings

    from onnx import TensorProto
    from onnx.backend.test.case.node import collect_testcases

    from mpinfer.precision.graph.normalize import low_tensor_count

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)  # never with an op type: onnx caches the first answer process-wide
    out = []
    for case in cases:
        m = case.model
        if m is None or not case.data_sets:
            continue
        types = [
            vi.type.tensor_type.elem_type
            for vi in list(m.graph.input) + list(m.graph.output)
            if vi.type.HasField("tensor_type")
        ] + [t.data_type for t in m.graph.initializer]
        low, _ = low_tensor_count(m)
        if TensorProto.FLOAT in types and not low:
            out.append(case)
    out.sort(key=lambda c: c.name)
    _freeze_heap()
    return out if select is None else [c for i, c in enumerate(out) if select(i, c)]


def _freeze_heap() -> None:
    """Keep what is alive now out of the garbage collector's later scans (``gc.freeze``).

    onnx keeps every node test case (models and their data) for the life of the process; without this, each of the
    full collections convert's ``release_memory`` runs between its phases walks all of them again (in the CLI
    conformance sample, 61 s of its 186 s on a loaded 2-core machine). Frozen objects are never collected: only the
    objects alive here, which a test's process keeps anyway, and cycles among them that die later.
    """
    import gc

    gc.collect()
    gc.freeze()


def _ort(model: Any, feeds: dict[str, Any]) -> list[Any]:
    import onnxruntime as ort

    ort.set_default_logger_severity(4)  # ORT logs refused variants (batchwise RNN layouts) at ERROR level
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    # ONNX Runtime's training-mode BatchNormalization writes its running statistics into the input
    # buffers; onnx caches its test cases process-wide, so give it copies.
    return sess.run(None, {k: np.array(v, copy=True) if isinstance(v, np.ndarray) else v for k, v in feeds.items()})


def _feeds(case: Any) -> dict[str, Any]:
    inputs = case.data_sets[0][0]
    names = [
        vi.name
        for vi in case.model.graph.input
        if vi.name not in {t.name for t in case.model.graph.initializer}
    ]
    return dict(zip(names, inputs, strict=False))


def _close(got: Any, want: Any) -> bool:
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(_close(g, w) for g, w in zip(got, want, strict=False))
        )
    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape:
        return False
    if w.dtype.kind not in "fc":
        return bool(np.array_equal(g, w))
    g, w = g.astype(np.float64), w.astype(np.float64)
    fin = np.isfinite(w)
    if not np.array_equal(np.isnan(g), np.isnan(w)):
        return False
    inf = np.isinf(w)  # masks: FP16 kernels may saturate -inf at the lowest finite FP16 value
    if not np.all((g[inf] == w[inf]) | (np.sign(g[inf]) == np.sign(w[inf])) & (np.abs(g[inf]) >= FP16_MAX)):
        return False
    scale = max(1.0, float(np.abs(w[fin]).max())) if fin.any() else 1.0
    return bool(np.allclose(g[fin], w[fin], rtol=FP16_RTOL, atol=FP16_ATOL * scale))


def _run_converted(model: Any, feeds: dict[str, Any]) -> list[Any]:
    try:
        return _ort(model, feeds)
    except Exception as err:  # noqa: BLE001
        # ONNX Runtime's CPU provider lacks some FP16 kernels or variants (reductions of ScatterND, ...):
        # the strict emulator runs the converted model instead.
        if not any(
            m in str(err)
            for m in (
                "Could not find an implementation",
                "Failed to find kernel",
                "MLFloat16",
                "not supported",
            )
        ):
            raise
    from mpinfer.precision.emulator.emulate import GraphEmulator

    emu = GraphEmulator(model, follow_input_dtypes=True)
    run = emu.run(feeds)
    return list(run.outputs.values())


def check_case(case: Any, *, force_low: bool = False) -> Outcome:
    """Convert one test model (rules only) and check validity and outputs."""
    from mpinfer.errors import InternalError
    from mpinfer.precision.convert import convert_model

    feeds = _feeds(case)
    expected = case.data_sets[0][1]
    try:
        with np.errstate(all="ignore"):
            ort_ref = _ort(case.model, feeds)
    except Exception:  # noqa: BLE001 - ORT lacks this op/variant: nothing to compare against
        ort_ref = None
    ops = (
        tuple(sorted({n.op_type for n in case.model.graph.node if n.domain in ("", "ai.onnx")}))
        if force_low
        else ()
    )
    try:
        conv = convert_model(case.model, low_ops=ops)
    except InternalError as err:
        return Outcome(case.name, "invalid", detail=str(err)[:300])
    except Exception as err:  # noqa: BLE001 - a crash is what this test counts
        return Outcome(case.name, "crash", detail=f"{type(err).__name__}: {err}"[:300])
    low = sum(n.precision.is_low for n in conv.nodes)
    if ort_ref is None:
        return Outcome(case.name, "ort-cannot-run-original", low)
    try:
        with np.errstate(all="ignore"):
            got = _run_converted(conv.model, feeds)
    except Exception as err:  # noqa: BLE001 - the converted model must run where the original does
        return Outcome(case.name, "invalid", low, f"converted model does not run: {err}"[:300])
    reference = expected if all(_close(r, e) for r, e in zip(ort_ref, expected, strict=False)) else ort_ref
    ok = len(got) == len(reference) and all(_close(g, e) for g, e in zip(got, reference, strict=False))
    if not low:
        kept = [f"{n.name}: {n.reason}" for n in conv.nodes]
        return Outcome(case.name, "kept-fp32" if ok else "converted-mismatch", 0, "; ".join(kept)[:300])
    return Outcome(case.name, "converted-match" if ok else "converted-mismatch", low)


def run_conformance(cases: list[Any], *, force_low: bool = False) -> Counts:
    counts = Counts()
    start = time.perf_counter()
    for case in cases:
        counts.outcomes.append(check_case(case, force_low=force_low))
    counts.seconds = time.perf_counter() - start
    return counts


if __name__ == "__main__":  # pragma: no cover - manual run: python -m tests.precision.conformance
    import sys

    cases = float_cases()
    for force in (False, True):
        c = run_conformance(cases, force_low=force)
        print(("forced-low" if force else "default"), len(cases), dict(c.counter()), f"{c.seconds:.1f}s")
        for o in c.outcomes:
            if o.status in ("crash", "invalid") or (o.status == "converted-mismatch" and "-v" in sys.argv):
                print("  ", o.status, o.name, o.detail[:200])


def zoo_paths() -> list[str]:
    """Whole models shipped with onnx's backend test data: light (real architectures with light weights),
    pytorch-converted, pytorch-operator and simple."""
    import glob
    import os

    import onnx.backend.test

    root = os.path.join(os.path.dirname(onnx.backend.test.__file__), "data")
    out = sorted(glob.glob(os.path.join(root, "light", "*.onnx")))
    for kind in ("pytorch-converted", "pytorch-operator", "simple"):
        out += sorted(glob.glob(os.path.join(root, kind, "*", "model.onnx")))
    return out


def _random_feeds(sess: Any) -> dict[str, Any]:
    kinds = {
        "tensor(float)": np.float32,
        "tensor(double)": np.float64,
        "tensor(int64)": np.int64,
        "tensor(int32)": np.int32,
        "tensor(bool)": np.bool_,
    }
    feeds = {}
    rng = np.random.default_rng(0)
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]
        dt = kinds.get(i.type, np.float32)
        feeds[i.name] = (
            rng.standard_normal(shape).astype(dt) if dt in (np.float32, np.float64) else np.zeros(shape, dt)
        )
    return feeds


def check_zoo_model(path: str) -> Outcome:
    """Convert one whole model (rules only); outputs on random inputs within FP16 tolerance of ORT FP32."""
    import onnx
    import onnxruntime as ort

    from mpinfer.errors import InternalError
    from mpinfer.precision.convert import convert_model

    ort.set_default_logger_severity(4)
    model = onnx.load(path)
    try:
        conv = convert_model(model)
    except InternalError as err:
        return Outcome(path, "invalid", detail=str(err)[:300])
    except Exception as err:  # noqa: BLE001 - a crash is what this counts
        return Outcome(path, "crash", detail=f"{type(err).__name__}: {err}"[:300])
    low = sum(n.precision.is_low for n in conv.nodes)
    try:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        feeds = _random_feeds(sess)
        with np.errstate(all="ignore"):
            ref = sess.run(None, feeds)
    except Exception:  # noqa: BLE001 - string ops without a locale, shapes random data cannot satisfy
        return Outcome(path, "ort-cannot-run-original", low)
    try:
        with np.errstate(all="ignore"):
            got = _run_converted(conv.model, feeds)
    except Exception as err:  # noqa: BLE001
        return Outcome(path, "invalid", low, f"converted model does not run: {err}"[:300])
    ok = all(_close(g, r) for g, r in zip(got, ref, strict=False))
    return Outcome(path, ("converted-match" if low else "kept-fp32") if ok else "converted-mismatch", low)
