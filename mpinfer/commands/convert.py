"""``mpinfer convert``: FP32 ONNX → mixed FP16/BF16 ONNX with a plan (thin layer over convert_precision)."""

from __future__ import annotations

from pathlib import Path

import click

from mpinfer.checks import parse_checks
from mpinfer.commands import class_outputs_option, input_range_option, memory_limit_option, metric_option
from mpinfer.data import parse_dims
from mpinfer.modelio import MAX_OPSET
from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.precision.budget import budget_figures
from mpinfer.precision.options import DEFAULT_BUDGET, DEFAULT_SEARCH_SAMPLES, NUMERICS, RANDOM_INPUTS
from mpinfer.specs import Precision


@click.command("convert")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Converted model; the plan is written next to it as <name>.plan.json.",
)
@click.option(
    "--precision",
    type=click.Choice(["fp16", "bf16"]),
    help="Low precision (default fp16; with --plan, the plan's: a different one is refused).",
)
@click.option(
    "--calibration",
    help="Data for the reference run: an .npz, a folder of .npz or <input>.npy files, a folder of images (see "
    "--image-preprocess), prompts:FILE[:steps=N] (a decoder with a KV cache: prefill and N greedy steps; FILE an "
    ".npz of input_ids or a text file with :tokenizer=DIR), random[:N], or none (rules only). "
    "Default: seeded random data from the input specs.",
)
@click.option(
    "--budget",
    help='Accuracy budget, e.g. "cosine>=0.9999,top1>=0.999,max_abs<=1e-2" or "logits:top1>=0.99,boxes:max_abs<=0.5" '
    "(the check grammar of `mpinfer compare --check`; metrics defined in docs/compare.md), verified on every "
    "calibration sample before anything is written. Default with any data (yours, or the random default): the "
    "floor \"" + DEFAULT_BUDGET
    + '" (cosine_min only on outputs with more than one value per sample); "none": no budget.',
)
@class_outputs_option
@metric_option
@click.option(
    "--plan",
    "plan",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Re-apply an (edited) plan instead of planning.",
)
@click.option("--keep-op", "keep_ops", multiple=True, help="Op type kept FP32 (repeatable).")
@click.option("--keep-node", "keep_nodes", multiple=True, help="Node-address regex kept FP32 (repeatable).")
@click.option("--low-op", "low_ops", multiple=True, help="Op type forced to low precision (repeatable).")
@click.option("--low-node", "low_nodes", multiple=True, help="Node-address regex forced low (repeatable).")
@click.option(
    "--keep-fp32-from",
    type=click.Path(dir_okay=False, path_type=Path),
    help="overflow.json from `mpinfer train`: its modules stay FP32.",
)
@click.option(
    "--numerics",
    type=click.Choice(NUMERICS),
    help="Numerics that verify search candidates and the final model: strict FP16/BF16 emulation (default), "
    "ONNX Runtime's CPU kernels (ort), ONNX Runtime's CUDA kernels (ort-cuda: onnxruntime-gpu and a GPU) or a "
    "TensorRT engine per candidate (tensorrt: TensorRT and an NVIDIA GPU).",
)
@click.option(
    "--keep-io-types/--no-keep-io-types",
    default=None,
    help="Keep graph inputs and outputs FP32 (default: keep; with --plan, the plan's, and a given one is applied).",
)
@click.option(
    "--opset",
    type=click.IntRange(7, MAX_OPSET),
    help="Upgrade the model to this ONNX opset first, e.g. 22 for BF16 Conv/pooling (default: as it is; "
    "with --plan, the plan's).",
)
@click.option("--force", is_flag=True, help="Overwrite the output; re-plan an already-FP16 model.")
@memory_limit_option
@click.option("--seed", type=int, help="Seed for random calibration data (default 0).")
@click.option("--max-batches", type=click.IntRange(min=1), help="Cap on calibration batches.")
@click.option(
    "--batch-size", type=click.IntRange(min=1), help="Calibration samples per batch (default 16, or the model's)."
)
@click.option(
    "--search-samples",
    type=click.IntRange(min=1),
    help=f"Calibration samples the budget search reads (default {DEFAULT_SEARCH_SAMPLES}; fewer when their FP32 "
    "tensors are large). The final verification reads all of them.",
)
@click.option(
    "--verify-samples",
    type=click.IntRange(min=1),
    help="Calibration samples the final verification reads (default: all).",
)
@click.option("--dim", "dims", multiple=True, help="Size of a symbolic dim for random data, e.g. height=48.")
@input_range_option
@click.option(
    "--image-preprocess",
    metavar="SPEC",
    help="For a --calibration folder of images: size=HxW,mean=a/b/c,std=a/b/c,scale=255,layout=nchw|nhwc,"
    "mode=RGB|L|BGR.",
)
@click.pass_context
def convert(
    ctx: click.Context,
    model: Path,
    output: Path,
    precision: str | None,
    calibration: str | None,
    budget: str | None,
    class_outputs: tuple[str, ...] | None,
    metrics: tuple[object, ...],
    plan: Path | None,
    keep_ops: tuple[str, ...],
    keep_nodes: tuple[str, ...],
    low_ops: tuple[str, ...],
    low_nodes: tuple[str, ...],
    keep_fp32_from: Path | None,
    numerics: str | None,
    keep_io_types: bool | None,
    opset: int | None,
    force: bool,
    seed: int | None,
    max_batches: int | None,
    batch_size: int | None,
    search_samples: int | None,
    verify_samples: int | None,
    dims: tuple[str, ...],
    input_ranges: tuple[str, ...],
    image_preprocess: str | None,
    memory_limit: str | None,
) -> object:
    """Convert an FP32 ONNX model to mixed FP16/BF16, keeping FP32 exactly where it is needed.

    \b
    Examples:
      mpinfer convert out/model.onnx --calibration calibration/digits.npz \\
          --budget "cosine>=0.9999,top1>=0.999" -o out/model.fp16.onnx
      mpinfer convert out/model.onnx --plan out/model.fp16.plan.json -o out/model.fp16.onnx
      mpinfer convert out/model.onnx --precision bf16 --opset 22 --keep-op Softmax -o out/m.bf16.onnx
    """  # noqa: D301
    quiet = bool((ctx.obj or {}).get("quiet"))
    # every option is the ConvertConfig field of its name; two are parsed from their CLI text first
    parsed = {"precision": Precision.parse(precision) if precision is not None else None, "dims": parse_dims(dims)}
    cfg = ConvertConfig(**{**ctx.params, **parsed}, progress=not quiet)
    result = convert_precision(cfg)
    if not quiet:
        _print_summary(result, plan)
    return result


