"""calibrate(): streamed per-tensor statistics with bounded memory."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
from onnx import helper, numpy_helper

from mpinfer.data import load_feeds
from mpinfer.errors import InvalidInputError
from mpinfer.precision.calib.calibrate import (
    HISTOGRAM_BINS,
    CalibrationStats,
    StatsCollector,
    TensorStats,
    calibrate,
)
from mpinfer.specs import parse_tensor_spec, specs_from_onnx
from tests.budget import set_slice
from tests.precision.numerics_graphs import make_model, ort_run
from tests.tolerances import assert_onnx_outputs_close, gamma, network_atol, onnx_reductions, reorder_atol

ROOT = Path(__file__).resolve().parents[2]


def _scale_model(factor: float):
    nodes = [
        helper.make_node("Mul", ["x", "k"], ["y"], name="scale"),
        helper.make_node("Relu", ["y"], ["z"], name="relu"),
    ]
    return make_model(
        nodes,
        [("x", [None, 6])],
        [("z", [None, 6])],
        [numpy_helper.from_array(np.array(factor, np.float32), "k")],
    )


def test_stats_are_exact_on_known_values():
    x = np.array([[0.0, 1e-8, 1e-5, 0.5, -3.0, 40000.0], [1e-39, 2.0, 2.0, -0.25, 0.0, 1.0]], np.float32)
    stats = calibrate(_scale_model(2.0), [{"x": x}], progress=False)
    assert set(stats) == {"x", "y", "z"}
    y = stats["y"]
    vals = np.abs(x.astype(np.float64) * 2).ravel()
    assert y.count == 12
    assert y.absmax == 80000.0
    assert y.min_nonzero == pytest.approx(2e-39, rel=1e-3)
    assert y.mean_abs == pytest.approx(vals.mean(), rel=1e-6)
    assert y.fp16_overflow_frac == 1 / 12  # 80000
    assert y.fp16_underflow_frac == 2 / 12  # 2e-8 and 2e-39 flush to zero in FP16
    assert y.fp16_subnormal_frac == 3 / 12  # ... and 2e-5 is subnormal
    assert y.bf16_underflow_frac == 1 / 12  # 2e-39
    assert y.finite and y.nan_count == 0
    # p99.9 of 12 values is the largest; the histogram gives an upper bound within one bin (6.25 %)
    assert y.p999 == 80000.0
    z = stats["z"]  # relu keeps the positive values only
    assert z.absmax == 80000.0 and z.count == 12
    assert z.fp16_underflow_frac == 2 / 12


def test_percentile_and_nan_inf_counts():
    rng = np.random.default_rng(0)
    x = np.abs(rng.standard_normal((1000, 6))).astype(np.float32)
    stats = calibrate(_scale_model(1.0), [{"x": x}], progress=False)["y"]
    exact = np.percentile(np.abs(x), 99.9)
    assert exact <= stats.p999 <= exact * (1 + 1 / 16)
    bad = np.array([[np.nan, np.inf, -np.inf, 1.0, 2.0, 3.0]], np.float32)
    s = calibrate(_scale_model(1.0), [{"x": bad}], progress=False)["x"]
    assert (s.nan_count, s.inf_count, s.finite, s.absmax) == (1, 2, False, 3.0)


def test_streaming_equals_all_at_once_and_memory_is_bounded():
    rng = np.random.default_rng(1)
    data = (rng.standard_normal((400, 6)) * np.exp(rng.uniform(-12, 12, (400, 6)))).astype(np.float32)
    whole, parts = StatsCollector(), StatsCollector()
    whole.update("t", data)
    sizes = []
    for chunk in np.array_split(data, 40):
        parts.update("t", chunk)
        sizes.append(parts.nbytes())
    a, b = whole.results()["t"], parts.results()["t"]
    for key in (
        "absmax",
        "min_nonzero",
        "count",
        "p999",
        "fp16_overflow_frac",
        "fp16_underflow_frac",
        "fp16_subnormal_frac",
        "bf16_underflow_frac",
    ):
        assert getattr(a, key) == getattr(b, key), key
    # float32 sums (whole vs chunked: another order) of positive values: relative units
    assert a.mean_abs == pytest.approx(b.mean_abs, rel=network_atol(n=data.size, stages=1, magnitude=1.0))
    # memory is the fixed-size histogram, whatever the number of batches
    assert parts.histogram_bins() == {HISTOGRAM_BINS}
    assert len(set(sizes)) == 1 and sizes[0] == HISTOGRAM_BINS * 8
    parts.update("t", np.ones(10**6, np.float32))
    assert parts.nbytes() == sizes[0]


def test_threaded_statistics_equal_one_thread(monkeypatch):
    """update_many over worker threads gives the same numbers as update on one thread, tensor by tensor."""
    from mpinfer.precision.calib import statistics as tensorstats

    monkeypatch.setattr(tensorstats, "PARALLEL_MIN_VALUES", 1)
    rng = np.random.default_rng(5)
    batches = [
        {
            f"t{i}": (rng.standard_normal(int(rng.integers(1, 40_000))) * 10.0 ** rng.uniform(-30, 8)).astype(
                np.float32
            )
            for i in range(12)
        }
        for _ in range(3)
    ]
    batches[1]["t3"][:5] = [np.inf, np.nan, 0.0, 7e4, -1e-45]  # the non-finite path inside a worker
    batches[2]["ids"] = np.arange(9)  # integer arrays are skipped
    serial, threaded = StatsCollector(workers=1), StatsCollector(workers=3)
    with contextlib.closing(threaded):
        for batch in batches:
            for name, arr in batch.items():
                serial.update(name, arr)
            threaded.update_many(batch.items())
        assert threaded._pool is not None  # the work really went to the threads
    assert serial.results() == threaded.results()
    assert "ids" not in threaded.results() and threaded._pool is None
    # The same name twice in one call: read in order on one thread, as update() would.
    x = batches[0]["t0"]
    twice, once = StatsCollector(workers=3), StatsCollector(workers=1)
    twice.update_many([("t0", x), ("t0", 2 * x)])
    once.update("t0", x)
    once.update("t0", 2 * x)
    assert twice.results() == once.results() and twice._pool is None


def test_overflow_detected_on_random_feeds_and_round_trip():
    model = _scale_model(1e5)
    feeds = load_feeds("random:3", specs_from_onnx(model), batch_size=8)
    stats = calibrate(model, feeds, progress=False)
    assert stats.is_random and "random data" in stats.warning()
    assert stats.source["kind"] == "random" and stats.source["batches"] == 3
    assert stats["x"].fp16_overflow_frac == 0.0
    # uniform [-1, 1] * 1e5 exceeds 65504 with probability 1 - 0.65504 = 0.345
    assert stats["y"].fp16_overflow_frac == pytest.approx(0.345, abs=0.1)
    assert stats["y"].absmax > FP16_LIMIT
    data = json.loads(json.dumps(stats.to_dict()))
    back = CalibrationStats.from_dict(data)
    assert back.tensors == stats.tensors and back.is_random
    with pytest.raises(InvalidInputError, match="to_dict"):
        CalibrationStats.from_dict({"nope": 1})


FP16_LIMIT = 65504.0


def test_real_model_and_data_match_a_direct_run(exported, tmp_path):
    model, _ = exported("digits_cnn")
    with np.load(ROOT / "calibration" / "digits.npz") as z:
        np.savez(tmp_path / "digits.npz", input_0=z["x"][:40], _labels=z["_labels"][:40])
    spec = parse_tensor_spec("input_0:batchx1x8x8:float32")
    feeds = load_feeds(tmp_path / "digits.npz", [spec], batch_size=16)
    stats = calibrate(model, feeds, progress=True)
    assert not stats.is_random and stats.warning() is None
    assert stats.source["samples"] == 40 and stats.source["batches"] == 3
    out = model.graph.output[0].name
    want = max(float(np.abs(ort_run(model, b)[out]).max()) for b in feeds)
    n, stages = onnx_reductions(model)  # calibration's session fetches every tensor: onnxruntime fuses less
    assert stats[out].absmax == pytest.approx(want, rel=0, abs=network_atol(n=n, stages=stages, magnitude=max(want, 1)))
    node_outputs = {o for n in model.graph.node for o in n.output}
    assert node_outputs <= set(stats)
    assert stats[out].count == 40 * 10


def test_captured_reference_outputs_equal_a_plain_run(exported, monkeypatch):
    """The search's FP32 reference can come from the calibration run, also when it takes several passes."""
    import mpinfer.precision.calib.capture as capture

    model, feeds = exported("transformer_small")
    batches = [feeds, {k: (v + 7) % 1000 for k, v in feeds.items()}, feeds]
    out = model.graph.output[0].name
    for limit in (capture.MAX_OUTPUTS_PER_SESSION, 5):
        monkeypatch.setattr(capture, "MAX_OUTPUTS_PER_SESSION", limit)
        stats = calibrate(model, batches, progress=False, capture_batches=2)
        assert stats.reference_outputs is not None and len(stats.reference_outputs) == 2
        for got, batch in zip(stats.reference_outputs, batches, strict=False):
            assert set(got) == {out}
            assert got[out].flags.owndata  # not a view keeping ONNX Runtime's memory arena alive
            assert_onnx_outputs_close(got[out], ort_run(model, batch)[out], model)
    assert calibrate(model, batches, progress=False).reference_outputs is None


