"""compare's passes over the data: every model at once, or one model at a time (big models, decoders).

With ``--generate``, each model's greedy decodes run on the session of its pass (:mod:`mpinfer.generation`),
and take the outputs of the calls the pass ran already.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.backends.base import Runner
from mpinfer.backends.ort import OrtRunner
from mpinfer.checks import Checks
from mpinfer.compare.config import CompareConfig
from mpinfer.errors import InvalidInputError, ModelLoadError, MpinferError, format_message
from mpinfer.generation import GenerationPass
from mpinfer.memory import current_budget, release_memory
from mpinfer.metrics import ModelAccumulator, guess_class_output
from mpinfer.modelio import data_file, iter_graphs, load_onnx
from mpinfer.progress import progress_bar
from mpinfer.specs import TensorSpec, is_float_dtype, specs_from_onnx

# Models on disk above this share of the memory budget are compared one at a time (baseline first, its outputs
# kept, then each candidate), not all loaded at once: with ONNX Runtime's CPU provider an FP16 candidate's
# session holds FP32 copies of its weights, so baseline + candidate came to twice the FP32 model.
ONE_AT_A_TIME_SHARE = 4


def one_at_a_time(cfg: CompareConfig) -> bool:
    """Whether the models run one at a time.

    They do when big enough next to the memory budget, or for decoders compared with ``--generate`` (whose
    generation loads one model at a time anyway: the output pass does the same). ONNX files only, and not with
    latency (which runs every model on the same batch).
    """
    specs = (cfg.baseline, *cfg.candidates)
    if cfg.latency or not all(str(s).lower().endswith(".onnx") for s in specs):
        return False
    if cfg.generate:
        return True
    return sum(model_size(s) or 0 for s in specs) > current_budget().limit // ONE_AT_A_TIME_SHARE


class Remembered:
    """A runner whose specs and output names stay known while it is inactive (compared one model at a time).

    They are read off the ONNX graph (weights not loaded), as the runner's session would give them (its inputs
    without initializers, with the ranges and dim sizes export recorded); no session opens before the model's
    pass over the data (:meth:`session`), which names the model in a load error as :func:`_activate` does.
    """

    def __init__(self, runner: Runner, path: str, role: str, cfg: CompareConfig) -> None:
        self.runner = runner
        self.path, self.role, self.cfg = path, role, cfg
        graph = load_onnx(Path(path), load_external_data=False)
        weights = {t.name for t in graph.graph.initializer}
        self.specs = [s for s in specs_from_onnx(graph) if s.name not in weights]
        self.names = [o.name for o in graph.graph.output]
        self._decoded: dict[int, tuple[Mapping[str, np.ndarray], dict[str, np.ndarray], float]] = {}

    def decode(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the model on one call of a prompt decode (its data pass's batches) and remember the outputs.

        The pass then takes them for the same batch (:meth:`outputs_of`) instead of running it a second time.
        """
        start = time.perf_counter()
        out = self.runner.infer(feeds)
        self._decoded[id(feeds)] = (feeds, out, time.perf_counter() - start)
        return out

    def outputs_of(self, feeds: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float] | None:
        """The outputs :meth:`decode` got for this very batch and its run's seconds (forgotten once taken), or None."""
        hit = self._decoded.pop(id(feeds), None)
        return (hit[1], hit[2]) if hit is not None and hit[0] is feeds else None

    @contextlib.contextmanager
    def session(self) -> Iterator[Runner]:
        """The runner, active in the block."""
        try:
            self.runner.activate()
        except MpinferError as err:
            raise ModelLoadError(load_hint(f"{self.role} '{self.path}' could not be loaded: {err}", self.path,
                                            self.role, self.cfg)) from err
        except (OSError, ValueError, RuntimeError) as err:
            message = f"{self.role} '{self.path}' could not be loaded: {type(err).__name__}: {err}"
            raise ModelLoadError(load_hint(message, self.path, self.role, self.cfg)) from err
        try:
            yield self.runner
        finally:
            self._decoded.clear()
            self.runner.deactivate()
            release_memory()  # its session's heap given back before the next model's opens

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def input_specs(self) -> list[TensorSpec]:
        """The model's inputs, read off its graph."""
        return list(self.specs)

    def output_names(self) -> list[str]:
        """The model's outputs, read off its graph."""
        return list(self.names)


def load_hint(message: str, spec: str, role: str, cfg: CompareConfig) -> str:
    """A load error, plus for a BF16 candidate ONNX Runtime refuses how to compare it on this machine anyway."""
    if role != "Candidate" or cfg.numerics != "ort" or not str(spec).endswith(".onnx"):
        return message
    try:
        model = load_onnx(spec, load_external_data=False)
    except (MpinferError, OSError, ValueError):
        return message
    bf16 = 16  # TensorProto.BFLOAT16
    if not any(
        t.data_type == bf16 for g in iter_graphs(model.graph) for t in g.initializer
    ) and not any(
        a.name == "to" and a.i == bf16 for g in iter_graphs(model.graph) for n in g.node for a in n.attribute
    ):
        return message
    return message.rstrip(". ") + (
        ". Hint: the model computes in BF16, which ONNX Runtime's CPU provider does not run for most ops;"
        " compare it with `--numerics strict` (mpinfer's BF16 emulator), or on a GPU."
    )


