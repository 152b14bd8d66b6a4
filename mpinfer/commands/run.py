"""``mpinfer run pipeline.toml``: export -> convert -> build-engine -> compare -> report, resumably."""

from __future__ import annotations

from pathlib import Path

import click

from mpinfer.errors import AccuracyMismatchError
from mpinfer.pipeline import StageRun, run_pipeline


@click.command("run")
@click.argument("pipeline", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Re-run every stage, even those whose inputs are unchanged.")
@click.pass_context
def run(ctx: click.Context, pipeline: Path, force: bool) -> None:
    """Run the stages configured in PIPELINE (a TOML file); unchanged stages are skipped.

    \b
    mpinfer run models/demo.toml           # first run: every stage runs
    mpinfer run models/demo.toml           # again: every stage is skipped (unchanged)
    mpinfer run models/demo.toml --force   # re-run everything
    """  # noqa: D301
    quiet = bool(ctx.obj and ctx.obj.get("quiet"))

    def show(stage: StageRun) -> None:
        if quiet:
            return
        what = f"ran in {stage.seconds:.1f} s" if stage.status == "ran" else "skipped (unchanged)"
        click.echo(f"{stage.name:<13} {what:<22} key {stage.key[:12]}")

    result = run_pipeline(pipeline, force=force, on_stage=show)
    if not quiet:
        for kind, path in result.artefacts.items():
            click.echo(f"  {kind:<16} {path}")
    click.echo(f"State: {result.state_path}")
    verdicts = [str(s.summary["verdict"]) for s in result.stages if s.summary.get("verdict")]
    for verdict in verdicts:
        click.echo(verdict)
    report = result.artefacts.get("report")
    if report is not None:
        index = Path(report) / "index.html"
        click.echo(f"Report: {index if index.is_file() else report}")
    if not result.passed:
        failed = [s.name for s in result.stages if not s.summary.get("passed", True)]
        raise AccuracyMismatchError(
            f"Pipeline stage(s) {', '.join(failed)} reported a failed accuracy check; "
            "see the report for the numbers."
        )