def test_captured_tensors_are_every_float32_tensor_onnxruntime_computed(exported, monkeypatch):
    """capture_tensors keeps each FLOAT node output of the first batches (for the strict search's reference
    run), in every pass when the graph takes several, and nothing of the later batches."""
    import mpinfer.precision.calib.capture as capture
    from mpinfer.precision.emulator.emulate import GraphEmulator

    model, feeds = exported("transformer_small")
    batches = [feeds, {k: (v + 7) % 1000 for k, v in feeds.items()}]
    want = GraphEmulator(model).run(feeds, keep=True).tensors
    produced = {o for n in model.graph.node for o in n.output}
    floats = {k for k in produced if isinstance(want.get(k), np.ndarray) and want[k].dtype == np.float32}
    assert len(floats) > 20
    for limit in (capture.MAX_OUTPUTS_PER_SESSION, 5):
        monkeypatch.setattr(capture, "MAX_OUTPUTS_PER_SESSION", limit)
        stats = calibrate(model, batches, progress=False, capture_batches=1, capture_tensors=True)
        assert stats.reference_tensors is not None and len(stats.reference_tensors) == 1
        (got,) = stats.reference_tensors
        assert set(got) == floats
        for k in floats:
            assert got[k].dtype == np.float32
            assert_onnx_outputs_close(got[k], want[k], model, err_msg=k)
    assert calibrate(model, batches, progress=False, capture_batches=1).reference_tensors is None
    # Above the budget's capture slice calibration keeps the outputs only (the emulator computes the rest)
    set_slice(monkeypatch, "capture", sum(got[k].nbytes for k in floats) - 1)
    stats = calibrate(model, batches, progress=False, capture_batches=1, capture_tensors=True)
    assert stats.reference_tensors is None and stats.reference_outputs is not None