def _check_batch_outputs(bout: Mapping[str, np.ndarray], cout: Mapping[str, np.ndarray], cname: str) -> None:
    for name, b in bout.items():
        c = cout[name]
        if b.shape != c.shape:
            raise InvalidInputError(
                format_message(
                    f"Candidate '{cname}': output '{name}'",
                    f"shape {c.shape}",
                    f"{b.shape} as the baseline's",
                    "both models must agree",
                )
            )
        if is_float_dtype(b.dtype) != is_float_dtype(c.dtype):
            raise InvalidInputError(
                format_message(
                    f"Candidate '{cname}': output '{name}'",
                    f"dtype {c.dtype}",
                    f"a dtype of the same kind as the baseline's {b.dtype}",
                )
            )


def _iter_progress(feeds: Any, show: bool) -> Iterator[dict[str, np.ndarray]]:

    with progress_bar("compare", enabled=show) as progress:
        task = progress.add_task("batches", total=len(feeds))
        for batch in feeds:
            yield batch
            progress.advance(task)


def _infer(runner: Runner, batch: Mapping[str, np.ndarray], who: str, index: int) -> dict[str, np.ndarray]:
    """One inference; a model that loads but fails to run (onnxruntime, torch) is named in the error."""
    try:
        return runner.infer(batch)
    except MpinferError as err:
        raise type(err)(f"{who}: {err}") from err
    except Exception as err:
        if type(err).__module__.split(".")[0] not in ("onnxruntime", "torch"):
            raise  # anything else is a bug in mpinfer: keep the traceback
        raise ModelLoadError(
            f"{who} failed to run on batch {index}: {type(err).__name__}: {str(err).strip()[:500]}"
        ) from err


def run_batches(
    cfg: CompareConfig,
    baseline: Runner,
    candidates: Mapping[str, Runner],
    feeds: Any,
    out_names: Sequence[str],
    checks: Checks,
    gen: GenerationPass | None = None,
) -> tuple[dict[str, ModelAccumulator], list[dict[str, Any]]]:
    """Every batch through the baseline and each candidate; their outputs' sums, and the batches kept.

    Returns:
        (each candidate's accumulated figures, the first batches kept for the divergence and latency).
    """
    accs = {
        c: ModelAccumulator(out_names, class_outputs=cfg.class_outputs, topk=checks.topk, user_metrics=cfg.metrics)
        for c in candidates
    }
    if not baseline.is_active:
        return _run_one_at_a_time(cfg, baseline, candidates, feeds, out_names, accs, gen)
    kept: list[dict[str, np.ndarray]] = []
    offset = 0
    labels = feeds.labels
    labeled: set[str] = set()
    for index, batch in enumerate(_iter_progress(feeds, cfg.show_progress)):
        n = next(iter(batch.values())).shape[0] if batch else 0
        lab = labels[offset : offset + n] if labels is not None and offset + n <= len(labels) else None
        offset += n
        bout = _infer(baseline, batch, f"Baseline '{cfg.baseline}'", index)
        if index == 0 and labels is not None:
            labeled = _labeled_outputs(labels, bout, n, cfg)
        for cname, runner in candidates.items():
            cout = _infer(runner, batch, f"Candidate '{cname}'", index)
            _check_batch_outputs(bout, cout, cname)
            for o in out_names:
                accs[cname].outputs[o].update(bout[o], cout[o], lab if o in labeled else None)
            accs[cname].update_user(bout, cout, batch, lab)
        if len(kept) < max(cfg.divergence_batches, 1):
            kept.append(batch)
    if not kept:
        raise InvalidInputError(
            format_message(
                f"Data '{cfg.data or 'random'}'",
                "no batches",
                "at least one batch of samples",
                "check the batch size against the number of samples",
            )
        )
    return accs, kept


