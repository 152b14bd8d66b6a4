"""The validity gate run after every rewrite.

Full ``onnx.checker``, strict type/shape inference and an ONNX Runtime session load. A failure is a
bug in mpinfer (:class:`InternalError` naming the node), never
an invalid file on disk. Checks the *input* model already fails (e.g. ONNX Runtime has no kernel for one of
its ops) are not held against the output.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mpinfer.backends.ort import load_check
from mpinfer.errors import InternalError
from mpinfer.memory import current_budget
from mpinfer.modelio import (
    EXTERNAL_DATA_THRESHOLD,
    data_file,
    load_onnx,
    save_onnx,
    save_streamed,
    saved_bytes,
    small_enough_to_size,
)
from mpinfer.precision.core import NodeDecision
from mpinfer.precision.graph.apply import AppliedRun, apply_plan
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

CHECKS = ("checker", "inference", "onnxruntime")
# The checks that need no ONNX Runtime session (for a model a session already loaded and ran).
OFFLINE_CHECKS = ("checker", "inference")
_MISSING_KERNEL = ("Could not find an implementation for", "Failed to find kernel for")
_NODE_RE = re.compile(r"node name:\s*([^)\s]+)|Node\s*\(([^)]+)\)|node '([^']+)'|name:\s*'?([^'\s,)]+)", re.I)


@dataclass(frozen=True)
class GateFailure:
    """One failed check: which check, the node it names (when it names one) and the message."""

    check: str
    node: str | None
    message: str


def _node_from(message: str) -> str | None:
    m = _NODE_RE.search(message)
    if not m:
        return None
    return next(g for g in m.groups() if g)


def run_checks(model: Any, checks: tuple[str, ...] = CHECKS) -> list[GateFailure]:
    """Run the gate's checks on an in-memory model (external data > 2 GB goes through a temp file).

    Args:
        model: The ``onnx.ModelProto``, or its serialized bytes (checked as they are: no copy, no parse).
        checks: Which checks to run.

    Returns:
        The failures (empty when valid).
    """
    if isinstance(model, bytes) or small_enough_to_size(model):
        return _run(model, None, checks)
    with tempfile.TemporaryDirectory(prefix="mpinfer-gate-") as td:

        path = save_onnx(model, Path(td) / "model.onnx", external_data=True)
        return _run(None, path, checks)


def run_checks_path(path: str | os.PathLike[str], checks: tuple[str, ...] = CHECKS) -> list[GateFailure]:
    """Run the gate's checks on a saved model (works above 2 GB)."""
    return _run(None, Path(path), checks)


def _run(model: Any, path: Path | None, checks: tuple[str, ...]) -> list[GateFailure]:
    import onnx

    failures = []
    start = time.perf_counter()
    if path is None and not isinstance(model, bytes):
        model = model.SerializeToString()  # (each check would serialize the proto again)
    inferred = False  # strict type inference passed as part of the full checker
    if "checker" in checks:
        try:
            onnx.checker.check_model(model if path is None else str(path), full_check=path is None)
            # the full check ends with strict type and shape inference (check_type, strict mode), the very
            # inference check below: passed, it need not run twice
            inferred = path is None
        except Exception as err:  # noqa: BLE001 - onnx raises ValidationError and others
            failures.append(GateFailure("checker", _node_from(str(err)), str(err)))
    if "inference" in checks and not inferred:
        try:
            if path is None:
                onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
            else:
                with tempfile.TemporaryDirectory() as td:
                    onnx.shape_inference.infer_shapes_path(
                        str(path), str(Path(td) / "inferred.onnx"), check_type=True, strict_mode=True
                    )
        except Exception as err:  # noqa: BLE001 - InferenceError and friends
            failures.append(GateFailure("inference", _node_from(str(err)), str(err)))
    if "onnxruntime" in checks:
        try:
            load_check(model, path)
        except Exception as err:  # noqa: BLE001 - onnxruntime raises its own types
            if any(m in str(err) for m in _MISSING_KERNEL):
                # The CPU provider lacks a kernel for a dtype (BF16 MatMul/Conv, some FP16 ops): the model is
                # valid, GPU providers and TensorRT run it; not a validity failure.
                logger.info("ONNX Runtime CPU has no kernel for a node of this model: %s", str(err)[:300])
            else:
                failures.append(GateFailure("onnxruntime", _node_from(str(err)), str(err)))
    logger.debug("validity gate: %d failures in %.2fs", len(failures), time.perf_counter() - start)
    return failures