def test_no_captured_reference_when_onnxruntime_cannot_run_the_model(exported, monkeypatch):
    """ORT refusing the model: statistics come from the emulator and the search runs its own reference."""
    import mpinfer.precision.calib.capture as capture
    from mpinfer.errors import ModelLoadError

    def refuse(self, names):
        raise ModelLoadError("ONNX Runtime could not load the model: refused for this test")

    model, feeds = exported("mlp")
    monkeypatch.setattr(capture._Sessions, "session", refuse)
    stats = calibrate(model, [feeds], progress=False, capture_batches=1)
    assert stats.reference_outputs is None
    assert model.graph.output[0].name in stats


def test_subgraph_tensors_come_from_the_emulator(exported):
    model, feeds = exported("control_flow")
    stats = calibrate(model, [feeds, {k: -v for k, v in feeds.items()}], progress=False)
    body = [k for k in stats if "/then_branch/" in k or "/else_branch/" in k]
    assert any("/then_branch/" in k for k in body) and any("/else_branch/" in k for k in body)
    assert all(isinstance(stats[k], TensorStats) for k in body)
    with pytest.raises(InvalidInputError, match="no batches"):
        calibrate(model, [], progress=False)
    with pytest.raises(InvalidInputError, match="missing: input_0"):
        calibrate(model, [{"x": feeds["input_0"]}], progress=False)
    with pytest.raises(InvalidInputError, match="dtype float64"):
        calibrate(model, [{"input_0": feeds["input_0"].astype(np.float64)}], progress=False)


