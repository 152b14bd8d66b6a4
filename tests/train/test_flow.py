"""Train -> export -> convert: overflow.json from the trainer keeps the overflowing module's nodes in FP32."""

from __future__ import annotations

import json

from mpinfer.train import AmpConfig, train_model

MODEL_FILE = '''
import torch
from torch import nn

INPUT_SPECS = ["x:batchx1x8x8:float32"]


class Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def build():
    torch.manual_seed(0)
    layers = [nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), Scale(1e5), Scale(1e-5), nn.Linear(32, 10)]
    return nn.Sequential(*layers)
'''


def test_overflow_report_drives_convert_keep_fp32(tmp_path):
    from mpinfer.export import ExportConfig, export_onnx
    from mpinfer.precision import ConvertConfig, convert_precision

    source = tmp_path / "amplified.py"
    source.write_text(MODEL_FILE)
    result = train_model(AmpConfig(f"{source}:build", tmp_path / "run", precision="fp32", device="cpu",
                                   epochs=1, overflow_report=True, overflow_every=4, quiet=True))
    modules = json.loads(result.overflow.read_text())["modules"]
    assert [(m["module"], m["kind"]) for m in modules] == [("3", "activation")]
    exported = export_onnx(ExportConfig(f"{source}:build", tmp_path / "m.onnx", weights=result.best))
    converted = convert_precision(ConvertConfig(exported.path, tmp_path / "m.fp16.onnx", calibration="none",
                                                keep_fp32_from=result.overflow))
    plan = json.loads(converted.plan_path.read_text())
    kept = [n for n in plan["nodes"] if n["reason"] == "overflow-json"]
    assert len(kept) == 1 and kept[0]["op_type"] == "Mul" and kept[0]["precision"] == "fp32"
    assert any(n["op_type"] == "Gemm" and n["precision"] == "fp16" for n in plan["nodes"])
