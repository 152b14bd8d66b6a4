"""convert --budget with generation figures: greedy decoding of the calibration prompts, repair, refusal;
and the same checks through pipeline.toml."""

from __future__ import annotations

import json

import pytest

from mpinfer.export import ExportConfig, export_onnx
from mpinfer.pipeline import run_pipeline
from tests.conftest import assert_user_error
from tests.kv_models import llama_folder, prompts_npz

STEPS = 3  # calibration decode steps: generation verifies STEPS + 1 tokens per prompt


@pytest.fixture(scope="module")
def decoder(tmp_path_factory, exported_llama):
    """A tiny Llama exported with its KV cache, and prompts for it."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    tmp = tmp_path_factory.mktemp("genbudget")
    model = exported_llama(0)[1].path
    return model, prompts_npz(tmp / "prompts.npz")


def _convert_prompts(invoke, model, prompts, out, budget, steps=STEPS):
    """``mpinfer convert`` calibrated on the prompts (prefill + ``steps`` greedy steps) under ``budget``."""
    return invoke("convert", model, "-o", out, "--calibration", f"prompts:{prompts}:steps={steps}", "--budget", budget)


def _verification(out):
    return json.loads(out.with_name(out.name[:-5] + ".plan.json").read_text())["summary"]["verification"]


def test_budget_with_token_agreement_is_verified_by_greedy_generation(decoder, invoke, tmp_path):
    model, prompts = decoder
    out = tmp_path / "m16.onnx"
    r = _convert_prompts(invoke, model, prompts, out, "token_agreement>=0.99,cosine>=0.99")
    assert r.exit_code == 0, r.output
    assert "greedy generation of 6 prompts x 4 tokens (ort): token_agreement=" in " ".join(r.output.split())
    ver = _verification(out)
    gen = ver["generation"]
    assert ver["passed"] and ver["budget"] == "cosine>=0.99"  # the per-output part; generation its own
    assert gen["budget"] == "generate:token_agreement>=0.99" and gen["numerics"] == "ort"
    assert gen["prompts"] == 6 and gen["tokens"] == STEPS + 1
    assert gen["figures"]["token_agreement"] >= 0.99 and ver["figures"]["generate"] == gen["figures"]
    # compare --generate on the same prompts and tokens reproduces the plan's generation figures
    report = tmp_path / "report"
    r = invoke("compare", model, out, "--data", prompts, "--generate", STEPS + 1, "--no-divergence",
               "--check", "token_agreement>=0.99", "--report", report, "--quiet")
    assert r.exit_code == 0, r.output
    (cand,) = json.loads((report / "report.json").read_text())["candidates"]
    for metric in ("token_agreement", "first_divergence_min"):  # shares and indices of integer tokens
        assert cand["generation"][metric] == gen["figures"][metric]


def test_a_failing_generation_budget_moves_nodes_back_to_fp32(decoder, invoke, tmp_path):
    """All-FP16 changes the perplexity by some 1e-5 here (its RMSNorms fused, the export at opset 23; 3e-3 with
    them FP16 in the opset-17 chain): a tighter ppl_ratio takes the repair loop."""
    model, prompts = decoder
    out = tmp_path / "m16.onnx"
    r = _convert_prompts(invoke, model, prompts, out, "ppl_ratio<=1.000002")
    assert r.exit_code == 0, r.output
    ver = _verification(out)
    assert ver["passed"] and ver["repair_rounds"] >= 1 and ver["moved_to_fp32"] > 0
    assert ver["budget"] == "nonfinite<=0"  # generation checks alone: the outputs keep the NaN/Inf floor
    assert ver["generation"]["figures"]["ppl_ratio"] <= 1.000002


def test_an_unmeetable_generation_budget_writes_nothing(decoder, invoke, tmp_path):
    model, prompts = decoder
    out = tmp_path / "m16.onnx"
    r = _convert_prompts(invoke, model, prompts, out, "token_agreement>1", steps=1)
    assert_user_error(r, r"generate:token_agreement>1 on 'generate' \(got 1\)")
    assert not out.exists() and not out.with_name("m16.plan.json").exists()


def test_generation_budget_needs_prompts_and_a_kv_cache(decoder, invoke, tmp_path):
    model, _ = decoder
    r = invoke("convert", model, "-o", tmp_path / "a.onnx", "--calibration", "random:2",
               "--budget", "token_agreement>=0.9")
    assert_user_error(r, "--calibration random:2")
    folder = llama_folder(tmp_path / "plain")
    plain = export_onnx(ExportConfig(source=str(folder), output=tmp_path / "plain.onnx", past=False,
                                     exporter="torchscript")).path
    r = invoke("convert", plain, "-o", tmp_path / "b.onnx", "--budget", "ppl_ratio<=1.01")
    assert_user_error(r, "without a KV cache")
    assert not (tmp_path / "a.onnx").exists() and not (tmp_path / "b.onnx").exists()


def test_pipeline_convert_budget_and_compare_checks_take_generation_figures(decoder, tmp_path):
    model, prompts = decoder
    toml = tmp_path / "p.toml"
    toml.write_text(
        f'[pipeline]\nwork_dir = "w"\n'
        f'[convert]\nmodel = "{model}"\ncalibration = "{prompts}"\n'  # input_ids only: decoded (4 steps)
        f'budget = "token_agreement>=0.99"\n'
        f'[compare]\nbaseline = "{model}"\ndata = "{prompts}"\ngenerate = 5\ndivergence = false\n'
        f'checks = "token_agreement>=0.99,generate:ppl_ratio<=1.05,cosine>=0.99"\n'
    )
    result = run_pipeline(toml)
    assert result.passed
    (comparison,) = (tmp_path / "w").rglob("comparison.json")
    (cand,) = json.loads(comparison.read_text())["candidates"]
    assert {o["check"] for o in cand["checks"] if o["output"] == "generate"} == {
        "generate:token_agreement>=0.99", "generate:ppl_ratio<=1.05"}
    (plan,) = (tmp_path / "w").rglob("*.plan.json")
    assert json.loads(plan.read_text())["summary"]["verification"]["generation"]["figures"]["token_agreement"] >= 0.99
    # a malformed generation check is refused before any stage runs
    toml.write_text(toml.read_text().replace("generate:ppl_ratio", "logits:ppl_ratio"))
    from mpinfer.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="generation figure"):
        run_pipeline(toml, force=True)


def test_pipeline_takes_a_prompts_calibration_relative_to_the_toml(decoder, tmp_path):
    """`calibration = "prompts:FILE:steps=N"` names FILE relative to the TOML, like any data path."""
    import shutil

    model, prompts = decoder
    shutil.copy(prompts, tmp_path / "my_prompts.npz")
    toml = tmp_path / "p.toml"
    toml.write_text(
        f'[pipeline]\nwork_dir = "w"\n'
        f'[convert]\nmodel = "{model}"\ncalibration = "prompts:my_prompts.npz:steps=2"\nbudget = "cosine>=0.99"\n'
    )
    result = run_pipeline(toml)
    (plan,) = (tmp_path / "w").rglob("*.plan.json")
    assert result.passed is not False and json.loads(plan.read_text())["summary"]["verification"]["samples"] > 0
    toml.write_text(toml.read_text().replace("my_prompts.npz", "missing.npz"))
    from mpinfer.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"\[convert\] calibration"):
        run_pipeline(toml, force=True)