def test_many_tensors_take_several_passes_with_the_same_result(exported, monkeypatch):
    import mpinfer.precision.calib.capture as capture

    model, feeds = exported("transformer_small")
    batches = [feeds, {k: (v + 7) % 1000 for k, v in feeds.items()}]
    one_pass = calibrate(model, batches, progress=False)
    monkeypatch.setattr(capture, "MAX_OUTPUTS_PER_SESSION", 5)
    several = calibrate(model, iter(batches), progress=False)  # a one-shot iterator, read once per pass
    assert set(several) == set(one_pass) and len(one_pass) > 20
    assert several.source["batches"] == 2
    n, stages = onnx_reductions(model)
    for name in one_pass:  # ORT fuses differently when other tensors are outputs: float noise only
        a, b = several[name], one_pass[name]
        assert a.count == b.count and a.finite == b.finite, name
        # absolute noise at the tensor's scale (a value near zero, min_nonzero, moves as much as a large one)
        tol = network_atol(n=n, stages=stages, magnitude=max(b.absmax, 1.0))
        for key in ("absmax", "mean_abs", "min_nonzero", "fp16_overflow_frac", "fp16_subnormal_frac"):
            want = getattr(b, key)
            assert getattr(a, key) == (want if want is None else pytest.approx(want, rel=0, abs=tol)), key
        assert a.p999 == pytest.approx(b.p999, rel=0.07), name


def test_big_models_are_calibrated_from_an_external_data_copy(exported, monkeypatch):
    import mpinfer.precision.calib.capture as capture

    model, feeds = exported("digits_cnn")
    before = model.SerializeToString()
    in_memory = calibrate(model, [feeds], progress=False)
    monkeypatch.setattr(capture, "IN_MEMORY_LIMIT", 0)  # treat the model as big
    monkeypatch.setattr(capture, "MAX_OUTPUTS_PER_SESSION", 3)
    external = calibrate(model, [feeds], progress=False)
    assert model.SerializeToString() == before  # the caller's model is not modified
    assert set(external) == set(in_memory)
    n, stages = onnx_reductions(model)  # three outputs a session: onnxruntime fuses otherwise
    for name in in_memory:
        tol = network_atol(n=n, stages=stages, magnitude=max(in_memory[name].absmax, 1.0))
        assert external[name].absmax == pytest.approx(in_memory[name].absmax, rel=0, abs=tol), name
        assert external[name].count == in_memory[name].count


def test_loop_body_tensors_are_counted_once_per_iteration():
    from tests.precision.test_emulate import _loop_model

    model = _loop_model()  # 5 iterations of acc = acc * k; scan = acc + k over 3 values
    x = np.array([1.1, 0.3, -0.7], np.float32)
    stats = calibrate(model, [{"x": x}, {"x": -x}], progress=False)
    body = {k: v for k, v in stats.items() if k.startswith("loop/body/")}
    assert set(body) >= {"loop/body/acc_out", "loop/body/scan_out", "loop/body/acc_in"}
    assert body["loop/body/acc_out"].count == 2 * 5 * 3
    k = np.array([1.5, -2.25, 3.1], np.float32)
    # five float32 products against k**5 then one: each side within gamma_6 of the exact product
    assert body["loop/body/acc_out"].absmax == pytest.approx(float(np.abs(x * k**5).max()), rel=reorder_atol(n=6))