def validity_failures(
    model: Any,
    *,
    baseline_model: Any = None,
    baseline_path: Path | None = None,
    path: Path | None = None,
    checks: tuple[str, ...] = CHECKS,
) -> list[GateFailure]:
    """The checks ``model`` fails that the input model passes.

    The input is checked lazily: only for the checks the output fails (e.g. ONNX Runtime cannot load the
    input either because it lacks a kernel), so a valid output costs one round of checks.

    Args:
        model: The rewritten model, or its serialized bytes (or None with ``path``).
        baseline_model: The input model in memory, or
        baseline_path: the input model's file (for models over 2 GB).
        path: Check this saved file instead of ``model``.
        checks: Which checks to run (default: all).
    """
    failures = run_checks_path(path, checks) if path is not None else run_checks(model, checks)
    if failures and (baseline_model is not None or baseline_path is not None):
        checks = tuple(sorted({f.check for f in failures}))
        base = (
            run_checks_path(baseline_path, checks)
            if baseline_path is not None
            else run_checks(baseline_model, checks)
        )
        already = {f.check for f in base}
        if already:
            logger.warning(
                "The input model already fails the %s check(s); not held against the output.",
                ", ".join(sorted(already)),
            )
        failures = [f for f in failures if f.check not in already]
    return failures


def raise_invalid(failures: list[GateFailure], stage: str) -> None:
    """Raise InternalError for the first failure (no-op when there is none)."""
    if failures:
        f = failures[0]
        where = f"node '{f.node}'" if f.node else "the model"
        raise InternalError(
            f"mpinfer produced an invalid model after {stage}: the {f.check} check fails at {where}: "
            f"{f.message.strip()[:2000]}. This is a bug in mpinfer; the output was not written. "
            "Work around it with --keep-node for that node and report it."
        )


def gate(
    model: Any,
    *,
    baseline_model: Any = None,
    baseline_path: Path | None = None,
    stage: str = "rewrite",
    path: Path | None = None,
) -> None:
    """Raise InternalError if ``model`` fails a check that the input model passes.

    Args:
        model: The rewritten model (or None with ``path``).
        baseline_model: The input model in memory, or
        baseline_path: the input model's file (for models over 2 GB).
        stage: What produced the model, for the message.
        path: Check this saved file instead of ``model``.

    Raises:
        InternalError: Naming the check, the node and the message.
    """
    raise_invalid(
        validity_failures(model, baseline_model=baseline_model, baseline_path=baseline_path, path=path), stage
    )


def gate_published(
    path: Path, *, baseline_model: Any = None, baseline_path: Path | None = None, gated: str | None = None
) -> None:
    """The validity gate on the file about to be published (after every rewrite of it: embedding, external data).

    The full checker, strict type inference and an ONNX Runtime load on what was written, read back from disk;
    none of them again when the file's bytes are those every check already passed on (``gated``: their SHA-256,
    :attr:`ApplyResult.gated <mpinfer.precision.graph.apply.ApplyResult>`): the same bytes give the same verdicts.

    Raises:
        InternalError: The written file fails a check the input model passes.
    """
    if gated is not None and hashlib.sha256(Path(path).read_bytes()).hexdigest() == gated:
        logger.debug("validity gate: '%s' holds the very bytes the gate passed at apply", path)
        return
    gate(None, path=path, baseline_model=baseline_model, baseline_path=baseline_path, stage="writing the model")


def _gated(result: Any, baseline: Any, defer_load: bool = False) -> tuple[Any, list[GateFailure]]:
    """``result`` gated on the bytes :func:`mpinfer.modelio.save_onnx` will write for it (their digest recorded).

    The checks run on those bytes (the model at its IR version as written), so the file published from
    ``result.model`` needs no second round (:func:`gate_published`). A model save_onnx writes with external data:
    gated as it is in memory, no digest.

    ``defer_load``: the ONNX Runtime load runs on a thread (:class:`PendingLoad`, in ``result.load``) once the
    checker and strict inference passed, when the bytes fit the memory budget's ``probe`` slice (a second copy of the
    converted weights, as the search's ONNX Runtime probe holds); the digest is recorded when it passed
    (:func:`settle_load`).
    """
    model = result.model
    if not small_enough_to_size(model):
        return result, validity_failures(model, baseline_model=baseline)
    data = saved_bytes(model)
    if len(data) >= EXTERNAL_DATA_THRESHOLD:  # (save_onnx's test, on the copy it writes: its ByteSize is this)
        return result, validity_failures(model, baseline_model=baseline)
    digest = hashlib.sha256(data).hexdigest()
    if defer_load and len(data) <= current_budget().probe:
        failures = validity_failures(data, baseline_model=baseline, checks=OFFLINE_CHECKS)
        return (result if failures else replace(result, load=PendingLoad(data, baseline, digest))), failures
    failures = validity_failures(data, baseline_model=baseline)  # (the checks parse the bytes themselves)
    return (result if failures else replace(result, gated=digest)), failures


