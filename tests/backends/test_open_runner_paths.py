"""open_runner names what is wrong with a model path."""

from __future__ import annotations

import pytest

from mpinfer.errors import ModelLoadError
from mpinfer.runners import open_runner


def test_directory_is_not_called_a_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match=r"received a directory, expected an \.onnx file") as err:
        open_runner(tmp_path)
    assert "no such file" not in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="received no such file"):
        open_runner(tmp_path / "nope.onnx")
