"""compare_models: the same feeds through baseline and candidates; metrics, checks, divergence, latency."""

from __future__ import annotations

import contextlib
import datetime
import logging
import platform
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

import mpinfer
from mpinfer.backends.base import Runner
from mpinfer.backends.torch_runner import TorchRunner
from mpinfer.checks import DEFAULT_CHECKS, Checks, parse_checks
from mpinfer.compare.candidates import baseline_copies, check_valid_candidate
from mpinfer.compare.config import CompareConfig
from mpinfer.compare.divergence import find_divergence, load_plan_nodes
from mpinfer.compare.hints import precision_summary, speed_hints
from mpinfer.compare.latency import measure_latency
from mpinfer.compare.passes import Remembered, load_hint, model_size, one_at_a_time, run_batches
from mpinfer.compare.result import CandidateResult, ComparisonResult, LatencyResult, OutputMetrics
from mpinfer.data import load_feeds, parse_dims
from mpinfer.data.feeds import fixed_batch, sample_axes
from mpinfer.data.samples import FingerprintedFeeds
from mpinfer.errors import InvalidInputError, ModelLoadError, MpinferError, format_message
from mpinfer.generation import GenerationPass, attach_generation, generate_config
from mpinfer.memory import budgeted
from mpinfer.metrics import LABEL_METRICS, ModelAccumulator, OutputAccumulator, check_output_names
from mpinfer.modelio import load_onnx
from mpinfer.runners import is_torch_spec, open_runner
from mpinfer.specs import TensorSpec
from mpinfer.usermetric import metric_names

logger = logging.getLogger(__name__)


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
            return Remembered(runner, spec, role, cfg)  # type: ignore[return-value]  # a Runner to every caller
        stack.enter_context(runner)
    except MpinferError as err:
        raise ModelLoadError(load_hint(f"{role} '{spec}' could not be loaded: {err}", spec, role, cfg)) from err
    except (OSError, ValueError, RuntimeError) as err:
        message = f"{role} '{spec}' could not be loaded: {type(err).__name__}: {err}"
        raise ModelLoadError(load_hint(message, spec, role, cfg)) from err
    return runner



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
        sequential = one_at_a_time(config)
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
        accs, kept = run_batches(config, baseline, cands, hashed, out_names, checks, gen)
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
    if gen is not None:  # (set when generation is): after the sessions above are closed, one model open at a time
        attach_generation(comparison, gen, checks)
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
