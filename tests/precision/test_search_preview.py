"""Previewing the whole candidate: when the magnitude candidate waits behind it, the whole candidate runs first on a
spread eighth of the samples, and a rejection there sends the search on without its other samples."""

from __future__ import annotations

import numpy as np

from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.precision.budget import screening, search
from mpinfer.precision.numerics import strict
from tests.precision.graphs import chain, save
from tests.precision.test_search_magnitude import _offset_model

SAMPLES = 32


def _rows_run(monkeypatch) -> list[int]:
    """The samples of each cast graph run of a candidate on chosen rows (preview, screening's stages), in order."""
    sizes: list[int] = []
    real = strict.StrictEvaluator.cast_rows

    def cast_rows(self, low, note=strict._ignore):
        run = real(self, low, note)
        if run is None:
            return None

        def counted(feeds):
            sizes.append(len(next(iter(feeds.values()))))
            return run(feeds)

        return counted

    monkeypatch.setattr(strict.StrictEvaluator, "cast_rows", cast_rows)
    return sizes


def _convert(tmp_path, model, tag, budget=None):
    src = save(model, tmp_path / f"m{tag}.onnx")
    data = tmp_path / f"cal{tag}.npz"
    np.savez(data, x=np.random.default_rng(0).standard_normal((SAMPLES, 16)).astype(np.float32))
    extra = {} if budget is None else {"budget": budget}
    return convert_precision(
        ConvertConfig(model=src, output=tmp_path / f"out{tag}.onnx", calibration=str(data), progress=False, **extra)
    )


def _decisions(res):
    return [(n.name, n.precision, n.reason, n.stats.get("sensitivity")) for n in res.plan.nodes]


def test_a_whole_candidate_its_preview_rejects_runs_no_other_sample(tmp_path, monkeypatch):
    sizes = _rows_run(monkeypatch)
    previewed = _convert(tmp_path, _offset_model(), "a")
    s = previewed.plan.summary["search"]
    assert s["magnitude_met"] is True and s["verifications"] == 2
    assert s["screened"] == 1  # (the whole candidate, on its preview rows)
    assert sizes == [SAMPLES // 8]  # the whole candidate's one run: 4 spread samples; the magnitude one ran whole

    monkeypatch.setattr(screening, "PREVIEW_SHARE", 1.0)  # (every sample: no preview)
    sizes.clear()
    whole = _convert(tmp_path, _offset_model(), "b")
    assert sizes == [] and whole.plan.summary["search"]["screened"] == 0
    assert _decisions(previewed) == _decisions(whole)
    assert previewed.plan.summary["verification"]["figures"] == whole.plan.summary["verification"]["figures"]


def test_a_whole_candidate_that_passes_its_preview_is_judged_on_every_sample(tmp_path, monkeypatch):
    sizes = _rows_run(monkeypatch)
    # a budget the whole candidate meets: the preview's 4 samples, then the other 28, one verification
    res = _convert(tmp_path, _offset_model(), "c", budget="range_err<=0.5,cosine_min>=0.99")
    s = res.plan.summary["search"]
    assert s["verifications"] == 1 and s["searched"] is False and s["screened"] == 0
    assert sizes == [SAMPLES // 8, SAMPLES - SAMPLES // 8]
    assert res.plan.summary["verification"]["passed"]


def test_a_rejected_preview_is_finished_before_the_groups_are_ranked(tmp_path, monkeypatch):
    """The magnitude candidate misses: the whole candidate's other samples run, and the hardness, the sensitivities'
    samples, every sensitivity and every decision are those of the search without a preview."""
    monkeypatch.setattr(search, "MAGNITUDE_FLOPS_SHARE", 1.0)
    monkeypatch.setattr(search, "magnitude_groups", lambda _i, groups, _n: [g for g in groups if g.anchor == "mm0"])
    sizes = _rows_run(monkeypatch)
    got = []
    for tag, share in (("d", screening.PREVIEW_SHARE), ("e", 1.0)):  # (1.0: every sample, no preview)
        monkeypatch.setattr(screening, "PREVIEW_SHARE", share)
        sizes.clear()
        res = _convert(tmp_path, chain(8), tag, budget="max_abs<=1e-3")
        s = res.plan.summary["search"]
        assert s["magnitude_groups"] == 1 and s["magnitude_met"] is False
        got.append((_decisions(res), res.plan.summary["verification"]["figures"], s["verifications"]))
        if share < 1.0:
            assert sizes[:2] == [SAMPLES // 8, SAMPLES - SAMPLES // 8]  # the preview rejected, then finished
    assert got[0] == got[1]
    assert any(d[3] is not None for d in got[0][0])  # (the groups were measured)


def test_a_preview_whose_rest_the_runtime_refuses_is_finished_on_the_batches(tmp_path, monkeypatch):
    """ONNX Runtime refusing the rest of a rejected preview: the candidate's batches run as without the preview (the
    emulator where the cast graph fails), and the search decides as it would have."""
    monkeypatch.setattr(search, "MAGNITUDE_FLOPS_SHARE", 1.0)
    monkeypatch.setattr(search, "magnitude_groups", lambda _i, groups, _n: [g for g in groups if g.anchor == "mm0"])
    plain = _convert(tmp_path, chain(8), "f", budget="max_abs<=1e-3")
    real = strict.StrictEvaluator.cast_rows
    refused = []

    def cast_rows(self, low, note=strict._ignore):
        run = real(self, low, note)
        if run is None:
            return None

        def flaky(feeds):
            if len(next(iter(feeds.values()))) == SAMPLES - SAMPLES // 8 and not refused:  # (the preview's rest)
                refused.append(1)
                raise RuntimeError("refused")
            return run(feeds)

        return flaky

    monkeypatch.setattr(strict.StrictEvaluator, "cast_rows", cast_rows)
    res = _convert(tmp_path, chain(8), "g", budget="max_abs<=1e-3")
    assert refused == [1]
    assert _decisions(res) == _decisions(plain)
    assert res.plan.summary["verification"]["figures"] == plain.plan.summary["verification"]["figures"]