class PendingLoad:
    """The validity gate's ONNX Runtime load of a model's bytes, on a thread of its own.

    The load is the gate's one large cost (ONNX Runtime's CPU provider loads an FP16 model 2-3x slower than its FP32
    one: the OCR recognizer ~0.27 s, the deep synthetic net ~0.1 s) and releases the GIL, so convert runs it beside
    the final verification, which reads the model in memory and never needs it, and reads its verdict before writing
    (:func:`settle_load`).

    Args:
        data: The bytes save_onnx writes for the model.
        baseline: The input model (a check it fails too is not held against the output).
        digest: The bytes' SHA-256 (:attr:`ApplyResult.gated <mpinfer.precision.graph.apply.ApplyResult>` once it
            passed).
    """

    def __init__(self, data: bytes, baseline: Any, digest: str) -> None:
        self.digest = digest
        executor = ThreadPoolExecutor(1, thread_name_prefix="mpinfer-gate")
        self._future = executor.submit(validity_failures, data, baseline_model=baseline, checks=("onnxruntime",))
        executor.shutdown(wait=False)  # (its thread ends with the load)

    def failures(self) -> list[GateFailure]:
        """The load's failures (waits for it; re-raises what it raised)."""
        return self._future.result()

    def refused(self) -> bool:
        """Whether the load is done and failed (never waits)."""
        return self._future.done() and bool(self._future.result())


def settle_load(applied: Any, final: Any) -> tuple[Any, list[GateFailure]]:
    """``final`` with the verdict of the load that ``applied`` left running (:func:`apply_validated`'s ``defer_load``).

    Waits for the load. When ``final`` is that very model (the verification repaired nothing): ``final`` gated
    (its digest recorded) and no failure, or ``final`` as it is and the load's failures, which the caller repairs
    (:func:`apply_validated` again, without deferring). When the verification rewrote the model, the load was of a
    model that is not written: ``final`` (gated by the repair's own apply) and no failure.
    """
    pending = applied.load
    if pending is None:
        return final, []
    failures = pending.failures()
    if final.model is not applied.model:
        return final, []
    if failures:
        return replace(final, load=None), failures
    return replace(final, gated=pending.digest, load=None), []


def runtime_suspects(failure: GateFailure, info: Any, low: set[str]) -> set[str]:
    """Low nodes an ONNX-valid model's ONNX Runtime refusal points at (its kernels lack the dtype).

    Names in the message are matched as node addresses, tensors (their low producer and readers) and op
    types (``(Where)``, ``_inlfunc_SoftmaxCrossEntropyLoss_...``); when none matches, low nodes of function
    ops (which ONNX Runtime inlines when it has no kernel) are the suspects.
    """
    tokens = set(re.findall(r"\(([^()\s]+)\)", failure.message)) | set(
        re.findall(r"_inlfunc_([A-Za-z]+)_", failure.message)
    )
    hits: set[str] = set()
    for tok in tokens:
        base = tok.split("__cast_to_")[0]
        if base in low:
            hits.add(base)
        hits.update(a for a, _ in info.consumers.get(base, []) if a in low)
        if info.producer.get(base) in low:
            hits.add(info.producer[base])
        hits.update(a for a in low if info.by_address[a].node.op_type == tok)
    if hits:
        return hits
    out = set()
    for a in low:
        schema = info.schema(info.by_address[a].node)
        if schema is not None and (schema.has_function or schema.has_context_dependent_function):
            out.add(a)
    return out


# Rounds of "ONNX Runtime refuses these low nodes: keep them FP32 and re-apply" before giving up.
MAX_RUNTIME_REPAIRS = 4


