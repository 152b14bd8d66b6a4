"""Models whose weights are external data: planned, gated and verified with the weights memory-mapped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.specs import Precision
from tests.precision.graphs import chain, save
from tests.precision.test_search import _npz


def _external(model: onnx.ModelProto, path: Path) -> Path:
    """``model`` saved with every tensor in ``<name>.data`` (size_threshold=0)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=0)
    return path


def _plan_of(res) -> list[tuple[str, str, str]]:
    return [(n.name, n.precision.value, n.reason) for n in res.plan.nodes]


def _outputs(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("numerics", ["strict", "ort"])
def test_external_weights_give_the_plan_embedded_weights_give(tmp_path, numerics):
    """Calibration, the budget search and the final verification read memory-mapped weights: same plan, same model."""
    model = chain(6)
    data = _npz(tmp_path / "cal.npz")
    budget = "max_abs<=2e-3"  # a mixed plan: some groups go back to FP32
    runs = {}
    (tmp_path / "emb").mkdir()
    for kind, src in (("embedded", save(model, tmp_path / "emb" / "m.onnx")),
                      ("external", _external(model, tmp_path / "ext" / "m.onnx"))):
        runs[kind] = convert_precision(ConvertConfig(
            model=src, output=tmp_path / kind / "m.fp16.onnx", calibration=str(data), budget=budget,
            numerics=numerics, progress=False,
        ))
    emb, ext = runs["embedded"], runs["external"]
    assert _plan_of(ext) == _plan_of(emb)
    if numerics == "strict":  # (ONNX Runtime's CPU FP16 meets this budget whole)
        assert {p for _, p, _ in _plan_of(emb)} == {"fp16", "fp32"}  # the search had something to decide
    assert ext.plan.summary["verification"]["samples"] == emb.plan.summary["verification"]["samples"] == 32
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    np.testing.assert_array_equal(_outputs(ext.output, x), _outputs(emb.output, x))  # same graph, same weights
    assert not [p for p in (tmp_path / "external").iterdir() if p.name.startswith(".")]  # staging folder removed


def test_external_weights_go_through_the_validity_gate_on_the_written_file(tmp_path, monkeypatch):
    """The checker, type inference and ONNX Runtime check the staged file, and a node ONNX Runtime refuses in
    BF16 is repaired (kept FP32 with the reason) as for a model in memory."""
    import mpinfer.precision.graph.validate as validate
    from tests.precision.conformance import float_cases

    checked: list[Path] = []
    run_path = validate.run_checks_path
    monkeypatch.setattr(validate, "run_checks_path",
                        lambda path, checks=validate.CHECKS: checked.append(Path(path)) or run_path(path, checks))
    # collect_testcases caches its first answer process-wide: always ask for all cases (op_type None).
    case = next(c for c in float_cases() if c.name == "test_attention_4d_attn_mask_3d_causal")
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    mask = next(i for i in model.graph.input if i.name == "attn_mask")  # a weight, so the model has external data
    model.graph.input.remove(mask)
    rng = np.random.default_rng(0)
    model.graph.initializer.append(onnx.numpy_helper.from_array(rng.standard_normal((2, 1, 4, 6), np.float32),
                                                                "attn_mask"))
    src = _external(model, tmp_path / "in" / "attn.onnx")
    out = tmp_path / "out" / "attn.bf16.onnx"
    res = convert_precision(ConvertConfig(model=src, output=out, precision=Precision.BF16, calibration="none",
                                          progress=False))
    attn = next(n for n in res.plan.nodes if n.op_type == "Attention")
    assert attn.precision is Precision.FP32 and "ONNX Runtime refuses it in bf16" in attn.detail
    staged = [p for p in checked if p != src]
    # the candidate, its repair, then the file about to be published (issue 28: the gate on the bytes written)
    assert len(staged) == 3 and all(p.parent.parent == out.parent and p.name == out.name for p in staged)
    assert src in checked  # the failure is held against the output only when the input passes that check
    assert validate.run_checks_path(out) == []  # and the file written passes every check