def _run_one_at_a_time(
    cfg: CompareConfig,
    baseline: Any,
    candidates: Mapping[str, Any],
    feeds: Any,
    out_names: Sequence[str],
    accs: dict[str, ModelAccumulator],
    gen: GenerationPass | None = None,
) -> tuple[dict[str, ModelAccumulator], list[dict[str, Any]]]:
    """:func:`run_batches` with one model loaded at a time.

    The baseline's outputs of every batch are kept, then each candidate runs over the same batches and is
    compared with them. With ``gen`` (``--generate``), each model's greedy decodes run on the same session,
    before it closes: a model is loaded once for both.
    """
    labels = feeds.labels
    bouts: list[dict[str, np.ndarray]] = []
    labs: list[Any] = []
    kept: list[dict[str, np.ndarray]] = []
    labeled: set[str] = set()
    offset = 0
    # decoded prompts come from the baseline's runner during its pass: kept (small: one decode's feeds) for the
    # candidates, which cannot decode them again once the baseline is closed
    decoded: list[dict[str, np.ndarray]] | None = [] if hasattr(feeds, "batch_steps") else None  # a DecodeFeedSource
    with baseline.session():
        # the decodes on this session take the outputs of the pass's calls they repeat (GenerationPass.remember)
        known = gen if gen is not None and decoded is not None and _ort_session(baseline.runner) is not None else None
        for index, batch in enumerate(_iter_progress(feeds, cfg.show_progress)):
            if decoded is not None:
                decoded.append(batch)
            n = next(iter(batch.values())).shape[0] if batch else 0
            labs.append(labels[offset : offset + n] if labels is not None and offset + n <= len(labels) else None)
            offset += n
            # a decoded batch's outputs came with its decoding (the same session on the same feeds): not run again
            hit = baseline.outputs_of(batch) if decoded is not None else None
            if hit is None:
                start = time.perf_counter()
                out = _infer(baseline.runner, batch, f"Baseline '{cfg.baseline}'", index)
                hit = (out, time.perf_counter() - start)
            bouts.append({k: np.array(v) for k, v in hit[0].items()})
            if known is not None:
                known.remember(0, batch, bouts[-1], hit[1])
            if index == 0 and labels is not None:
                labeled = _labeled_outputs(labels, bouts[0], n, cfg)
            if len(kept) < max(cfg.divergence_batches, 1):
                kept.append(batch)
        if gen is not None and kept and _ort_session(baseline.runner) is not None:
            gen.baseline(_ort_session(baseline.runner))
    if not kept:
        raise InvalidInputError(format_message(f"Data '{cfg.data or 'random'}'", "no batches",
                                               "at least one batch of samples"))
    for number, (cname, runner) in enumerate(candidates.items()):
        with runner.session():
            known = gen if gen is not None and gen.ref is not None and decoded is not None and _ort_session(
                runner.runner) is not None else None
            for index, batch in enumerate(feeds if decoded is None else decoded):
                start = time.perf_counter()
                cout = _infer(runner.runner, batch, f"Candidate '{cname}'", index)
                if known is not None:
                    known.remember(number + 1, batch, cout, time.perf_counter() - start)
                _check_batch_outputs(bouts[index], cout, cname)
                for o in out_names:
                    accs[cname].outputs[o].update(bouts[index][o], cout[o], labs[index] if o in labeled else None)
                if cfg.metrics:
                    accs[cname].update_user(bouts[index], cout, batch, labs[index])
            if gen is not None and gen.ref is not None and _ort_session(runner.runner) is not None:
                gen.candidate(number, _ort_session(runner.runner))
    return accs, kept


def _ort_session(runner: Runner) -> Any:
    """The ONNX Runtime session of an active ONNX Runtime runner on the CPU (what generation decodes with)."""
    session = getattr(runner, "session", None) if isinstance(runner, OrtRunner) else None
    if session is None or session.get_providers()[:1] != ["CPUExecutionProvider"]:
        return None
    return session


def _labeled_outputs(labels: np.ndarray, bout: Mapping[str, np.ndarray], rows: int, cfg: CompareConfig) -> set[str]:
    """The outputs the data's ``_labels`` score: class scores of rank 2, one row per sample, every label a class.

    Raises:
        InvalidInputError: When the model has such outputs but the labels exceed the class count of each.
    """

    def is_class(o: str, b: np.ndarray) -> bool:
        return o in cfg.class_outputs if cfg.class_outputs is not None else guess_class_output(o, b)

    scored = {o: int(b.shape[-1]) for o, b in bout.items() if b.ndim == 2 and b.shape[0] == rows and is_class(o, b)}
    top = int(labels.max()) if labels.size else -1
    fit = {o for o, classes in scored.items() if top < classes}
    if scored and not fit:
        outs = ", ".join(f"'{o}' has {c}" for o, c in scored.items())
        raise InvalidInputError(
            format_message(
                f"Data '{cfg.data}': _labels",
                f"labels up to {top}",
                f"class indices in [0, {max(scored.values())})",
                f"output {outs} classes; the labels must index the model's classes",
            )
        )
    return fit


def model_size(path_or_spec: str) -> int | None:
    """Bytes on disk of a model file plus its external data files (None for a torch spec)."""
    from pathlib import Path

    p = Path(path_or_spec)
    if not p.is_file():
        return None
    size = p.stat().st_size
    data = data_file(p)
    return size + (data.stat().st_size if data.is_file() else 0)
