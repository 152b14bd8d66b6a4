"""``mpinfer export``: trained torch model → ONNX, checked against torch."""

from __future__ import annotations

from pathlib import Path

import click

from mpinfer.export import ExportConfig, export_onnx
from mpinfer.modelio import MAX_OPSET


@click.command("export")
@click.argument("source")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Destination .onnx file (a <name>.export.json parity record is written beside it).")
@click.option("--weights", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="state_dict or trainer checkpoint for a file.py:factory source (loaded weights_only).")
@click.option("--input", "inputs", multiple=True, metavar="NAME:DIMS:DTYPE[:LO..HI]",
              help="Input spec, repeatable, e.g. x:batchx3x64x64:float32 or ids:batchxseq:int64:0..30522.")
@click.option("--dynamic", multiple=True, metavar="SYMBOL",
              help="Keep this symbolic dim dynamic (repeatable; default: every symbol in the specs).")
@click.option("--exporter", type=click.Choice(["auto", "dynamo", "torchscript"]), default="auto", show_default=True,
              help="auto tries dynamo first and falls back to TorchScript, saying why.")
@click.option("--opset", type=click.IntRange(7, MAX_OPSET), default=None, help="ONNX opset (default: the exporter's).")
@click.option("--atol", type=float, default=1e-4, show_default=True, help="Parity absolute tolerance.")
@click.option("--rtol", type=float, default=1e-3, show_default=True, help="Parity relative tolerance.")
@click.option("--output-name", "output_names", multiple=True, help="Name for each model output, in order.")
@click.option("--past/--no-past", default=True, show_default=True,
              help="A Hugging Face causal LM: export with its KV cache (past_key_values.* in, present.* out); "
                   "--no-past exports input_ids, attention_mask -> logits.")
@click.option("--trust-weights", is_flag=True, help="Load --weights with weights_only=False (trusted files only).")
@click.option("--force", is_flag=True, help="Overwrite an existing output.")
@click.pass_context
def export(ctx: click.Context, source: str, output: Path, weights: Path | None, inputs: tuple[str, ...],
           dynamic: tuple[str, ...], exporter: str, opset: int | None, atol: float, rtol: float,
           output_names: tuple[str, ...], past: bool, trust_weights: bool, force: bool) -> object:
    """Export SOURCE (file.py[:factory], TorchScript, .pt2 or a Hugging Face folder) to ONNX.

    \b
    Example:
      mpinfer export models/resnet_small.py:build --weights runs/x/best.pt \\
          --input x:batchx3x64x64:float32 --dynamic batch -o out/resnet_small.onnx
    """
    cfg = ExportConfig(source=source, output=output, weights=weights, inputs=inputs, dynamic=dynamic or None,
                       exporter=exporter, opset=opset, force=force, atol=atol, rtol=rtol,
                       trust_weights=trust_weights, output_names=output_names, past=past)
    res = export_onnx(cfg)
    if not ctx.obj.get("quiet"):
        why = f" (fallback: {res.fallback_reason})" if res.fallback_reason else ""
        click.echo(f"Exported {res.path} with the {res.exporter} exporter, opset {res.opset}{why}")
        runs = [r.label for r in res.parity.runs if r.label]
        what = (f"a prefill and {len(runs) - 1} decode steps (KV cache)" if runs and runs[0] == "prefill"
                else f"{len(res.parity.runs)} inputs")
        click.echo(f"Parity torch vs ONNX Runtime over {what}: max abs error {res.parity.max_abs:.3g} -> {res.sidecar}")
    return res