def apply_validated(
    info: Any,
    nodes: list[NodeDecision],
    precision: Precision,
    *,
    keep_io_types: bool = True,
    applied: AppliedRun | None = None,
    staged: tuple[Path, Path] | None = None,
    defer_load: bool = False,
) -> tuple[Any, list[NodeDecision]]:
    """Apply the plan and pass the validity gate; nodes ONNX Runtime refuses in low precision go FP32.

    Only a failure of the ONNX Runtime load alone (the ONNX checker and strict type inference pass, so the
    model is valid ONNX) is repaired: ONNX Runtime's kernels or function bodies lack the dtype (BF16
    mostly). The nodes it points at are kept FP32 with the reason recorded, and the plan is applied again.

    ``applied``: the search's final candidate as it applied it (same model, same ``keep_io_types``); when the plan's
    precisions are its precisions, its ApplyResult is taken as it is, and the gate runs on it (only the checker and
    strict type inference when the numerics' runtime loaded and ran that very model: ``applied.loaded``).

    ``staged``: (where to write, the input model's file) for a model whose weights are external: each candidate
    is written there (:func:`mpinfer.modelio.save_streamed`, tensor by tensor) and the gate checks that file (the
    checker and type inference on the path, ONNX Runtime loading it with its weights memory-mapped); the result's
    model then points at the written data file.

    ``defer_load``: the ONNX Runtime load of a model in memory runs on a thread (``result.load``, see :func:`_gated`);
    the caller reads its verdict with :func:`settle_load` and, on a refusal, applies again without deferring.

    Returns:
        The ApplyResult and the (possibly updated) plan entries.

    Raises:
        InternalError: Any other validity failure, or one that repairs do not fix.
    """
    for _ in range(MAX_RUNTIME_REPAIRS + 1):
        precisions = {n.name: n.precision for n in nodes}
        result, failures = _apply_and_check(info, precisions, precision, keep_io_types, applied, staged, defer_load)
        if not failures:
            return result, nodes
        runtime_only = all(f.check == "onnxruntime" for f in failures)
        low = {n.name for n in nodes if n.precision.is_low}
        suspects = runtime_suspects(failures[0], info, low) if runtime_only else set()
        if not suspects:
            break
        nodes = _keep_refused_fp32(nodes, suspects, precision, failures[0])
    raise_invalid(failures, "apply")
    raise AssertionError("unreachable: raise_invalid raises for a non-empty list")


def _apply_and_check(
    info: Any,
    precisions: dict[str, Precision],
    precision: Precision,
    keep_io_types: bool,
    applied: AppliedRun | None,
    staged: tuple[Path, Path] | None,
    defer_load: bool = False,
) -> tuple[Any, list[GateFailure]]:
    """The applied plan (the search's rewrite when it applied these precisions) and its validity failures."""
    if applied is not None and applied.precisions == precisions and staged is None:
        if applied.loaded:
            return applied.result, validity_failures(applied.model, baseline_model=info.model, checks=OFFLINE_CHECKS)
        return _gated(applied.result, info.model, defer_load)
    result = apply_plan(info.model, info, precisions, precision, keep_io_types=keep_io_types)
    if staged is not None:
        path, source = staged
        save_streamed(result.model, path, data_file(path).name, info.base_dir)
        # the graph alone, read back: the rewritten proto's arena kept every converted weight's bytes (protobuf
        # frees it only with the message: 6 GB of FP16 weights through the 3B decoder's verification)
        result = replace(result, model=load_onnx(path, load_external_data=False))
        return result, validity_failures(None, baseline_path=source, path=path)
    return _gated(result, info.model, defer_load)


def _keep_refused_fp32(
    nodes: list[NodeDecision], suspects: set[str], precision: Precision, failure: GateFailure
) -> list[NodeDecision]:
    """The plan with the nodes ONNX Runtime refuses in low precision kept FP32 (said in a warning)."""
    logger.warning(
        "ONNX Runtime refuses %d node(s) in %s; keeping them FP32: %s",
        len(suspects),
        precision.value,
        ", ".join(sorted(suspects)[:5]),
    )
    detail = f"ONNX Runtime refuses it in {precision.value}: " + failure.message.strip()[:160]
    return [
        NodeDecision(n.name, n.op_type, Precision.FP32, "rule:keep-fp32", detail, n.stats) if n.name in suspects else n
        for n in nodes
    ]
