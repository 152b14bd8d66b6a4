"""Every model and feed: random data the model can take, sequence values, data the model rejects.

Through ``mpinfer convert`` (the CLI), on tiny graphs built here.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mpinfer.data import load_feeds
from mpinfer.errors import InvalidInputError
from mpinfer.pipeline import run_pipeline
from mpinfer.specs import specs_from_onnx
from tests.conftest import assert_user_error
from tests.precision.graphs import fvi, init, make, rng_w, save


def _embedding(rows: int = 4) -> onnx.ModelProto:
    """Token ids [batch, 6] into a table of ``rows`` rows (through a Cast), then MatMul."""
    nodes = [
        helper.make_node("Cast", ["ids"], ["ids32"], name="cast", to=TensorProto.INT32),
        helper.make_node("Gather", ["table", "ids32"], ["e"], name="embed"),
        helper.make_node("MatMul", ["e", "w"], ["y"], name="mm"),
    ]
    return make(nodes, [fvi("ids", ["batch", 6], TensorProto.INT64)], [fvi("y", ["batch", 6, 4])],
                [init("table", rng_w(rows, 8)), init("w", rng_w(8, 4))])


def test_token_ids_take_their_range_from_the_embedding_table(invoke, tmp_path):
    [spec] = specs_from_onnx(_embedding(4))
    assert spec.value_range == (0, 4)
    ids = np.concatenate([b["ids"].ravel() for b in load_feeds("random:4", [spec])])
    assert ids.min() >= 0 and ids.max() < 4 and len(np.unique(ids)) == 4  # the whole table, nothing past it
    r = invoke("convert", save(_embedding(4), tmp_path / "m.onnx"), "-o", tmp_path / "o.onnx")
    assert r.exit_code == 0, r.output
    plan = json.loads((tmp_path / "o.plan.json").read_text())
    assert plan["calibration"]["kind"] == "random"  # calibrated on it, not a fallback to rules only


def _gru_with_state() -> onnx.ModelProto:
    """X [seq, batch, 4] and a fixed state h0 [1, 1, 8] into a GRU: the state pins batch to 1."""
    nodes = [helper.make_node("GRU", ["x", "wx", "rx", "", "", "h0"], ["", "h"], name="gru", hidden_size=8)]
    return make(nodes, [fvi("x", ["seq", "batch", 4]), fvi("h0", [1, 1, 8])], [fvi("h", [1, "batch", 8])],
                [init("wx", rng_w(1, 24, 4)), init("rx", rng_w(1, 24, 8, seed=1))])


def test_a_fixed_size_state_pins_the_random_batch(invoke, tmp_path, caplog):
    specs = specs_from_onnx(_gru_with_state())
    assert specs[0].graph_sizes == {"batch": 1}
    first = load_feeds(None, specs).first()
    assert first["x"].shape[1] == 1 and first["h0"].shape == (1, 1, 8)  # not the default batch of 16
    with caplog.at_level("WARNING", logger="mpinfer"):
        r = invoke("convert", save(_gru_with_state(), tmp_path / "m.onnx"), "-o", tmp_path / "o.onnx")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "o.plan.json").read_text())["calibration"]["kind"] == "random"
    assert "Calibration skipped" not in caplog.text


def _expand() -> onnx.ModelProto:
    """x [3, 4] expanded to an int64 ``shape`` input: random shapes are almost never valid."""
    nodes = [helper.make_node("Expand", ["x", "shape"], ["e"], name="expand"),
             helper.make_node("Relu", ["e"], ["y"], name="relu")]
    return make(nodes, [fvi("x", [3, 4]), fvi("shape", [2], TensorProto.INT64)], [fvi("y", ["r", "c"])])


def test_own_random_data_rejected_stops_convert_naming_what_it_needs(invoke, tmp_path):
    # issue 35: no fallback to an unmeasured rules-only plan on convert's own: it stops, naming what to pass
    src = save(_expand(), tmp_path / "m.onnx")
    r = invoke("convert", src, "-o", tmp_path / "o.onnx")
    assert_user_error(r, r"mpinfer's own random data \(no --calibration given\): received ONNX Runtime rejects it at "
                         r"node 'expand' \(Expand\).*--input-range NAME=LO\.\.HI for integer input\(s\) shape.*"
                         r"--calibration FILE.*--calibration none plans by the rules alone")
    assert "--dim" not in r.output  # no dim was guessed: not the cause
    assert not (tmp_path / "o.onnx").exists()
    # rules only is the user's explicit choice
    assert invoke("convert", src, "--calibration", "none", "-o", tmp_path / "o.onnx").exit_code == 0
    onnx.checker.check_model(onnx.load(str(tmp_path / "o.onnx")))
    # the user's own data, rejected: a user error naming their data, nothing written
    np.savez(tmp_path / "bad.npz", x=np.ones((3, 4), np.float32), shape=np.array([5, 5], np.int64))
    bad = invoke("convert", src, "--calibration", tmp_path / "bad.npz", "-o", tmp_path / "p.onnx")
    assert_user_error(bad, r"Calibration data '.*bad\.npz': received a batch ONNX Runtime rejected at node 'expand' "
                           r"\(Expand\).*invalid expand shape")
    assert not (tmp_path / "p.onnx").exists()
    np.savez(tmp_path / "good.npz", x=np.ones((3, 4), np.float32), shape=np.array([2, 3, 4], np.int64)[1:])
    assert invoke("convert", src, "--calibration", tmp_path / "good.npz", "-o", tmp_path / "q.onnx").exit_code == 0


def _split_to_sequence() -> onnx.ModelProto:
    """x [3, 4] -> SplitToSequence -> SequenceAt(1) -> Relu: a sequence value inside the graph."""
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["s"], name="split", axis=0),
        helper.make_node("SequenceAt", ["s", "one"], ["a"], name="at"),
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
    ]
    return make(nodes, [fvi("x", [3, 4])], [fvi("y", ["r", 4])], [init("one", np.array(1, np.int64))])


def _sequence_input() -> onnx.ModelProto:
    """A seq(tensor(float)) input: SequenceAt(0) -> Relu."""
    seq = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("SequenceAt", ["s", "zero"], ["a"], name="at"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    return make(nodes, [seq], [fvi("y", [2, 3])], [init("zero", np.array(0, np.int64))])


def test_sequence_values_are_planned_around(invoke, tmp_path, caplog):
    src = save(_split_to_sequence(), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.arange(12, dtype=np.float32).reshape(3, 4))
    for data in ((), ("--calibration", tmp_path / "d.npz")):
        r = invoke("convert", src, *data, "-o", tmp_path / f"o{len(data)}.onnx")
        assert r.exit_code == 0, r.output
        plan = json.loads((tmp_path / f"o{len(data)}.plan.json").read_text())
        kept = {n["name"]: n["precision"] for n in plan["nodes"]}
        assert kept["split"] == "fp32" and kept["at"] == "fp32"  # sequence ops keep their types
    src = save(_sequence_input(), tmp_path / "s.onnx")
    r = invoke("convert", src, "-o", tmp_path / "s.fp16.onnx")  # random data cannot feed a sequence: stops
    assert_user_error(r, r"input\(s\) 's' \(seq\(tensor\(float\)\)\) are not tensors.*--calibration none")
    assert invoke("convert", src, "--calibration", "none", "-o", tmp_path / "s.fp16.onnx").exit_code == 0
    bad = invoke("convert", src, "--calibration", tmp_path / "d.npz", "-o", tmp_path / "t.onnx")
    assert_user_error(bad, r"non-tensor input\(s\) 's' \(seq\(tensor\(float\)\)\).*--calibration none")


def test_input_range_sets_an_integer_inputs_random_values(invoke, tmp_path, caplog):
    src = save(_expand(), tmp_path / "m.onnx")
    with caplog.at_level("WARNING", logger="mpinfer"):
        r = invoke("convert", src, "--input-range", "shape=1..2", "-o", tmp_path / "o.onnx")
    assert r.exit_code == 0, r.output
    assert "Calibration skipped" not in caplog.text  # [1, 1] broadcasts: the model takes every batch
    assert json.loads((tmp_path / "o.plan.json").read_text())["calibration"]["kind"] == "random"
    c = invoke("compare", src, tmp_path / "o.onnx", "--input-range", "shape=1..2", "--num-batches", "1")
    assert c.exit_code == 0, c.output
    assert_user_error(invoke("convert", src, "--input-range", "shap=1..2", "-o", tmp_path / "p.onnx"),
                      r"--input-range: received 'shap' \(no such input\), expected one of 'x', 'shape'")
    assert_user_error(invoke("convert", src, "--input-range", "shape=2", "-o", tmp_path / "p.onnx"),
                      r"low\.\.high")


def test_input_ranges_in_the_pipeline_toml(tmp_path):
    save(_expand(), tmp_path / "m.onnx")
    toml = tmp_path / "p.toml"
    toml.write_text('[pipeline]\nwork_dir = "w"\n[convert]\nmodel = "m.onnx"\ninput_ranges = ["shape=1..2"]\n')
    run_pipeline(toml)
    [plan] = list((tmp_path / "w").rglob("*.plan.json"))
    assert json.loads(plan.read_text())["calibration"]["kind"] == "random"
    toml.write_text('[pipeline]\nwork_dir = "v"\n[convert]\nmodel = "m.onnx"\ninput_ranges = ["shape=1"]\n')
    with pytest.raises(InvalidInputError, match=r"\[convert\] input_ranges = \['shape=1'\]: .*low\.\.high"):
        run_pipeline(toml)
