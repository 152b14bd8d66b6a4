"""``mpinfer report``: re-render a saved report.json, or re-threshold it with new checks."""

from __future__ import annotations

from pathlib import Path

import click

from mpinfer.claim import claim_outputs
from mpinfer.fileio import check_output_path
from mpinfer.report import load_report, render
from mpinfer.report.console import render_console


@click.command()
@click.argument("report_json", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["html", "md", "json", "console"]),
    default="console",
    show_default=True,
    help="Output format.",
)
@click.option("--check", "checks", help='New thresholds, e.g. "cosine>=0.9999"; exit 1 when one fails.')
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write to this file (default: stdout).",
)
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.pass_context
def report(
    ctx: click.Context, report_json: Path, fmt: str, checks: str | None, output: Path | None, force: bool
) -> None:
    """Re-render REPORT_JSON (from `mpinfer compare --report`; or its folder) as html, md, json or console tables.

    \b
    mpinfer report out/report/report.json --format html -o out/report.html
    mpinfer report out/report/report.json --check "cosine>=0.99999"     # exit 1 if it fails now
    """  # noqa: D301 (click needs the \b)
    if checks is not None and not checks.strip():
        raise click.BadParameter('empty; give thresholds, e.g. "cosine>=0.9999", or leave --check out',
                                 param_hint="--check")
    if report_json.is_dir():  # the folder `compare --report DIR` wrote
        report_json = report_json / "report.json"
    if output is not None and fmt == "console":
        raise click.BadParameter(
            "-o/--output writes html, md or json; pick one with --format", param_hint="-o"
        )
    if output is not None:

        check_output_path(output, [report_json], force=force)
    result = load_report(report_json)
    if checks is not None:
        result = result.with_checks(checks)
    if fmt == "console":

        render_console(result)
    else:
        text = render(result, fmt)
        if output is not None:

            with claim_outputs([output], force=force) as claim:  # a second run on -o fails at once
                claim.stage(output).write_text(text, encoding="utf-8")
                claim.publish()
            click.echo(f"wrote {fmt}: {output}")
        else:
            click.echo(text, nl=False)
    if not result:
        click.echo(result.summary(), err=True)
        ctx.exit(1)
