"""``mpinfer doctor``: what this machine can run."""

from __future__ import annotations

import json

import click

from mpinfer.doctor import collect_checks


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def doctor(as_json: bool) -> None:
    """Show versions, ONNX Runtime providers, CUDA/GPU and TensorRT, with install hints."""
    checks = collect_checks()
    if as_json:
        click.echo(json.dumps([c.__dict__ for c in checks], indent=2))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="mpinfer doctor")
    for col in ("", "component", "status", "how to get it"):
        table.add_column(col)
    for c in checks:
        table.add_row("[green]ok[/]" if c.ok else "[yellow]--[/]", c.name, escape(c.detail),
                      escape(c.hint) if not c.ok else "")
    Console().print(table)
