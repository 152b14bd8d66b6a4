"""``mpinfer train``: mixed-precision training with torch.amp (single process or under torchrun)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from mpinfer.specs import Precision
from mpinfer.train import AmpConfig, train_model


@click.command("train")
@click.argument("model")
@click.option(
    "--data",
    default=None,
    help="'digits' (built in) or an .npz with input arrays and an integer _labels array. Default: the model "
    "file's train_data() if it defines one, else digits.",
)
@click.option("--eval-data", default=None, help="Held-out .npz (default: digits test split / 20% of --data).")
@click.option(
    "--precision",
    type=click.Choice([p.value for p in Precision]),
    default="bf16",
    show_default=True,
    help="Autocast precision; fp16 adds dynamic loss scaling, fp32 turns AMP off.",
)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--epochs", type=click.IntRange(min=1), default=5, show_default=True)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Samples per micro-batch (per process under torchrun).",
)
@click.option("--lr", type=float, default=3e-3, show_default=True, help="Peak AdamW learning rate.")
@click.option("--weight-decay", type=float, default=0.01, show_default=True)
@click.option(
    "--schedule",
    type=click.Choice(["cosine", "constant"]),
    default="cosine",
    show_default=True,
    help="LR after the linear warm-up.",
)
@click.option("--warmup-steps", type=click.IntRange(min=0), default=None, help="Default: 5% of all steps.")
@click.option(
    "--grad-accum",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Micro-batches per optimizer step.",
)
@click.option("--clip-grad-norm", type=float, default=None, help="Clip the unscaled gradient norm to this.")
@click.option("--init-scale", type=float, default=2.0**16, show_default=True, help="Initial FP16 loss scale.")
@click.option(
    "--min-loss-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Stop with an error when the FP16 loss scale falls below this.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Run folder.")
@click.option(
    "--resume",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Continue bit-exactly from a last.pt.",
)
@click.option("--overflow-report", is_flag=True, help="Record per-module FP16 overflow; write overflow.json.")
@click.option(
    "--overflow-every",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Sample overflow statistics on one micro-batch in this many.",
)
@click.option(
    "--strategy",
    type=click.Choice(["ddp", "fsdp"]),
    default=None,
    help="Under torchrun: ddp (default; each process holds the whole model) or fsdp (parameters, gradients and "
    "optimizer state sharded over the processes).",
)
@click.option("--num-workers", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--force", is_flag=True, help="Overwrite the artefacts of an earlier run in the output folder.")
@click.pass_context
def train(
    ctx: click.Context,
    model: str,
    data: str | None,
    eval_data: str | None,
    precision: str,
    output: Path,
    quiet: bool,
    **options: object,
) -> None:
    """Train MODEL ('file.py:factory') with mixed precision; write best.pt, last.pt and metrics.

    \b
    Examples:
      mpinfer train models/digits_cnn.py:build --data digits --precision bf16 --epochs 5 -o runs/digits
      torchrun --nproc_per_node 2 -m mpinfer train models/digits_cnn.py:build -o runs/ddp
      torchrun --nproc_per_node 2 -m mpinfer train models/transformer_small.py:build --strategy fsdp -o runs/fsdp
    """  # noqa: D301
    quiet = quiet or bool((ctx.obj or {}).get("quiet"))
    config = AmpConfig(
        model=model,
        output=output,
        data=data,
        eval_data=eval_data,
        precision=Precision.parse(precision),
        quiet=quiet,
        **options,  # type: ignore[arg-type]
    )
    result = train_model(config)
    if os.environ.get("RANK", "0") != "0":
        return
    s = result.summary
    acc = f"accuracy {s['eval_accuracy']:.4f}, " if s["eval_accuracy"] is not None else ""
    scale = (
        f"loss scale {s['loss_scale']:g}, {s['skipped_steps']} skipped steps, " if precision == "fp16" else ""
    )
    click.echo(
        f"Trained {model} for {s['epochs_done']} epoch{'s' if s['epochs_done'] != 1 else ''} "
        f"({precision}, {s['device']}, "
        f"{s['world_size']} process{'es' if s['world_size'] > 1 else ''}"
        f"{', fsdp' if s.get('strategy') == 'fsdp' else ''}): {acc}train loss "
        f"{s['train_loss']:.4f}, {scale}{s['samples_per_s']:.0f} samples/s, peak memory "
        f"{s['peak_memory_bytes'] / 2**20:.0f} MiB"
    )
    best = s.get("best") or {}
    best_acc = f", accuracy {best['eval_accuracy']:.4f}" if best.get("eval_accuracy") is not None else ""
    click.echo(f"Best: epoch {best.get('epoch')}{best_acc} -> {result.best}")
    if result.overflow is not None:
        click.echo(f"Overflow report: {result.overflow}")
