"""``mpinfer compare``: accuracy diff (and latency) of candidates against an FP32 baseline."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import click

from mpinfer.checks import ALIASES
from mpinfer.claim import claim_outputs
from mpinfer.commands import class_outputs_option, input_range_option, memory_limit_option, metric_option
from mpinfer.compare import CompareConfig, ComparisonResult, compare_models
from mpinfer.fileio import check_output_path
from mpinfer.metrics import METRIC_DOCS
from mpinfer.report import FILE_NAMES, write_report
from mpinfer.report.console import render_console
from mpinfer.report.generation import print_console

logger = logging.getLogger(__name__)
# Options that only shape the latency measurement: warned about when given without --latency.
LATENCY_OPTIONS = ("batch_sizes", "iterations", "warmup", "time_budget")
# Options that shape what the command prints or writes, not the comparison (no CompareConfig field) ...
OUTPUT_OPTIONS = ("report_dir", "force", "quiet", "as_json")
# ... and options whose CompareConfig field has another name; every other option is the field of its name.
CONFIG_NAMES = {"time_budget": "time_budget_s", "generate_tokens": "generate"}


def _ints(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...]:
    if not value:
        return ()
    try:
        sizes = tuple(int(v) for v in value.split(","))
    except ValueError as err:
        raise click.BadParameter(f"{value!r}: write comma-separated integers, e.g. 1,8,32") from err
    if any(b < 1 for b in sizes):
        raise click.BadParameter(f"{value!r}: batch sizes must be >= 1, e.g. 1,8,32")
    return sizes


def _warn_latency_options(ctx: click.Context) -> None:
    """Latency options given without --latency do nothing: say so once."""
    given = [
        "--" + name.replace("_", "-")
        for name in LATENCY_OPTIONS
        if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)
    ]
    if given:
        logger.warning("%s only apply with --latency; ignored without it", "/".join(given))


@click.command(
    epilog="Checks: [OUTPUT:]METRIC OP NUMBER, comma-separated; without OUTPUT: every output the metric applies "
    "to. Metrics: " + ", ".join(METRIC_DOCS) + ", any topK (aliases: "
    + ", ".join(f"{alias}={name}" for alias, name in ALIASES.items()) + "). Operators: >= <= > < ==. "
    "Generation figures (token_agreement ... ppl_ratio) are model-level, plain or as generate:METRIC, and need "
    "--generate N. Metrics of your own (--metric NAME=FILE.py:FUNCTION) are model-level too: NAME, NAME_min, "
    "NAME_max. Definitions: docs/compare.md."
)
@click.argument("baseline")
@click.argument("candidates", nargs=-1, required=True)
@click.option(
    "--data",
    help="Data: an .npz, a folder of .npz or <input>.npy files, a folder of images (see --image-preprocess), "
    "prompts:FILE[:steps=N] (a decoder with a KV cache: prefill and N greedy steps; FILE an .npz of input_ids or a "
    "text file with :tokenizer=DIR), or random[:N] (default random).",
)
@click.option(
    "--check",
    "checks",
    help='Thresholds, e.g. "cosine>=0.9999,logits:top1>=0.999" (default '
    '"cosine>=0.999,nonfinite<=0"). Exit 1 when one fails.',
)
@class_outputs_option
@metric_option
@click.option("--latency", is_flag=True, help="Measure latency of the baseline and every candidate.")
@click.option(
    "--generate",
    "generate_tokens",
    type=click.IntRange(min=1),
    help="Decoders with a KV cache: greedily generate N tokens for every prompt of --data (an .npz of input_ids) "
    "with each model and report token agreement, first divergence, per-step logits cosine, perplexity and "
    "prefill/decode latency.",
)
@click.option("--batch-sizes", callback=_ints, help="Latency batch sizes, e.g. 1,8,32 (default: the data's).")
@click.option(
    "--iterations",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="Timed runs per runner and batch size.",
)
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True, help="Untimed runs first.")
@click.option(
    "--time-budget",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds of timed runs per runner and batch size (caps --iterations).",
)
@click.option(
    "--report",
    "report_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write index.html, report.md and report.json into this folder.",
)
@click.option("--force", is_flag=True, help="Overwrite existing report files.")
@click.option(
    "--numerics",
    type=click.Choice(["ort", "strict"]),
    default="ort",
    show_default=True,
    help="Run ONNX candidates with onnxruntime's kernels or the strict FP16/BF16 emulation.",
)
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="auto", show_default=True,
              help="auto: the CUDA provider where a GPU is usable, else CPU (as build-engine and train).")
@click.option(
    "--batch-size", type=click.IntRange(min=1), help="Samples per batch (default 16, or the model's fixed batch)."
)
@click.option("--num-batches", type=click.IntRange(min=1), help="Compare at most this many batches.")
@click.option("--dim", "dims", multiple=True, help="Size of a symbolic dim for random data, e.g. seq=32.")
@input_range_option
@click.option(
    "--image-preprocess",
    metavar="SPEC",
    help="For a --data folder of images: size=HxW,mean=a/b/c,std=a/b/c,scale=255,layout=nchw|nhwc,mode=RGB|L|BGR.",
)
@click.option(
    "--divergence/--no-divergence",
    default=True,
    show_default=True,
    help="Locate the node where the error jumps (ONNX baseline and candidates).",
)
@click.option(
    "--divergence-batches",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Batches the per-layer divergence compares (both models run once per batch per chunk of tensors: at "
    "most 64, and fewer when their bytes pass the chunk's memory cap, see docs/compare.md).",
)
@memory_limit_option
@click.option("--quiet", is_flag=True, help="No progress bars or tables; only the verdict.")
@click.option("--json", "as_json", is_flag=True, help="Print the report JSON to stdout (for scripts).")
@click.pass_context
def compare(
    ctx: click.Context,
    baseline: str,
    candidates: tuple[str, ...],
    data: str | None,
    checks: str | None,
    class_outputs: tuple[str, ...] | None,
    metrics: tuple[object, ...],
    latency: bool,
    generate_tokens: int | None,
    batch_sizes: tuple[int, ...],
    iterations: int,
    warmup: int,
    time_budget: float | None,
    report_dir: Path | None,
    force: bool,
    numerics: str,
    device: str,
    batch_size: int | None,
    num_batches: int | None,
    dims: tuple[str, ...],
    input_ranges: tuple[str, ...],
    image_preprocess: str | None,
    divergence: bool,
    divergence_batches: int,
    memory_limit: str | None,
    quiet: bool,
    as_json: bool,
) -> object:
    """Compare CANDIDATES (FP16 ONNX, engines) against the FP32 BASELINE on the same data.

    \b
    mpinfer compare out/model.onnx out/model.fp16.onnx --data calibration/digits.npz \\
        --check "cosine>=0.9999,top1>=0.999" --latency --report out/report
    """  # noqa: D301 (click needs the \b)
    quiet = quiet or bool(ctx.obj and ctx.obj.get("quiet"))
    if not latency:
        _warn_latency_options(ctx)
    if report_dir is not None:  # refuse existing files before the (long) comparison
        for name in FILE_NAMES.values():
            check_output_path(report_dir / name, force=force)
    fields = {CONFIG_NAMES.get(k, k): v for k, v in ctx.params.items() if k not in OUTPUT_OPTIONS}
    config = CompareConfig(**fields, show_progress=not (quiet or as_json))
    result, paths = _compare_and_report(config, report_dir, force)
    _show(result, paths, quiet=quiet, as_json=as_json)
    if (ctx.obj or {}).get("api"):  # mpinfer.compare(): bool(result) is the verdict
        return result
    if not result:
        click.echo(result.summary(), err=True)
        ctx.exit(1)
    if quiet and not as_json:
        click.echo(result.summary())
    return result


def _compare_and_report(
    config: CompareConfig, report_dir: Path | None, force: bool
) -> tuple[ComparisonResult, dict[str, Path]]:
    """Compare, and write the report files when ``report_dir`` is given (claimed before the comparison)."""
    with contextlib.ExitStack() as stack:
        claim = None
        if report_dir is not None:  # claimed before the comparison: a second run on the folder fails at once
            claim = stack.enter_context(claim_outputs([report_dir / n for n in FILE_NAMES.values()], force=force))
        result = compare_models(config)  # with --generate: data.generation, checkable (token_agreement...)
        paths = write_report(result, report_dir, force=force, claim=claim) if report_dir is not None else {}
    return result, paths


def _show(result: ComparisonResult, paths: dict[str, Path], *, quiet: bool, as_json: bool) -> None:
    """The report JSON (``--json``), or the console tables and the files written (unless ``--quiet``)."""
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    elif not quiet:
        render_console(result)
        print_console(result)
        for fmt, path in paths.items():
            click.echo(f"wrote {fmt}: {path}")
