"""``mpinfer build-engine``: a TensorRT engine, or an ONNX Runtime engine where TensorRT is absent."""

from __future__ import annotations

from pathlib import Path

import click

from mpinfer.engine import BuildConfig
from mpinfer.engine import build_engine as build
from mpinfer.engine.config import DEFAULT_OPT_LEVEL, MAX_OPT_LEVEL


@click.command("build-engine")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--backend",
    type=click.Choice(["auto", "tensorrt", "onnxruntime"]),
    default="auto",
    show_default=True,
    help="auto: TensorRT when importable with a GPU, else ONNX Runtime (it says which and why).",
)
@click.option(
    "--shapes",
    multiple=True,
    metavar="NAME:MIN,OPT,MAX",
    help='Optimization profile per dynamic input, e.g. "x:1x3x64x64,8x3x64x64,32x3x64x64"; '
    "separate inputs with ';' or repeat the option. Default (TensorRT): batch 1-16, other dims at the sizes the "
    "export recorded.",
)
@click.option(
    "--timing-cache",
    type=click.Path(dir_okay=False, path_type=Path),
    help="TensorRT timing cache: loaded if present, saved after the build.",
)
@click.option("--workspace", metavar="SIZE", help="TensorRT workspace limit, e.g. 4GiB.")
@click.option(
    "--opt-level",
    type=click.IntRange(0, MAX_OPT_LEVEL),
    default=DEFAULT_OPT_LEVEL,
    show_default=True,
    help="Builder optimization level (ONNX Runtime: 0 none, 1 basic, 2 extended, 3-5 all).",
)
@click.option(
    "--fp16",
    "weak_fp16",
    is_flag=True,
    help="TensorRT < 11 only: weak typing, let TensorRT pick FP16 kernels anywhere.",
)
@click.option(
    "--bf16",
    "weak_bf16",
    is_flag=True,
    help="TensorRT < 11 only: weak typing, let TensorRT pick BF16 kernels anywhere.",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Engine path (default: MODEL with .engine for TensorRT, .ort for ONNX Runtime, .ort.onnx for a model "
    "with external data).",
)
@click.option("--force", is_flag=True, help="Overwrite an existing engine.")
@click.pass_context
def build_engine(
    ctx: click.Context,
    model: Path,
    backend: str,
    shapes: tuple[str, ...],
    timing_cache: Path | None,
    workspace: str | None,
    opt_level: int,
    weak_fp16: bool,
    weak_bf16: bool,
    device: str,
    output: Path | None,
    force: bool,
) -> None:
    """Build an engine from an ONNX model (strongly typed: precisions come from the graph).

    \b
    mpinfer build-engine out/model.fp16.onnx --shapes "x:1x3x64x64,8x3x64x64,32x3x64x64" \\
        --timing-cache out/timing.cache -o out/model.engine
    mpinfer build-engine out/model.fp16.onnx --backend onnxruntime -o out/model.ort
    """  # noqa: D301
    weak = [p for p, on in (("fp16", weak_fp16), ("bf16", weak_bf16)) if on]
    cfg = BuildConfig.from_mapping(
        {
            "model": model,
            "output": output,
            "backend": backend,
            "shapes": list(shapes),
            "timing_cache": timing_cache,
            "workspace": workspace,
            "opt_level": opt_level,
            "weak_precisions": weak,
            "device": device,
            "force": force,
        }
    )
    result = build(cfg)
    quiet = bool(ctx.obj and ctx.obj.get("quiet"))
    if not quiet:  # result.notes were logged as warnings by build_engine (-q hides them)
        click.echo(f"Backend: {result.backend.value} ({result.reason})")
    click.echo(f"Wrote {result.path} and {result.sidecar}")