def _print_summary(result: object, plan_in: Path | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    plan = result.plan  # type: ignore[attr-defined]
    s = plan.summary
    table = Table(title=f"{plan.precision.value} plan ({plan.numerics} numerics)", show_header=False)
    # the share counts float nodes only: index-like nodes (shape arithmetic) are out of its denominator
    index_like = s.get("reasons", {}).get("rule:index-like", 0)
    table.add_row(
        "nodes low",
        f"{s['nodes_low']}/{s['nodes_total'] - index_like} float nodes ({s['low_share_nodes']:.1%}); "
        f"{index_like} index-like, {s['nodes_total']} in all",
    )
    table.add_row("FLOPs low", f"{s['low_share_flops']:.1%}")
    table.add_row("weight bytes low", f"{s['low_share_weight_bytes']:.1%}")
    table.add_row("casts", str(s["cast_count"]))
    if s.get("fp64_nodes"):
        table.add_row("FP64 nodes", f"{s['fp64_nodes']} left as they are (double)")
    kept = {k: v for k, v in s.get("reasons", {}).items()}
    table.add_row("reasons", ", ".join(f"{k}: {v}" for k, v in kept.items()))
    if s.get("expected_error"):
        searched = (s.get("search") or {}).get("samples")
        table.add_row(
            f"search figures ({searched} samples)" if searched else "expected error",
            ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s["expected_error"].items()
            ),
        )
    if s.get("search"):
        c = s["search"]
        table.add_row(
            "search cost",
            f"{c['node_evaluations']} node evaluations, {c['verifications']} verifications, {c['wall_s']}s",
        )
    console = Console()
    console.print(table)
    line = verification_line(plan)
    if line:
        console.print(line)
    if s.get("not_measured"):
        console.print(f"accuracy: {s['not_measured']}")
    if s.get("unmeasured_outputs"):
        console.print(f"unmeasured: output(s) {', '.join(repr(n) for n in s['unmeasured_outputs'])} had no values on "
                      "the data (empty or all 0): their error is not measured")
    if s.get("low_gain"):
        console.print(s["low_gain"])
    written = result.plan_path  # type: ignore[attr-defined]
    if plan_in is not None and Path(plan_in).resolve() == Path(written).resolve():
        console.print(f"wrote {result.output} (plan {written}: applied as it is, not rewritten)")  # type: ignore[attr-defined]
    else:
        console.print(f"wrote {result.output} and {written}")  # type: ignore[attr-defined]


def verification_line(plan: object) -> str | None:
    """``searched on N samples, verified on M samples (strict numerics): cosine=…`` (None: nothing verified)."""
    ver = plan.summary.get("verification")  # type: ignore[attr-defined]
    if not ver:
        return None
    worst = budget_figures(ver["budget"], ver["figures"], list(ver.get("metrics") or {}))
    figures = ", ".join(f"{k}={v:.6g}" for k, v in worst.items())
    searched = ver.get("searched_samples")
    head = f"searched on {searched} samples, verified" if searched else "verified"
    samples, random = f"{ver['samples']} samples", ver.get("data") == "random"
    if random:  # the default convert without data: judged on random inputs, not the user's
        samples += f" of {RANDOM_INPUTS}"
    budget = f"the default floor {ver['budget']} (--budget none to skip it)" if ver.get("default_budget") else (
        f"budget {ver['budget']}"
    )
    gen = ver.get("generation")
    if gen:  # the budget's generation checks: greedy decoding of the calibration prompts (ONNX Runtime)
        got = ", ".join(f"{m}={gen['figures'][m]:.6g}" for m in sorted(parse_checks(gen["budget"]).metrics)
                        if m in gen.get("figures", {}))
        figures += (f"; greedy generation of {gen['prompts']} prompts x {gen['tokens']} tokens "
                    f"({gen['numerics']}): {got}")
        budget += f",{gen['budget']}"
    moved = f"; {ver['moved_to_fp32']} node(s) moved back to FP32 to meet it" if ver.get("moved_to_fp32") else ""
    noise = ver.get("noise")
    if noise and noise["budget"] != ver["budget"]:  # the floor judged from the all-FP32 candidate's own noise
        budget += f", judged from the noise of the all-FP32 model under {ver['numerics']} numerics ({noise['budget']})"
    verdict = "met" if ver.get("passed", True) else "NOT verifiable (see the warning above)"
    line = f"{head} on {samples} ({ver['numerics']} numerics): {figures} — {budget} {verdict}{moved}"
    return line + (". Judged on random inputs, not your data: pass --calibration FILE to verify on real inputs."
                   if random else "")
