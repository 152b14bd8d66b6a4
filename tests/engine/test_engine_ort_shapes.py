"""``--shapes`` on an ONNX Runtime build: recorded, and the user is told they are not enforced."""

from __future__ import annotations

import json

import numpy as np

from mpinfer.engine import BuildConfig, build_engine, load_engine_runner, parse_shapes
from mpinfer.engine.config import Backend


def test_ort_build_warns_that_shapes_are_not_enforced(fp16_model, tmp_path, caplog):
    out = tmp_path / "m.ort"
    with caplog.at_level("WARNING", logger="mpinfer"):
        result = build_engine(
            BuildConfig(model=fp16_model, output=out, backend=Backend.ONNXRUNTIME, device="cpu",
                        shapes=parse_shapes("x:1x8,2x8,4x8"))
        )
    notes = [n for n in result.notes if n.startswith("--shapes")]
    assert len(notes) == 1 and "does not enforce" in notes[0]
    assert caplog.text.count("does not enforce") == 1
    side = json.loads(result.sidecar.read_text())
    assert side["profiles"] and side["notes"] == list(result.notes)
    # the note is true: the engine runs a batch above the recorded max
    with load_engine_runner(out, device="cpu") as runner:
        y = runner.infer({"x": np.ones((9, 8), np.float32)})
    assert next(iter(y.values())).shape == (9, 4)


def test_ort_build_without_shapes_has_no_such_note(fp16_model, tmp_path):
    result = build_engine(
        BuildConfig(model=fp16_model, output=tmp_path / "m.ort", backend=Backend.ONNXRUNTIME, device="cpu")
    )
    assert not any("--shapes" in n for n in result.notes)


def test_cli_warns_for_shapes_with_onnxruntime(invoke, fp16_model, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="mpinfer"):
        r = invoke("build-engine", fp16_model, "--backend", "onnxruntime", "--shapes", "x:1x8,2x8,4x8",
                   "-o", tmp_path / "m.ort")
    assert r.exit_code == 0, r.output
    assert caplog.text.count("does not enforce") == 1
