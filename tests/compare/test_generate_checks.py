"""Generation figures in the one check grammar: compare --check, report --check, pipeline.toml."""

from __future__ import annotations

import json

import pytest

from mpinfer.checks import parse_checks
from mpinfer.errors import InvalidInputError
from mpinfer.metrics import GENERATION_METRICS, GENERATION_OUTPUT, METRIC_DOCS, higher_is_better
from tests.conftest import assert_user_error
from tests.kv_models import prompts_npz

TOKENS = 4


@pytest.fixture(scope="module")
def decoders(tmp_path_factory, exported_llama):
    """Two tiny Llamas with different weights (KV cache; the second exported by TorchScript, faster), and prompts
    for them."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    tmp = tmp_path_factory.mktemp("genchecks")
    return (exported_llama(0)[1].path, exported_llama(1, "torchscript")[1].path,
            prompts_npz(tmp / "prompts.npz", count=4, length=6))


def test_generation_metrics_are_defined_once_and_model_level():
    assert GENERATION_METRICS <= set(METRIC_DOCS)
    assert higher_is_better("token_agreement") and higher_is_better("first_divergence_min")
    assert not higher_is_better("ppl_ratio")
    checks = parse_checks("token_agreement>=0.95,generate:ppl_ratio<=1.02,cosine>=0.99")
    assert [c.output for c in checks] == [GENERATION_OUTPUT, GENERATION_OUTPUT, None]
    assert str(checks) == "generate:token_agreement>=0.95,generate:ppl_ratio<=1.02,cosine>=0.99"
    assert str(checks.without_generation()) == "cosine>=0.99"
    assert parse_checks("ppl_ratio<=1.1").without_generation() is None
    # a per-output check never reads the generation figures, and a generation check only those
    per = {"logits": {"cosine": 0.5}, GENERATION_OUTPUT: {"token_agreement": 0.9, "ppl_ratio": 1.0}}
    assert checks.failures(per) == ["generate:token_agreement>=0.95 on 'generate' (got 0.9)",
                                    "cosine>=0.99 on 'logits' (got 0.5)"]
    assert "compare --generate" in checks.failures({"logits": {"cosine": 1.0}})[0]


@pytest.mark.parametrize("text", ["logits:token_agreement>=0.9", "generate:cosine>=0.9"])
def test_generation_selectors_are_refused_where_they_mean_nothing(text):
    with pytest.raises(InvalidInputError, match="generat"):
        parse_checks(text)


def test_compare_checks_generation_figures_pass_fail_and_report_rethreshold(decoders, invoke, tmp_path):
    base, other, prompts = decoders
    report = tmp_path / "report"
    r = invoke("compare", base, base, "--data", prompts, "--generate", TOKENS, "--no-divergence",
               "--check", "token_agreement>=0.95,first_divergence_min>=4,ppl_ratio<=1.02,cosine>=0.999",
               "--report", report, "--quiet")
    assert r.exit_code == 0, r.output
    assert "PASS" in r.output and "generate:token_agreement>=0.95" in r.output
    saved = json.loads((report / "report.json").read_text())
    (cand,) = saved["candidates"]
    assert cand["generation"]["token_agreement"] == 1.0
    gen_outcomes = [o for o in cand["checks"] if o["output"] == GENERATION_OUTPUT]
    assert [o["passed"] for o in gen_outcomes] == [True, True, True]
    # report --check re-thresholds the saved generation figures: an impossible threshold now fails
    r = invoke("report", report / "report.json", "--check", "token_agreement>1")
    assert r.exit_code == 1, r.output
    assert "generate:token_agreement>1" in r.output
    r = invoke("report", report / "report.json", "--check", "generate:token_agreement>=1,ppl_ratio<=1.001")
    assert r.exit_code == 0, r.output

    r = invoke("compare", base, other, "--data", prompts, "--generate", TOKENS, "--no-divergence",
               "--check", "token_agreement>=0.95", "--quiet")
    assert r.exit_code == 1, r.output
    assert "generate:token_agreement>=0.95" in r.output and "FAIL" in r.output


def test_generation_check_without_generate_is_refused_before_anything_runs(decoders, invoke, tmp_path):
    base, _, prompts = decoders
    r = invoke("compare", base, base, "--data", prompts, "--check", "token_agreement>=0.9",
               "--report", tmp_path / "rep")
    assert_user_error(r, "--generate")
    assert not (tmp_path / "rep").exists() or not any((tmp_path / "rep").iterdir())


def test_report_check_on_generation_without_figures_is_a_user_error(decoders, invoke, tmp_path):
    base, _, prompts = decoders
    report = tmp_path / "report"
    r = invoke("compare", base, base, "--data", prompts, "--no-divergence", "--report", report, "--quiet")
    assert r.exit_code == 0, r.output
    r = invoke("report", report / "report.json", "--check", "ppl_ratio<=1.02")
    assert_user_error(r, "without generation figures")
