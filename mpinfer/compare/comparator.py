"""compare_models: the same feeds through baseline and candidates; metrics, checks, divergence, latency."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import platform
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import mpinfer
from mpinfer.backends.base import Runner
from mpinfer.backends.ort import OrtRunner
from mpinfer.backends.torch_runner import TorchRunner
from mpinfer.checks import DEFAULT_CHECKS, Checks, parse_checks
from mpinfer.compare.candidates import baseline_copies, check_valid_candidate
from mpinfer.compare.divergence import find_divergence, load_plan_nodes
from mpinfer.compare.hints import precision_summary, speed_hints
from mpinfer.compare.latency import measure_latency
from mpinfer.compare.result import CandidateResult, ComparisonResult, LatencyResult, OutputMetrics
from mpinfer.data import load_feeds, parse_dims
from mpinfer.data.feeds import fixed_batch, sample_axes
from mpinfer.data.samples import FingerprintedFeeds
from mpinfer.errors import InvalidInputError, ModelLoadError, MpinferError, format_message
from mpinfer.generation import GenerationPass, attach_generation, generate_config
from mpinfer.memory import budgeted, current_budget, release_memory
from mpinfer.metrics import LABEL_METRICS, ModelAccumulator, OutputAccumulator, check_output_names, guess_class_output
from mpinfer.modelio import data_file, iter_graphs, load_onnx
from mpinfer.progress import progress_bar
from mpinfer.runners import is_torch_spec, open_runner
from mpinfer.specs import TensorSpec, is_float_dtype, specs_from_onnx
from mpinfer.usermetric import as_metrics, metric_names

logger = logging.getLogger(__name__)

# Batches kept for the per-layer divergence: enough for a stable relative error, few enough that both models
# run only (tensors / CHUNK_SIZE) x 2 times per batch.
DIVERGENCE_BATCHES = 2


@dataclass(frozen=True)
class CompareConfig:
    """What to compare and how.

    Attributes:
        baseline: FP32 reference: ``.onnx``, engine or ``file.py:factory[@weights]``.
        candidates: One or more models to compare against it.
        data: Data source (``.npz``, folder, ``random[:N]``; None = random).
        checks: Thresholds in the check grammar of :mod:`mpinfer.checks`, e.g.
            ``"cosine>=0.9999,logits:top1>=0.999"`` (None = DEFAULT_CHECKS).
        class_outputs: The outputs that hold class scores (top-k applies to them alone); None guesses each
            (:func:`mpinfer.metrics.guess_class_output`), ``()`` says none does.
        latency: Measure latency too.
        batch_sizes: Latency batch sizes (default: the data's batch size).
        iterations: Timed latency runs per runner and batch size (the cap when time_budget_s is set).
        warmup: Untimed runs first.
        time_budget_s: Stop timing a runner after this many seconds.
        numerics: ``ort`` or ``strict`` (strict FP16/BF16 emulation for ONNX candidates).
        device: ``cpu``, ``cuda`` or ``auto``.
        batch_size: Samples per batch of the data.
        num_batches: Cap on the batches compared.
        dims: Sizes for symbolic dims of random data, ``("seq=32",)``.
        input_ranges: Value ranges of random data per input, ``("input_ids=0..30522",)``.
        image_preprocess: Preprocessing of a ``data`` folder of images (``size=HxW,mean=..,std=..,mode=L``).
        divergence: Locate the node where the error jumps (ONNX baseline and candidate).
        divergence_batches: Batches used for it.
        seed: Seed for random data.
        show_progress: Show rich progress bars.
        memory_limit: ``--memory-limit`` (a size or a share of the available memory; :mod:`mpinfer.memory`);
            None = the default budget.
        generate: Decoders with a KV cache: greedily generate this many tokens for every prompt of ``data``
            with each model (:mod:`mpinfer.generation`); its figures are checkable (``token_agreement``...).
        metrics: The user's own metrics (:mod:`mpinfer.usermetric`): ``UserMetric`` objects, ``NAME=PATH.py:FUNC``
            strings or a mapping of name to callable or ``PATH.py:FUNC``; their figures are checkable.
    """

    baseline: str
    candidates: tuple[str, ...]
    data: str | None = None
    checks: str | None = None
    class_outputs: tuple[str, ...] | None = None
    latency: bool = False
    batch_sizes: tuple[int, ...] = ()
    iterations: int = 50
    warmup: int = 5
    time_budget_s: float | None = None
    numerics: str = "ort"
    device: str = "cpu"
    batch_size: int | None = None
    num_batches: int | None = None
    dims: tuple[str, ...] = ()
    image_preprocess: str | None = None
    input_ranges: tuple[str, ...] = ()
    divergence: bool = True
    divergence_batches: int = DIVERGENCE_BATCHES
    seed: int = 0
    show_progress: bool = True
    memory_limit: str | int | None = None
    generate: int | None = None
    metrics: Any = ()

    def __post_init__(self) -> None:
        """Accept ``pathlib.Path`` models and data (as the README's API example passes them)."""
        # The API takes paths as str or os.PathLike (a single candidate too); runners and reports use str.
        cands = (self.candidates,) if isinstance(self.candidates, (str, os.PathLike)) else self.candidates
        object.__setattr__(self, "baseline", os.fspath(self.baseline))
        object.__setattr__(self, "candidates", tuple(os.fspath(c) for c in cands))
        if self.data is not None:
            object.__setattr__(self, "data", os.fspath(self.data))
        if self.class_outputs is not None:  # a TOML list, or one name
            names = (self.class_outputs,) if isinstance(self.class_outputs, str) else self.class_outputs
            object.__setattr__(self, "class_outputs", tuple(names))
        object.__setattr__(self, "metrics", as_metrics(self.metrics))  # loaded (and clashes refused) once


def _validate_config(cfg: CompareConfig) -> Checks:

    checks = parse_checks(cfg.checks if cfg.checks and cfg.checks.strip() else DEFAULT_CHECKS,
                          metric_names(cfg.metrics))
    if checks.generation and not cfg.generate:
        raise InvalidInputError(format_message(
            "--check", ", ".join(str(c) for c in checks.generation), "generation checks together with --generate N",
            "generation figures come from greedy decoding: add --generate N (generate = N in pipeline.toml) and "
            "--data prompts.npz"))
    if not cfg.candidates:
        raise InvalidInputError(format_message("Candidates", "none", "at least one model to compare"))
    for cand in cfg.candidates:
        if is_torch_spec(cand):
            raise InvalidInputError(
                format_message(
                    f"Candidate '{cand}'",
                    "a torch model (file.py:factory)",
                    "an .onnx file or an engine",
                    "a torch model can only be the baseline (its outputs take the candidates' names); "
                    "pass it as BASELINE, or export it (mpinfer export) and compare the .onnx",
                )
            )
    positive = (
        ("--iterations", cfg.iterations),
        ("--divergence-batches", cfg.divergence_batches),
        ("--batch-size", cfg.batch_size),
        ("--num-batches", cfg.num_batches),
    )
    for what, value in positive:
        if value is not None and value < 1:
            raise InvalidInputError(format_message(what, value, "a positive integer"))
    if cfg.warmup < 0:
        raise InvalidInputError(format_message("--warmup", cfg.warmup, "an integer >= 0", "0 skips the warm-up"))
    bad = [b for b in cfg.batch_sizes if b < 1]
    if bad:
        raise InvalidInputError(
            format_message("--batch-sizes", ",".join(map(str, cfg.batch_sizes)), "batch sizes >= 1", "e.g. 1,8,32")
        )
    if cfg.time_budget_s is not None and not cfg.time_budget_s > 0:  # NaN too
        raise InvalidInputError(
            format_message("--time-budget", f"{cfg.time_budget_s:g} s", "a number of seconds > 0",
                           "omit it to time exactly --iterations runs")
        )
    return checks


def _activate(
    stack: contextlib.ExitStack, spec: str, role: str, cfg: CompareConfig, sequential: bool = False
) -> Runner:
    """Open and activate one runner, naming the model in any load error.

    ``sequential``: the runner is activated alone, its specs and output names kept, and deactivated; it is
    activated once more for its pass over the data.
    """
    # an ONNX candidate run outside ONNX Runtime is checked (under ONNX Runtime its own session is the load check)
    if role == "Candidate" and cfg.numerics != "ort" and str(spec).lower().endswith(".onnx"):
        check_valid_candidate(spec, cfg.baseline)
    try:
        runner = open_runner(
            spec, device=cfg.device, numerics=cfg.numerics if role == "Candidate" else "ort", name=spec
        )
        if sequential:  # one model in memory at a time: its specs read off the graph, loaded for its pass alone
            return _Remembered(runner, spec, role, cfg)  # type: ignore[return-value]  # a Runner to every caller
        stack.enter_context(runner)
    except MpinferError as err:
        raise ModelLoadError(_with_hint(f"{role} '{spec}' could not be loaded: {err}", spec, role, cfg)) from err
    except (OSError, ValueError, RuntimeError) as err:
        message = f"{role} '{spec}' could not be loaded: {type(err).__name__}: {err}"
        raise ModelLoadError(_with_hint(message, spec, role, cfg)) from err
    return runner


# Models on disk above this share of the memory budget are compared one at a time (baseline first, its outputs
# kept, then each candidate), not all loaded at once: with ONNX Runtime's CPU provider an FP16 candidate's
# session holds FP32 copies of its weights, so baseline + candidate came to twice the FP32 model.
ONE_AT_A_TIME_SHARE = 4


def _one_at_a_time(cfg: CompareConfig) -> bool:
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


class _Remembered:
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
            raise ModelLoadError(_with_hint(f"{self.role} '{self.path}' could not be loaded: {err}", self.path,
                                            self.role, self.cfg)) from err
        except (OSError, ValueError, RuntimeError) as err:
            message = f"{self.role} '{self.path}' could not be loaded: {type(err).__name__}: {err}"
            raise ModelLoadError(_with_hint(message, self.path, self.role, self.cfg)) from err
        try:
            yield self.runner
        finally:
            self._decoded.clear()
            self.runner.deactivate()
            release_memory()  # its session's heap given back before the next model's opens

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def input_specs(self) -> list[TensorSpec]:
        return list(self.specs)

    def output_names(self) -> list[str]:
        return list(self.names)


def _with_hint(message: str, spec: str, role: str, cfg: CompareConfig) -> str:
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


def _check_specs(base: Sequence[TensorSpec], cand: Sequence[TensorSpec], bname: str, cname: str) -> None:
    bmap, cmap = {s.name: s for s in base}, {s.name: s for s in cand}
    if set(bmap) != set(cmap):
        raise InvalidInputError(
            format_message(
                f"Candidate '{cname}': input names",
                sorted(cmap),
                f"the baseline's {sorted(bmap)}",
                "compare models exported from the same network (convert keeps input names)",
            )
        )
    for name, b in bmap.items():
        c = cmap[name]
        if b.dtype != c.dtype:
            raise InvalidInputError(
                format_message(
                    f"Candidate '{cname}': input '{name}'",
                    f"dtype {c.dtype}",
                    f"{b.dtype} as in baseline '{bname}'",
                    "convert with --keep-io-types so the candidate takes the same inputs",
                )
            )
        fixed_mismatch = any(
            isinstance(x, int) and isinstance(y, int) and x != y
            for x, y in zip(b.shape, c.shape, strict=False)
        )
        if len(b.shape) != len(c.shape) or fixed_mismatch:
            raise InvalidInputError(
                format_message(
                    f"Candidate '{cname}': input '{name}'",
                    f"shape {tuple(c.shape)}",
                    f"{tuple(b.shape)} as in baseline '{bname}'",
                    "both models must take the same input shapes",
                )
            )


def _check_outputs(bnames: Sequence[str], cnames: Sequence[str], cname: str) -> None:
    if set(bnames) != set(cnames):
        missing = [n for n in bnames if n not in cnames]
        extra = [n for n in cnames if n not in bnames]
        raise InvalidInputError(
            format_message(
                f"Candidate '{cname}': output names",
                sorted(cnames),
                f"the baseline's {sorted(bnames)}",
                f"missing {missing}, unexpected {extra}; compare models of the same network",
            )
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


def _specs_of(baseline: Runner, candidates: Mapping[str, Runner], cfg: CompareConfig) -> list[TensorSpec]:
    specs = baseline.input_specs()
    for name, runner in candidates.items():
        cspecs = runner.input_specs()
        if not specs:
            specs = cspecs
        _check_specs(specs, cspecs, cfg.baseline, name)
    return specs


def _output_names(baseline: Runner, candidates: Mapping[str, Runner]) -> list[str]:

    first = next(iter(candidates.values()))
    if isinstance(baseline, TorchRunner) and not baseline.output_names():
        baseline.set_output_names(first.output_names())
    names = baseline.output_names()
    for cname, runner in candidates.items():
        _check_outputs(names, runner.output_names(), cname)
    return names


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


def _run_batches(
    cfg: CompareConfig,
    baseline: Runner,
    candidates: Mapping[str, Runner],
    feeds: Any,
    out_names: Sequence[str],
    checks: Checks,
    gen: GenerationPass | None = None,
) -> tuple[dict[str, ModelAccumulator], list[dict[str, Any]]]:
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
    """:func:`_run_batches` with one model loaded at a time.

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


def _check_label_metrics(checks: Checks, has_labels: bool, cfg: CompareConfig) -> None:
    """Refuse, before any batch runs, a check against labels on data without ``_labels``."""
    needs = [str(c) for c in checks if c.metric in LABEL_METRICS]
    if needs and not has_labels:
        raise InvalidInputError(
            format_message(
                f"Check '{needs[0]}'",
                f"data '{cfg.data or 'random'}' without _labels",
                "data with a _labels array (one integer class per sample)",
                "pass --data FILE.npz with _labels, or check agreement with the baseline instead (top1, top5)",
            )
        )


@budgeted
def compare_models(config: CompareConfig) -> ComparisonResult:
    """Compare one baseline with one or more candidates on the same data.

    Args:
        config: What to compare and how.

    Returns:
        The ComparisonResult; ``bool(result)`` is True when every check passed.

    Raises:
        InvalidInputError: Mismatched models or data, bad data, unknown checks.
        ModelLoadError: A model that cannot be loaded (named in the message).
    """
    checks = _validate_config(config)
    same_as_baseline = baseline_copies(config.baseline, config.candidates)  # warned before the (long) run
    generation = generate_config(config, config.generate) if config.generate else None  # checked before any run
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        sequential = _one_at_a_time(config)
        baseline = _activate(stack, config.baseline, "Baseline", config, sequential)
        cands = {c: _activate(stack, c, "Candidate", config, sequential) for c in config.candidates}
        specs = _specs_of(baseline, cands, config)
        out_names = _output_names(baseline, cands)
        checks.check_outputs(out_names)
        if config.class_outputs is not None:
            check_output_names(config.class_outputs, out_names, "--class-outputs")
        feeds = _open_data(config, specs, None if baseline.is_active else baseline)
        _check_label_metrics(checks, feeds.labels is not None, config)

        hashed = FingerprintedFeeds(feeds)  # the data's fingerprint, to set beside a plan's verified figures
        gen = GenerationPass(generation) if generation is not None else None
        accs, kept = _run_batches(config, baseline, cands, hashed, out_names, checks, gen)
        results = [_candidate_result(config, c, cands[c], accs[c], out_names, checks) for c in cands]
        latency = _latency(config, baseline, cands, kept[0]) if config.latency else None
        base_info = {
            "name": config.baseline,
            "path": config.baseline,
            "runner": baseline.describe(),
            "size_bytes": model_size(config.baseline),
        }
    for result in results:  # after the runners are closed: the divergence opens sessions of its own
        if result.path.lower().endswith(".onnx"):
            _onnx_extras(config, result, kept)
    notes = _notes(feeds.is_random, result_runners=[c.runner for c in results], latency=latency is not None)
    notes += same_as_baseline
    logger.info("compare finished in %.1f s", time.perf_counter() - t0)
    comparison = ComparisonResult(
        baseline=base_info,
        candidates=results,
        checks=[str(c) for c in checks],
        data=_data_record(config, feeds, hashed),
        environment=_environment(config),
        latency=latency,
        notes=notes,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        user_metrics={m.name: m.record() for m in config.metrics},
    )
    if generation is not None:  # after the sessions above are closed: one model open at a time
        attach_generation(comparison, gen if gen is not None else GenerationPass(generation), checks)
    return comparison


def _open_data(config: CompareConfig, specs: Any, sequential: Any = None) -> Any:
    """The comparison's batches, from the options as the CLI names them.

    ``sequential``: the baseline when models run one at a time. Prompts for a KV-cache model are then decoded
    by the baseline's own runner during its pass (no second session of the FP32 model), and the batches are
    kept for the candidates' passes (:func:`_run_one_at_a_time`).
    """
    decoder: Any = config.baseline
    if sequential is not None:

        def decoder(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            return sequential.decode(feeds)  # the outputs kept for its data pass (_run_one_at_a_time)

    return load_feeds(
        config.data,
        specs,
        model=decoder,  # decodes prompts for a KV-cache model (mpinfer.data.decode)
        batch_size=config.batch_size,
        num_batches=config.num_batches,
        seed=config.seed,
        dims=parse_dims(config.dims),
        image_preprocess=config.image_preprocess,
        input_ranges=config.input_ranges,
    )


def _data_record(config: CompareConfig, feeds: Any, hashed: FingerprintedFeeds) -> dict[str, Any]:
    """What the result says about the data compared on (with the fingerprint of the batches read)."""
    return {
        "source": config.data or "random",
        "kind": feeds.kind,
        "description": feeds.description,
        "batches": len(feeds),
        "samples": feeds.num_samples,
        "labels": feeds.labels is not None,
        "fingerprint": hashed.fingerprint(),
    }


def _candidate_result(
    cfg: CompareConfig,
    name: str,
    runner: Runner,
    accs: ModelAccumulator,
    out_names: Sequence[str],
    checks: Checks,
) -> CandidateResult:
    outputs = []
    for o in out_names:
        a: OutputAccumulator = accs.outputs[o]
        outputs.append(
            OutputMetrics(
                name=o,
                shape=list(a.shape or ()),
                baseline_dtype=a.baseline_dtype,
                candidate_dtype=a.candidate_dtype,
                classifier=bool(a.classes),
                values=a.finalize(),
                hist_abs=a.hist_abs.to_dict(),
                hist_rel=a.hist_rel.to_dict(),
            )
        )
    result = CandidateResult(
        name=name, path=name, runner=runner.describe(), outputs=outputs, size_bytes=model_size(name),
        metrics=accs.user_figures() if cfg.metrics else None,
    )
    result.evaluate(checks)
    return result


def _onnx_extras(cfg: CompareConfig, result: CandidateResult, kept: list[dict[str, Any]]) -> None:

    model = load_onnx(result.path, load_external_data=False)  # the graph: hints and counts read no weights
    result.precision = precision_summary(model, result.path)
    result.hints = speed_hints(model, load_plan_nodes(result.path))
    if cfg.divergence and cfg.baseline.lower().endswith(".onnx"):
        result.divergence = find_divergence(
            cfg.baseline,
            result.path,
            kept[: cfg.divergence_batches],
            device=cfg.device,
            numerics=cfg.numerics,
            show_progress=cfg.show_progress,
        )


def _latency(
    cfg: CompareConfig, baseline: Runner, cands: Mapping[str, Runner], sample: Mapping[str, np.ndarray]
) -> LatencyResult:

    runners = {cfg.baseline: baseline, **cands}
    specs = baseline.input_specs()
    axes = sample_axes(specs)
    batched = [(n, a) for n, a in axes.items() if a is not None and n in sample]
    sizes = cfg.batch_sizes or ((sample[batched[0][0]].shape[batched[0][1]],) if batched else (1,))
    fixed = fixed_batch(specs)
    whole = [s.name for s in specs if s.shape and axes[s.name] is None]
    if (fixed or whole) and cfg.batch_sizes:
        rows = {sample[n].shape[a] for n, a in batched}
        allowed = {fixed} if fixed else rows
        if any(b not in allowed for b in sizes):
            why = (
                "the model has a fixed batch dimension"
                if fixed
                else f"input(s) {', '.join(whole)} have no batch dim by name, so the data's batch is the only one"
            )
            raise InvalidInputError(format_message("--batch-sizes", list(sizes), f"{sorted(allowed)} only", why))
    stats = measure_latency(
        runners,
        sample,
        sizes,
        warmup=cfg.warmup,
        iterations=cfg.iterations,
        time_budget_s=cfg.time_budget_s,
        show_progress=cfg.show_progress,
        axes=axes,
    )
    return LatencyResult(
        device=used_device(runners.values()),
        warmup=cfg.warmup,
        iterations=cfg.iterations,
        time_budget_s=cfg.time_budget_s,
        runners={n: r.describe() for n, r in runners.items()},
        stats=stats,
    )


def used_device(runners: Iterable[Runner]) -> str:
    """The device the (active) runners use, from ``describe()``: ``cpu``, ``cuda``, ``cuda:0`` (joined by ``+``)."""
    devices = []
    for runner in runners:
        info = runner.describe()
        providers = info.get("providers") or []
        if providers:
            dev = "cuda" if str(providers[0]).startswith("CUDA") else "cpu"
        else:
            dev = str(info.get("device") or "cpu")  # torch, TensorRT; the strict emulator runs numpy on the CPU
        devices.append(dev)
    return "+".join(dict.fromkeys(devices))


def model_size(path_or_spec: str) -> int | None:
    """Bytes on disk of a model file plus its external data files (None for a torch spec)."""
    from pathlib import Path

    p = Path(path_or_spec)
    if not p.is_file():
        return None
    size = p.stat().st_size
    data = data_file(p)
    return size + (data.stat().st_size if data.is_file() else 0)


def _notes(is_random: bool, result_runners: Sequence[Mapping[str, Any]], latency: bool) -> list[str]:
    notes = []
    if is_random:
        notes.append("Random input data: the errors say little about real inputs; pass --data.")
    if latency and any(r.get("backend") == "mpinfer-strict" for r in result_runners):
        notes.append(
            "Strict-numerics candidates are timed in the numpy emulator: their latency says nothing about "
            "FP16 speed; time them with --numerics ort or as an engine."
        )
    if latency and any(str(r.get("numerics")) == "ort-cpu" for r in result_runners):
        notes.append(
            "Latency on onnxruntime's CPU provider: it has few FP16 kernels and runs FP16 models through "
            "inserted Casts, so FP16 is rarely faster here; measure on a GPU (--device cuda) or an engine."
        )
    return notes


def _environment(cfg: CompareConfig) -> dict[str, Any]:
    import sys

    import onnxruntime

    env = {
        "mpinfer": mpinfer.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "numpy": np.__version__,
        "onnxruntime": onnxruntime.__version__,
        "device": cfg.device,
        "numerics": cfg.numerics,
    }
    if "torch" in sys.modules:
        env["torch"] = sys.modules["torch"].__version__
    return env
