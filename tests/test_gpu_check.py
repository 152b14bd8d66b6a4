"""The GPU measurement of issue 30 (bench/gpu_prepare.py, bench/gpu_check.sh, bench/gpu_measure.py) on a CPU.

The dry run is the GPU run with ONNX Runtime's CPU provider and a few iterations: if it reports every section
with numbers here, a lent GPU session spends its minutes measuring, not debugging. Tiny models, no download.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
gpu_weights = pytest.importorskip("gpu_weights")


def _model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((64, 96)) * 0.05).astype(np.float32), "w")
    b = numpy_helper.from_array(np.zeros(96, np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 96])], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(gpu_weights.regenerate_weights(model, min_elems=100), str(path))
    return path


def test_skeletons_rebuild_fp32_and_fp16_weights_bit_exactly(tmp_path: Path) -> None:
    fp32 = _model(tmp_path / "m.onnx")
    half = onnx.load(str(fp32))
    w = half.graph.initializer[0]
    w16 = numpy_helper.to_array(w).astype(np.float16)
    w16[0, 0] = np.float16(6e-8) if w16[0, 0] != np.float16(6e-8) else 0  # AutoCast's kind of departure
    w.CopyFrom(numpy_helper.from_array(w16, "w16"))
    onnx.save(half, str(tmp_path / "m16.onnx"))
    carried = tmp_path / "carried"
    info32 = gpu_weights.pack(fp32, fp32, carried / "m.onnx", regenerated=True, min_elems=100)
    info16 = gpu_weights.pack(tmp_path / "m16.onnx", fp32, carried / "m16.onnx", regenerated=True, min_elems=100)
    assert info32["recipe_bytes"] == 64 * 96 * 4 and info16["recipe_bytes"] == 64 * 96 * 2
    assert (carried / "m.onnx").stat().st_size < 2000  # the weights did not travel
    assert json.loads((carried / "m16.onnx.weights.json").read_text())["w16"]["patch"][0] == [0]
    out32 = gpu_weights.unpack(carried / "m.onnx", tmp_path / "r.onnx")
    out16 = gpu_weights.unpack(carried / "m16.onnx", tmp_path / "r16.onnx", fp32=out32)
    for src, got in ((fp32, out32), (tmp_path / "m16.onnx", out16)):
        want = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(src)).graph.initializer}
        have = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(got)).graph.initializer}
        assert want.keys() == have.keys()
        assert all(want[k].dtype == have[k].dtype and want[k].tobytes() == have[k].tobytes() for k in want)


def test_a_rebuilt_tensor_with_other_bits_is_refused(tmp_path: Path) -> None:
    fp32 = _model(tmp_path / "m.onnx")
    gpu_weights.pack(fp32, fp32, tmp_path / "c" / "m.onnx", regenerated=True, min_elems=100)
    recipes = tmp_path / "c" / "m.onnx.weights.json"
    data = json.loads(recipes.read_text())
    data["w"]["regen"][2] *= 1.5  # another std: another draw
    recipes.write_text(json.dumps(data))
    with pytest.raises(RuntimeError, match="other bits"):
        gpu_weights.unpack(tmp_path / "c" / "m.onnx", tmp_path / "r.onnx")


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash, timeout")
def test_dry_run_reports_every_section_with_numbers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")  # the decoder is a Llama built from a config
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PY": sys.executable, "GPU_TMP": str(tmp_path / "tmp")}
    models, out = tmp_path / "models", tmp_path / "out"
    subprocess.run([sys.executable, "bench/gpu_prepare.py", "--tiny", "--models", "cnn,encoder,decoder", "--out",
                    str(models), "--work", str(tmp_path / "work")], cwd=ROOT, env=env, check=True, timeout=300,
                   capture_output=True)
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "measure", "--dry-run", "--models", str(models), "--out",
                           str(out)], cwd=ROOT, env=env, timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    for step in ("env", "unpack", "latency", "accuracy", "decode", "convert", "amp", "gputests"):
        assert "error" not in res[step], (step, res[step])
    assert res["gputests"]["tests"] >= 1 and res["gputests"]["failures"] == res["gputests"]["errors"] == 0
    lat = res["latency"]
    for key in ("cnn/batch 2", "encoder/batch 2"):
        assert {"fp32", "mpinfer"} <= set(lat[key])
        assert all(_finite(r["p50_ms"]) and r["p50_ms"] > 0 and r["p90_ms"] >= r["p50_ms"] for r in lat[key].values())
    for name in ("cnn", "encoder", "decoder"):
        row = res["accuracy"][f"{name}/mpinfer"]
        assert row["device"].keys() == row["strict"].keys() and isinstance(row["budget_holds"], bool)
        for o, fig in row["device"].items():
            assert _finite(fig["max_abs"]) and _finite(row["strict"][o]["max_abs"]) and fig["max_abs"] > 0
            assert _finite(row["ratio_max_abs"][o])
        # the dry run's "device" is ONNX Runtime CPU: the figures prepare measured there, on the same data
        for o, fig in row["device"].items():
            assert fig["max_abs"] == pytest.approx(row["ort_cpu"][o]["max_abs"], rel=1e-3)
    dec = res["decode"]["mpinfer"]
    assert all(t["candidate"]["decode_tokens_per_s"] > 0 for t in dec["latency"].values())
    assert 0 <= dec["metrics"]["token_agreement"] <= 1
    conv = res["convert"]
    assert conv["numerics"] == "ort" and conv["passed"] is True and 0 < conv["low_share_flops"] <= 1
    amp = {(r["model"], r["precision"]): r for r in res["amp"]["rows"]}
    assert {("resnet", "fp32"), ("resnet", "bf16"), ("transformer", "fp32"), ("transformer", "bf16")} <= set(amp)
    assert all(r["step_ms"] > 0 for r in amp.values())
    md = (out / "results.md").read_text()
    assert "latency" in md and "strict" in md and "tokens/s" in md and "--numerics ort" in md and "AMP" in md