def test_underflow_energy_separates_dead_values_from_tiny_tensors():
    from mpinfer.precision.calib.statistics import StatsCollector

    col = StatsCollector()
    col.update("dead", np.array([1.0, -0.5, 1e-15, -1e-15] * 8, np.float32))
    col.update("tiny", np.full(32, 1e-9, np.float32))
    col.update("fine", np.linspace(-1, 1, 33, dtype=np.float32))
    res = col.results()
    assert res["dead"].fp16_underflow_frac == 0.5
    assert res["dead"].fp16_underflow_energy < 1e-25
    assert res["tiny"].fp16_underflow_frac == 1.0 and res["tiny"].fp16_underflow_energy == 1.0
    assert res["fine"].fp16_underflow_energy == 0.0


@pytest.mark.parametrize("chunk, finite_only", [(None, False), (7, True), (7, False)])
def test_streamed_stats_match_exact_numbers_on_hostile_values(chunk, finite_only, monkeypatch):
    """Counts read from the histogram (overflow, zeros, minimum) equal the exact ones, batch by batch.

    With a tiny chunk every tensor is read in many chunks (the path big tensors take); without inf/NaN
    the fast path handles every batch.
    """
    from mpinfer.precision.calib import statistics as tensorstats
    from mpinfer.precision.calib.statistics import FP16_MAX, StatsCollector

    if chunk:
        monkeypatch.setattr(tensorstats, "CHUNK", chunk)
    rng = np.random.default_rng(0)
    special = np.array([0, -0.0, 65504, 65505, 65519, 65520, -65536, 1e-45, np.inf, -np.inf, np.nan, 3e38], np.float32)
    if finite_only:
        special = special[np.isfinite(special)]
    for _ in range(60):
        n = int(rng.integers(1, 3000))
        batches = []
        for _ in range(int(rng.integers(1, 4))):
            x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-30, 30, n)).astype(np.float32)
            idx = rng.integers(0, n, size=int(rng.integers(0, 18)))
            x[idx] = rng.choice(special, size=idx.size)
            batches.append(x)
        collector = StatsCollector()
        for x in batches:
            collector.update("t", x)
        got = collector.results()["t"]
        mags = np.abs(np.concatenate(batches)).astype(np.float64)
        finite = mags[np.isfinite(mags)]
        nonzero = finite[finite > 0]
        assert got.absmax == (finite.max() if finite.size else 0.0)
        assert round(got.fp16_overflow_frac * mags.size) == np.count_nonzero(finite > FP16_MAX) + np.isinf(mags).sum()
        assert got.min_nonzero == (nonzero.min() if nonzero.size else None)
        assert got.nan_count == np.isnan(mags).sum() and got.inf_count == np.isinf(mags).sum()
        # float32 sums of positive terms per chunk (tensorstats.sum_of_magnitudes), in numpy's order: within gamma_n
        # of float64's (below 1/n, what one value miscounted moves the mean by, for these n < 3000)
        assert got.mean_abs == pytest.approx(finite.mean() if finite.size else 0.0, rel=gamma(mags.size))
        assert round(got.fp16_underflow_frac * mags.size) == np.count_nonzero(nonzero < 2.0**-24)


