"""A model (or input file) that does not exist is a user mistake on every command: exit 1, one ``Error:`` line."""

from __future__ import annotations

import pytest

from tests.conftest import assert_user_error

CASES = {
    "export": (["export", "MISSING/m.py:build", "-o", "OUT/m.onnx"], r"'MISSING/m.py:build'.*no such file"),
    "convert": (["convert", "MISSING/m.onnx", "-o", "OUT/m.fp16.onnx"], r"'MISSING/m.onnx'.*no such file"),
    "build-engine": (["build-engine", "MISSING/m.onnx"], r"'MISSING/m.onnx'.*no such file"),
    "compare": (["compare", "MISSING/m.onnx", "MISSING/m.fp16.onnx"], r"'MISSING/m.onnx'.*no such file"),
    "report": (["report", "MISSING/report.json"], r"'MISSING/report.json'.*no such file"),
    "run": (["run", "MISSING/pipeline.toml"], r"'MISSING/pipeline.toml'.*no such file"),
    "train": (["train", "MISSING/m.py:build", "-o", "OUT/run"], r"'MISSING/m.py'.*no such file"),
}


@pytest.mark.parametrize("command", sorted(CASES))
def test_a_missing_input_file_exits_1_with_an_error_line(invoke, tmp_path, command):
    args, pattern = CASES[command]
    missing, out = tmp_path / "missing", tmp_path / "out"
    result = invoke(*[a.replace("MISSING", str(missing)).replace("OUT", str(out)) for a in args])
    assert_user_error(result, pattern.replace("MISSING", str(missing)))
    assert not out.exists()
