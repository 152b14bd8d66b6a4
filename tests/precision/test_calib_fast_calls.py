"""Calibration calls of the fast size (capture.FAST_CALL_BYTES): a batch cut into calls of fewer samples than the
memory slice allows gives the statistics and the FP32 reference it gives in one call, and a batch whose every
tensor is kept for the search still runs whole."""

from __future__ import annotations

import numpy as np
import pytest

from mpinfer.precision.calib import calibrate
from tests.precision.numerics_graphs import gated_model, ort_run

WIDTH = 64
ROWS = 8
BATCHES = 4


def _model():
    return gated_model(WIDTH)


def _batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    return [{"x": (rng.standard_normal((ROWS, WIDTH)) * np.logspace(-5, 1, WIDTH)).astype(np.float32)}
            for _ in range(BATCHES)]


class _Calls:
    """The samples of each ONNX Runtime call calibration's sessions run."""

    def __init__(self, monkeypatch):
        import mpinfer.precision.calib.capture as capture

        self.rows: list[int] = []
        real = capture.ort_session

        def counted(*args, **kwargs):
            sess = real(*args, **kwargs)
            run = sess.run

            def counted_run(names, feeds, *rest):
                self.rows.append(len(feeds["x"]))
                return run(names, feeds, *rest)

            sess.run = counted_run
            return sess

        monkeypatch.setattr(capture, "ort_session", counted)


def _fast_rows(monkeypatch, rows: int) -> None:
    """Calls of ``rows`` samples: the fast size set to that many samples' tensors (x's four float tensors)."""
    import mpinfer.precision.calib.capture as capture

    monkeypatch.setattr(capture, "FAST_CALL_BYTES", rows * 4 * WIDTH * 4)


def test_a_batch_cut_into_fast_calls_gives_the_statistics_and_reference_of_whole_calls(monkeypatch):
    model, batches = _model(), _batches()
    whole = calibrate(model, batches, progress=False, capture_batches=1, capture_outputs=BATCHES)
    calls = _Calls(monkeypatch)
    _fast_rows(monkeypatch, 2)
    cut = calibrate(model, batches, progress=False, capture_batches=1, capture_outputs=BATCHES)
    assert calls.rows == [1] + [2] * (BATCHES * ROWS // 2)  # the one-sample probe, then calls of 2 samples
    for name in ("x", "s", "t", "p", "z"):
        got, want = cut[name], whole[name]
        assert (got.count, got.absmax, got.p999, got.min_nonzero) == (want.count, want.absmax, want.p999,
                                                                       want.min_nonzero)
        assert (got.fp16_underflow_frac, got.fp16_subnormal_frac) == (want.fp16_underflow_frac,
                                                                      want.fp16_subnormal_frac)
        # (float32 sums of the same values grouped by call: pairwise summation's bound)
        assert got.mean_abs == pytest.approx(want.mean_abs, rel=float(np.finfo(np.float32).eps) * np.log2(got.count))
    assert cut.reference_outputs is not None and len(cut.reference_outputs) == BATCHES
    for got_ref, batch in zip(cut.reference_outputs, batches, strict=True):
        assert np.array_equal(got_ref["z"], ort_run(model, batch)["z"])  # joined from the calls, bit for bit


def test_a_batch_whose_tensors_are_kept_runs_whole(monkeypatch):
    """The search's batch keeps every FP32 tensor (a whole call's); the batches after it are cut."""
    model, batches = _model(), _batches()
    calls = _Calls(monkeypatch)
    _fast_rows(monkeypatch, 2)
    stats = calibrate(model, batches, progress=False, capture_batches=1, capture_tensors=True,
                      capture_outputs=BATCHES)
    assert calls.rows == [1, ROWS] + [2] * ((BATCHES - 1) * ROWS // 2)
    assert stats.reference_tensors is not None and len(stats.reference_tensors) == 1
    plain = ort_run(model, batches[0])
    assert np.array_equal(stats.reference_tensors[0]["z"], plain["z"])
    assert set(stats.reference_tensors[0]) >= {"s", "t", "p", "z"}


def test_tensors_that_cannot_all_be_kept_are_dropped_before_the_first_batch(monkeypatch):
    """The probe's bytes already say the search batches' tensors overflow the capture slice: outputs only from the
    start (as after the first batch before), so the first batch is cut into fast calls too."""
    import mpinfer.memory as memory

    model, batches = _model(), _batches()
    calls = _Calls(monkeypatch)
    _fast_rows(monkeypatch, 2)

    class Short(memory.MemoryBudget):
        """The capture slice 2% short of the first batch's four fetched float tensors (s, t, p, z)."""

        capture = property(lambda self: int(ROWS * 4 * WIDTH * 4 / 1.02))

    with memory.use_budget(Short(memory.DEFAULT_MAX)):
        stats = calibrate(model, batches, progress=False, capture_batches=1, capture_tensors=True,
                          capture_outputs=BATCHES)
    assert calls.rows == [1] + [2] * (BATCHES * ROWS // 2)
    assert stats.reference_tensors is None and stats.reference_outputs is not None


def test_a_cut_batch_past_the_output_slice_goes_to_disk_from_its_calls_unjoined(monkeypatch):
    """A batch cut into calls whose outputs are spilled (past the capture_outputs slice) is written from its calls'
    pieces, never joined in memory, and reads back as the outputs of one whole call; asking which outputs a spilled
    batch holds reads nothing back from the file."""
    import importlib

    import mpinfer.precision.calib.capture as capture
    from tests.budget import set_slice

    calib_mod = importlib.import_module("mpinfer.precision.calib.calibrate")  # (the package's name is the function)

    model, batches = _model(), _batches()
    _fast_rows(monkeypatch, 2)
    set_slice(monkeypatch, "capture_outputs", ROWS * WIDTH * 4)  # one batch of z in memory, the later ones on disk
    joins: list[int] = []
    real_joined = calib_mod._Run._joined
    monkeypatch.setattr(calib_mod._Run, "_joined", lambda self, p, n: joins.append(1) or real_joined(self, p, n))
    cut = calibrate(model, batches, progress=False, capture_batches=1, capture_outputs=BATCHES)
    refs = cut.reference_outputs
    assert refs is not None and len(refs) == BATCHES
    on_disk = [r for r in refs if isinstance(r, capture._OnDisk)]
    assert len(on_disk) == BATCHES - 2 and len(joins) == 2  # batches 0 and 1 in memory (joined), 2 and 3 on disk
    reads: list[int] = []
    real_fromfile = np.fromfile
    monkeypatch.setattr(np, "fromfile", lambda *a, **k: reads.append(1) or real_fromfile(*a, **k))
    assert all("z" in r and "nothing" not in r for r in on_disk) and reads == []
    for got_ref, batch in zip(refs, batches, strict=True):
        assert np.array_equal(got_ref["z"], ort_run(model, batch)["z"])  # the calls' pieces, bit for bit
    assert len(reads) == len(on_disk)
