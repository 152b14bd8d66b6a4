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


def _help_text(invoke, command: str) -> str:
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())  # click wraps lines anywhere


@pytest.mark.parametrize("command", ["convert", "compare"])
def test_data_help_names_every_source_the_docs_describe(invoke, command):
    """--calibration / --data: prompts:FILE[:steps=N] and image folders, as docs/export.md and calibration/ say."""
    text = _help_text(invoke, command).replace("- ", "-")
    for source in ("prompts:FILE[:steps=N]", "folder of images", "<input>.npy", "random[:N]"):
        assert source in text, (source, text)


def test_compare_help_lists_the_metric_aliases_of_the_docs(invoke):
    import re

    from tests.conftest import ROOT

    docs = (ROOT / "docs" / "compare.md").read_text()
    sentence = docs.split("Metric names are case-insensitive; aliases", 1)[1].split(". ", 1)[0]
    aliases = re.findall(r"`([^`]+)` \(`([^`]+)`\)", sentence) + [
        (a, a.replace("-", "")) for a in re.findall(r"`(top-\d)`", sentence)]
    assert len(aliases) >= 6, sentence
    text = _help_text(invoke, "compare")
    for alias, metric in aliases:
        assert f"{alias}={metric}" in text, (alias, metric)
