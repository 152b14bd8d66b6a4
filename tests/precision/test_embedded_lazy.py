"""Embedded weights past convert.lazy_threshold(): converted from a scratch copy in external data."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

import mpinfer.precision.convert as convert_module
import mpinfer.precision.weights as weights_module
from mpinfer.errors import AccuracyMismatchError
from mpinfer.modelio import data_file
from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.precision.convert import plan_path_for
from tests.precision.graphs import chain, save
from tests.precision.test_search import _npz
from tests.test_fault_injection import ROOT, make_mlp
from tests.test_pipeline_errors import _default_sigint

BUDGET = "max_abs<=2e-3"  # a mixed plan under strict numerics: the search moves groups back to FP32


def _plan_of(res) -> list[tuple[str, str, str]]:
    return [(n.name, n.precision.value, n.reason) for n in res.plan.nodes]


def _initializers(path: Path) -> list[tuple[str, int, tuple[int, ...], bytes]]:
    model = onnx.load(str(path), load_external_data=False)  # (a self-contained file: everything is in it)
    return [(t.name, t.data_type, tuple(t.dims), t.raw_data) for t in model.graph.initializer]


def _convert(src: Path, out: Path, cal: Path, budget: str = BUDGET, **kw):
    return convert_precision(ConvertConfig(model=src, output=out, calibration=str(cal), budget=budget,
                                           progress=False, **kw))


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.fixture
def lazy(monkeypatch):
    """Every embedded model takes the scratch-copy path."""
    monkeypatch.setattr(convert_module, "lazy_threshold", lambda: 0)


@pytest.mark.parametrize("numerics", ["strict", "ort"])
def test_scratch_copy_plans_and_writes_what_the_in_memory_path_does(tmp_path, monkeypatch, caplog, numerics):
    """Same plan, one self-contained .onnx with the same FP16 weights, nothing else left anywhere."""
    (tmp_path / "in").mkdir()
    src = save(chain(6), tmp_path / "in" / "m.onnx")
    cal = _npz(tmp_path / "cal.npz")
    copied = "external data in the run's scratch folder"
    with caplog.at_level(logging.INFO, logger="mpinfer.precision.convert"):
        memory = _convert(src, tmp_path / "memory" / "m.fp16.onnx", cal, numerics=numerics)
        assert not any(copied in r.getMessage() for r in caplog.records)  # a small model stays in memory
        monkeypatch.setattr(convert_module, "lazy_threshold", lambda: 0)
        lazy = _convert(src, tmp_path / "lazy" / "m.fp16.onnx", cal, numerics=numerics)
    assert any(copied in r.getMessage() for r in caplog.records)
    assert _plan_of(lazy) == _plan_of(memory)
    if numerics == "strict":
        assert {p for _, p, _ in _plan_of(lazy)} == {"fp16", "fp32"}  # the search had something to decide
    assert lazy.plan.source_sha256 == memory.plan.source_sha256  # the user's file, not the copy
    assert lazy.plan.source_path == memory.plan.source_path == str(src)
    assert _entries(tmp_path / "lazy") == {"m.fp16.onnx", plan_path_for(lazy.output).name}  # no .data, no temps
    assert _entries(tmp_path / "in") == {"m.onnx"}
    weights = _initializers(lazy.output)
    assert weights == _initializers(memory.output)
    assert any(dtype == onnx.TensorProto.FLOAT16 for _, dtype, _, _ in weights)
    assert lazy.output.read_bytes() == memory.output.read_bytes()  # the graph too, field for field


def test_scratch_copy_keeps_external_data_when_the_output_needs_it(tmp_path, monkeypatch, lazy):
    """An output past the one-file limit (lowered here) keeps its weights in ``<name>.data``, as save_onnx does."""
    src = save(chain(6), tmp_path / "m.onnx")
    cal = _npz(tmp_path / "cal.npz")
    monkeypatch.setattr(weights_module, "EXTERNAL_DATA_THRESHOLD", 1)
    res = _convert(src, tmp_path / "out" / "m.fp16.onnx", cal)
    assert _entries(tmp_path / "out") == {"m.fp16.onnx", data_file(res.output).name, plan_path_for(res.output).name}
    onnx.checker.check_model(str(res.output))


def test_scratch_copy_is_removed_on_error_and_interrupt(tmp_path, monkeypatch, lazy):
    """A budget the model cannot meet, or Ctrl-C after the copy was made: nothing left in either folder."""
    (tmp_path / "in").mkdir()
    src = save(chain(6), tmp_path / "in" / "m.onnx")
    cal = _npz(tmp_path / "cal.npz")
    out = tmp_path / "out" / "m.fp16.onnx"
    with pytest.raises(AccuracyMismatchError):
        _convert(src, out, cal, budget="max_abs<=0", keep_io_types=True, low_ops=("MatMul",))  # forced low: an error

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "_summarize", interrupt)
    with pytest.raises(KeyboardInterrupt):
        _convert(src, out, cal)
    assert not (tmp_path / "out").exists() or _entries(tmp_path / "out") == set()
    assert _entries(tmp_path / "in") == {"m.onnx"}


def test_cli_ctrl_c_after_the_copy_leaves_nothing(tmp_path):
    """End to end, no patching: a --memory-limit whose probe share (limit / 24: 11 MB) the 16 MB of weights pass."""
    model = make_mlp(tmp_path / "m.onnx", width=1024, layers=4)
    out = tmp_path / "m16.onnx"
    args = [sys.executable, "-m", "mpinfer", "-v", "convert", str(model), "--memory-limit", "256MiB"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([*args, "-o", str(tmp_path / "ok.onnx"), "--calibration", "random:8"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "external data in the run's scratch folder" in done.stderr  # the copy was taken
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "ok.onnx", "ok.plan.json"]
    for name in ("ok.onnx", "ok.plan.json"):
        (tmp_path / name).unlink()
    proc = subprocess.Popen([*args, "-o", str(out), "--calibration", "random:64", "--budget", "cosine>=0.9999999"],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".*.tmp/.scratch/input.onnx.data")):  # the copy is being written or is there
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Interrupted. Nothing was written" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # no output, no lock, no copy
