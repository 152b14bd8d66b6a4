"""The ``mpinfer`` command line: a thin click layer over the typed API.

Subcommands live in :mod:`mpinfer.commands` and are imported only when invoked (click's lazy-subcommand
pattern), so ``mpinfer --help`` stays fast and works without torch, TensorRT or a GPU.
A user mistake (:class:`~mpinfer.errors.MpinferError`) prints one ``Error: ...`` line and exits 1; any other
exception is a bug: its traceback, then one ``Internal error: ...`` line that says so and what to report, exit 70
(EX_SOFTWARE). ``--debug`` (or ``MPINFER_DEBUG=1``) re-raises either as it is.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback
from typing import Any

import click

from mpinfer import __version__
from mpinfer.claim import command_line
from mpinfer.errors import MpinferError

# name -> (module, attribute, one-line help). The help is repeated here so `--help` imports nothing.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "export": ("mpinfer.commands.export", "export", "Export a trained torch model to ONNX and check parity."),
    "convert": ("mpinfer.commands.convert", "convert", "Convert an FP32 ONNX model to mixed FP16/BF16 with a plan."),
    "build-engine": ("mpinfer.commands.build_engine", "build_engine",
                     "Build a TensorRT engine (or an ONNX Runtime engine where TensorRT is absent)."),
    "compare": ("mpinfer.commands.compare", "compare", "Compare candidates against the FP32 baseline."),
    "report": ("mpinfer.commands.report", "report", "Re-render or re-threshold a saved report."),
    "run": ("mpinfer.commands.run", "run", "Run the whole pipeline from a pipeline.toml, resumably."),
    "train": ("mpinfer.commands.train", "train", "Train with torch.amp (FP16/BF16 autocast, GradScaler)."),
    "doctor": ("mpinfer.commands.doctor", "doctor", "Show what this machine can run, and how to get the rest."),
}

logger = logging.getLogger("mpinfer")


def _debug_enabled(ctx: click.Context | None) -> bool:
    if os.environ.get("MPINFER_DEBUG", "") not in ("", "0"):
        return True
    while ctx is not None:
        if ctx.obj and isinstance(ctx.obj, dict) and ctx.obj.get("debug"):
            return True
        ctx = ctx.parent
    return False


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use and whose errors become ``Error:`` lines."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """All commands whose module is present, in declaration order."""
        from importlib.util import find_spec

        return [name for name, (mod, _a, _h) in COMMANDS.items() if find_spec(mod) is not None]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """Import and return one subcommand."""
        if cmd_name not in COMMANDS:
            return None
        mod_name, attr, _help = COMMANDS[cmd_name]
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as err:
            if err.name == mod_name:
                return None
            raise
        cmd = getattr(module, attr)
        assert isinstance(cmd, click.Command)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """List commands with their static help (no imports)."""
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand: MpinferError → ``Error: ...``, exit 1; Ctrl-C → exit 130; a bug → exit 70."""
        try:
            return super().invoke(ctx)
        except MpinferError as err:
            if _debug_enabled(ctx):
                raise
            click.echo(f"Error: {err}", err=True)
            ctx.exit(1)
        except KeyboardInterrupt as err:
            if _debug_enabled(ctx):
                raise
            click.echo(f"\nInterrupted. {_interrupted(ctx, err)}", err=True)
            ctx.exit(INTERRUPTED_EXIT_CODE)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise  # click's own: usage errors (exit 2), --help, ctx.exit()
        except Exception as err:  # noqa: BLE001 (anything else is a bug: said so, with what to report)
            if _debug_enabled(ctx):
                raise
            click.echo("".join(traceback.format_exception(err)).rstrip(), err=True)
            click.echo(f"Internal error: {_bug_report(err, ctx.invoked_subcommand)}", err=True)
            ctx.exit(BUG_EXIT_CODE)


# Exit status after Ctrl-C: 128 + SIGINT, as a shell reports an interrupted program.
INTERRUPTED_EXIT_CODE = 130
# Exit status of a bug in mpinfer (sysexits.h EX_SOFTWARE), apart from user mistakes (1) and usage errors (2).
BUG_EXIT_CODE = 70


def _bug_report(err: BaseException, command: str | None) -> str:
    """The line under a bug's traceback: that it is a bug, and what a report needs."""
    kept = " (nothing was written: its outputs appear only when complete)" if command in PUBLISH_AT_END else ""
    return (
        f"{type(err).__name__} in mpinfer {__version__}. This is a bug in mpinfer, not a problem with your "
        f"input{kept}. Please report it with the traceback above, the command (`{command_line()}`) and the output "
        "of `mpinfer doctor`; where it names a node, `--keep-node NODE` (convert) may work around it meanwhile."
    )


# Commands that publish their outputs only when complete (see mpinfer.claim): Ctrl-C leaves nothing of them.
PUBLISH_AT_END = ("export", "convert", "build-engine", "compare", "report")


def _interrupted(ctx: click.Context, err: KeyboardInterrupt) -> str:
    """What an interrupted command kept and how to resume it (the API's own words where it gave some)."""
    if str(err):
        return str(err)
    if ctx.invoked_subcommand in PUBLISH_AT_END:
        return f"Nothing was written (outputs are published only when complete). Start again with: {command_line()}"
    return f"Run it again with: {command_line()}"


def _configure_logging(verbose: int, quiet: int) -> None:
    level = logging.WARNING - 10 * verbose + 10 * quiet
    level = max(logging.DEBUG, min(logging.CRITICAL, level))
    root = logging.getLogger("mpinfer")
    root.setLevel(level)
    if not any(getattr(h, "_mpinfer", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
        handler._mpinfer = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    for h in root.handlers:
        if getattr(h, "_mpinfer", False):
            h.setLevel(level)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mpinfer")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.option("-q", "--quiet", count=True, help="Less log output.")
@click.option("--debug", is_flag=True, help="Show full tracebacks for every error.")
@click.pass_context
def main(ctx: click.Context, verbose: int, quiet: int, debug: bool) -> None:
    """mpinfer: trained FP32 torch model -> fast mixed-precision inference, with the numbers to prove it.

    \b
    Typical flow:
      mpinfer export models/resnet_small.py:build -o out/model.onnx
      mpinfer convert out/model.onnx --precision fp16 -o out/model.fp16.onnx
      mpinfer compare out/model.onnx out/model.fp16.onnx --latency --report out/report
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    ctx.obj["quiet"] = quiet > 0
    _configure_logging(verbose + (1 if debug else 0), quiet)
