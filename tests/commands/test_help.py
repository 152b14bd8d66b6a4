"""Every command's --help renders: examples keep their lines (click's \\b marker), nothing leaks through."""

from __future__ import annotations

import pytest

from mpinfer.cli import COMMANDS


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_renders_examples_verbatim(invoke, command):
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert "\\b" not in result.output, result.output
    for line in result.output.splitlines():
        # an example line re-wrapped by click would carry a second command after the first
        assert line.count("mpinfer ") <= 1, line