def _sample_bytes(model, batch):
    """Bytes of every float32 node output for the first sample of ``batch`` (what calibration's probe sees)."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[:]
    m.graph.output.extend(helper.make_empty_tensor_value_info(o) for n in model.graph.node for o in n.output if o)
    values = ort_run(m, {k: v[:1] for k, v in batch.items()})
    return sum(v.nbytes for v in values.values() if v.dtype == np.float32)


def test_batches_above_the_call_limit_run_in_slices_with_the_same_statistics(exported, monkeypatch):
    """A batch whose tensors exceed the budget's calibration_call slice is fetched a few samples at a time (a 640x640
    detector returns ~0.7 GB per image): the statistics do not depend on how the samples are grouped, and the reference
    outputs are joined from the slices' runs (samples on axis 0 of every input and output: no run of their own)."""
    import importlib

    import mpinfer.precision.calib.capture as capture

    cal = importlib.import_module("mpinfer.precision.calib.calibrate")  # (the package's `calibrate` is the function)

    model, feeds = exported("digits_cnn")
    rng = np.random.default_rng(3)
    batches = [{k: rng.random((6,) + v.shape[1:], dtype=np.float32) for k, v in feeds.items()} for _ in range(2)]
    whole = calibrate(model, batches, progress=False, capture_batches=1, capture_tensors=True)
    rows = []
    run = capture._run
    for mod in (cal, capture):  # every module that calls it
        monkeypatch.setattr(mod, "_run", lambda s, n, b: rows.append(len(next(iter(b.values())))) or run(s, n, b))
    set_slice(monkeypatch, "calibration_call", 2 * _sample_bytes(model, batches[0]))  # one pass, 2 samples a call
    sliced = calibrate(model, batches, progress=False, capture_batches=1, capture_tensors=True)
    assert rows == [1, 2, 2, 2, 2, 2, 2]  # probe; batch 0 in slices (its outputs among them); batch 1 in slices
    assert set(sliced) == set(whole) and len(whole) > 10
    n, stages = onnx_reductions(model)  # other batch sizes: onnxruntime may pick other kernels
    for name in whole:
        a, b = sliced[name], whole[name]
        tol = network_atol(n=n, stages=stages, magnitude=max(b.absmax, 1.0))
        assert a.count == b.count and a.absmax == pytest.approx(b.absmax, rel=0, abs=tol), name
        assert a.mean_abs == pytest.approx(b.mean_abs, rel=0, abs=tol), name
    out = model.graph.output[0].name
    want = ort_run(model, batches[0])[out]
    assert_onnx_outputs_close(sliced.reference_outputs[0][out], want, model)
    assert sliced.reference_tensors is None and whole.reference_tensors is not None  # over the capture limit too


def test_sliced_batches_over_several_passes_join_the_outputs_without_a_second_session(exported, monkeypatch):
    """The graph outputs are fetched in the first pass, so its sliced calls give the whole batch's reference outputs;
    fetched in a later pass, the capture ran the whole batch once more in a second session of the model, beside the
    pass's own (a 3B decoder: two 12 GB copies of the weights, killed for memory on a 24 GB machine), and the
    outputs of the batches after the captured ones were not kept at all."""
    import mpinfer.precision.calib.capture as capture

    model, feeds = exported("digits_cnn")
    rng = np.random.default_rng(3)
    batches = [{k: rng.random((6,) + v.shape[1:], dtype=np.float32) for k, v in feeds.items()} for _ in range(2)]
    whole = calibrate(model, batches, progress=False, capture_batches=1, capture_outputs=2)
    opened, made = [], []  # per session opened: how many this run opened before are still alive
    session = capture._Sessions.session

    def counted(self, names):
        import gc
        import weakref

        gc.collect()
        opened.append(sum(ref() is not None for ref in made))
        sess = session(self, names)
        made.append(weakref.ref(sess))
        return sess

    monkeypatch.setattr(capture._Sessions, "session", counted)
    monkeypatch.setattr(capture, "MAX_OUTPUTS_PER_SESSION", 3)  # several passes; the output is the last node's
    set_slice(monkeypatch, "calibration_call", 2 * _sample_bytes(model, batches[0]))
    sliced = calibrate(model, batches, progress=False, capture_batches=1, capture_outputs=2)
    assert len(opened) > 2 and max(opened) == 0, opened  # every session opened with none other alive
    # and the later batch's outputs are kept too (before, only a single pass kept them): the final verification
    # then opens no FP32 session of its own (a 12 GB one beside the candidate's, for the 3B decoder)
    out = model.graph.output[0].name
    assert len(sliced.reference_outputs) == len(whole.reference_outputs) == 2
    for got, want in zip(sliced.reference_outputs, whole.reference_outputs, strict=True):
        assert_onnx_outputs_close(got[out], want[out], model)


