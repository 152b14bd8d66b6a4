"""Done-when of the compare issue: on every model in models/, FP32 vs FP16 writes every report format."""

from __future__ import annotations

import json

import onnx
import pytest

from mpinfer.compare import CompareConfig, compare_models
from mpinfer.modelio import save_onnx
from mpinfer.report import write_report
from tests.compare.helpers import MODELS, export_model, to_fp16


@pytest.mark.parametrize("name", MODELS)
def test_fp32_vs_fp16_all_formats(name, tmp_path):
    base = export_model(name, tmp_path)
    cand = tmp_path / f"{name}.fp16.onnx"
    save_onnx(to_fp16(onnx.load(str(base))), cand)
    result = compare_models(
        CompareConfig(
            str(base),
            (str(cand),),
            num_batches=2,
            batch_size=4,
            checks="cosine>=0.999,top1>=0.75",
            latency=True,
            iterations=3,
            warmup=1,
            show_progress=False,
        )
    )
    assert result, result.summary()
    div = result.candidates[0].divergence
    assert div is not None and div.tensors_compared > 0
    paths = write_report(result, tmp_path / "report")
    assert json.loads(paths["json"].read_text())["candidates"][0]["name"] == str(cand)
    assert "Accuracy vs baseline" in paths["md"].read_text()
    html = paths["html"].read_text()
    assert html.count("data:image/png;base64,") >= 3