def test_max_bytes_stops_after_the_batch_that_reaches_it(exported):
    model, feeds = exported("digits_cnn")
    batches = [feeds] * 5
    per_batch = _sample_bytes(model, feeds) * len(next(iter(feeds.values())))
    stats = calibrate(model, batches, progress=False, max_bytes=int(per_batch * 1.5))
    assert stats.source["batches"] == 2 and stats.source["samples"] == 2 * len(next(iter(feeds.values())))
    assert calibrate(model, batches, progress=False).source["batches"] == 5
    pulled = []

    def stream():  # a one-shot iterator is read as it goes (one pass here), not loaded whole
        for i, b in enumerate(batches):
            pulled.append(i)
            yield b

    stats = calibrate(model, stream(), progress=False, max_bytes=int(per_batch * 1.5))
    assert stats.source["batches"] == 2 and pulled == [0, 1, 2]


def test_slices_cut_a_state_input_along_its_batch_axis(monkeypatch):
    """A recurrent state [2, batch, 4] is cut on axis 1 with the samples of x [batch, 4]; a scalar goes whole."""

    nodes = [
        helper.make_node("ReduceSum", ["s", "axis0"], ["h"], keepdims=0),
        helper.make_node("Add", ["x", "h"], ["a"]),
        helper.make_node("Mul", ["a", "k"], ["y"]),
    ]
    model = make_model(
        nodes,
        [("x", ["batch", 4]), ("s", [2, "batch", 4]), ("k", [])],
        [("y", ["batch", 4])],
        [numpy_helper.from_array(np.array([0], np.int64), "axis0")],
    )
    rng = np.random.default_rng(0)
    batch = {"x": rng.random((6, 4), dtype=np.float32), "s": rng.random((2, 6, 4), dtype=np.float32),
             "k": np.array(3.0, np.float32)}
    whole = calibrate(model, [batch], progress=False, capture_batches=1)
    set_slice(monkeypatch, "calibration_call", 40)  # h, a and y: 3 x 16 bytes a sample; one sample a call
    sliced = calibrate(model, [batch], progress=False, capture_batches=1)
    for name in ("h", "a", "y"):
        assert sliced[name].count == whole[name].count == 24
        assert sliced[name].absmax == pytest.approx(whole[name].absmax) and sliced[name].absmax > 0
    np.testing.assert_allclose(sliced.reference_outputs[0]["y"], ort_run(model, batch)["y"], rtol=1e-6)


@pytest.mark.parametrize("zeros", [False, True], ids=["no-zeros", "zeros"])
def test_smallest_nonzero_is_exact_in_chunks_with_and_without_zeros(monkeypatch, zeros):
    """update's one-pass minimum (a chunk without zeros) and its (bits - 1) minimum (one with) give numpy's value."""
    from mpinfer.precision.calib import statistics

    monkeypatch.setattr(statistics, "CHUNK", 64)  # several chunks: some with zeros, some without
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(1000) * 1e-3).astype(np.float32)
    x[[5, 700]] = np.float32(3e-7), np.float32(-2e-41)  # a subnormal in a later chunk
    if zeros:
        x[::130] = 0.0
    acc = statistics._Accumulator()
    acc.update(x)
    nonzero = np.abs(x[x != 0])
    assert acc.min_nonzero == float(nonzero.min())
    assert acc.zeros == int(np.count_nonzero(x == 0))
    assert acc.absmax == float(np.abs(x).max())
