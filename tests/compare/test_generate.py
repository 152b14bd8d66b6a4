"""compare --generate: greedy generation metrics through ONNX Runtime, and the CLI from export to compare."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest

from mpinfer.compare import passes
from mpinfer.errors import InvalidInputError
from mpinfer.export import ExportConfig, export_onnx
from mpinfer.generation import GenerateConfig, first_divergence, generate_compare, perplexity, step_cosines
from tests.conftest import assert_user_error
from tests.kv_models import llama_folder, prompts_npz

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

TOKENS = 8


@pytest.fixture(scope="module")
def decoders(tmp_path_factory, exported_llama):
    """Two tiny Llamas with different weights, exported with their KV cache, and prompts for them (the second by
    the TorchScript exporter: the same inputs and outputs, ~10x faster to export than a second torch.export)."""
    tmp = tmp_path_factory.mktemp("gen")
    return exported_llama(0)[1].path, exported_llama(1, "torchscript")[1].path, prompts_npz(tmp / "prompts.npz")


def test_identical_models_agree_on_every_token(decoders):
    base, _, prompts = decoders
    (res,) = generate_compare(GenerateConfig(str(base), (str(base),), str(prompts), TOKENS, batch_size=4))
    m = res.metrics()
    assert res.first_divergence == [TOKENS] * 6 and m["first_divergence_min"] == TOKENS
    assert m["token_agreement"] == 1.0
    eps = float(np.finfo(np.float32).eps)  # same session, same inputs: equal up to rounding
    assert m["step_cosine_min"] >= 1 - 16 * eps and abs(m["ppl_ratio"] - 1) <= 16 * eps
    assert len(res.step_cosine) == TOKENS
    assert set(res.latency) == {4}  # the decodes' own figures, at their batch size
    for who in ("baseline", "candidate"):
        assert res.latency[4][who]["prefill_ms"] > 0 and res.latency[4][who]["decode_tokens_per_s"] > 0


def test_a_different_model_diverges_and_is_measured_so(decoders):
    base, other, prompts = decoders
    (res,) = generate_compare(GenerateConfig(str(base), (str(other),), str(prompts), TOKENS,
                                             latency_batch_sizes=(2,)))
    m = res.metrics()
    assert m["token_agreement"] < 0.5 and m["first_divergence_min"] < TOKENS
    assert m["step_cosine_min"] < 0.9 and m["ppl_ratio"] > 1
    assert set(res.latency) == {2}


def test_metric_helpers_on_known_values():
    ref = np.array([[1, 2, 3, 4], [1, 2, 3, 4]])
    assert first_divergence(ref, np.array([[1, 2, 3, 4], [1, 9, 3, 4]])) == [4, 1]
    uniform = np.zeros((1, 3, 5))
    assert math.isclose(perplexity(uniform, np.zeros((1, 3), np.int64)), 5.0, rel_tol=1e-12)
    logits = np.random.default_rng(0).normal(size=(2, 3, 7))
    assert step_cosines(logits, logits) == pytest.approx([1.0] * 3, rel=1e-12)
    assert step_cosines(logits, -logits) == pytest.approx([-1.0] * 3, rel=1e-12)


def test_generate_needs_a_kv_cache_model(tmp_path, decoders):
    base, _, prompts = decoders
    folder = llama_folder(tmp_path / "plain")
    plain = export_onnx(ExportConfig(source=str(folder), output=tmp_path / "plain.onnx", past=False,
                                     exporter="torchscript")).path
    with pytest.raises(InvalidInputError, match="without a KV cache"):
        generate_compare(GenerateConfig(str(base), (str(plain),), str(prompts), 2))


def test_cli_export_convert_with_prompts_and_budget_then_compare_generate(tmp_path, invoke):
    """The issue's 'done when': a tiny causal LM goes export (KV cache) -> convert (prompts, budget) ->
    compare --generate, through the CLI."""
    folder = llama_folder(tmp_path / "llama")
    prompts = prompts_npz(tmp_path / "prompts.npz")
    m32, m16, report = tmp_path / "m.onnx", tmp_path / "m.fp16.onnx", tmp_path / "report"
    r = invoke("export", folder, "-o", m32)
    assert r.exit_code == 0, r.output
    assert "over a prefill and 3 decode steps (KV cache)" in r.output
    assert "past_key_values.0.key" in {i.name for i in onnx.load(str(m32)).graph.input}
    r = invoke("convert", m32, "-o", m16, "--calibration", f"prompts:{prompts}:steps=4", "--budget", "cosine>=0.99")
    assert r.exit_code == 0, r.output
    plan = json.loads((tmp_path / "m.fp16.plan.json").read_text())
    assert plan["calibration"]["kind"] == "prompts" and plan["calibration"]["samples"] == 6 * 5
    assert "range:overflow" not in plan["summary"]["reasons"]  # the attention masks were rewritten, not kept FP32
    r = invoke("compare", m32, m16, "--data", prompts, "--generate", TOKENS, "--no-divergence", "--report", report)
    assert r.exit_code == 0, r.output
    assert "Generation (greedy, ONNX Runtime)" in r.output and "decode tokens/s" in r.output
    (gen,) = json.loads((report / "report.json").read_text())["data"]["generation"]
    assert gen["tokens"] == TOKENS and gen["prompts"] == 6 and len(gen["step_cosine"]) == TOKENS
    assert 0 <= gen["metrics"]["token_agreement"] <= 1 and gen["metrics"]["step_cosine_min"] >= 0.99
    assert "## Generation" in (report / "report.md").read_text()
    assert "<h2>Generation (greedy, ONNX Runtime)</h2>" in (report / "index.html").read_text()


def test_cli_generate_without_data_is_a_user_error(invoke, decoders):
    base, _, _ = decoders
    r = invoke("compare", base, base, "--generate", "4", "--no-divergence")
    assert_user_error(r, "--generate: received no --data")
    r = invoke("compare", base, base, "--generate", "4", "--data", "random:2")
    assert_user_error(r, "--generate: received --data random:2")


def test_compare_generate_loads_each_model_once_for_its_data_pass_and_its_decodes(decoders, monkeypatch, invoke,
                                                                                  tmp_path):
    """One ONNX Runtime session per model (no divergence): the data pass's session decodes for generation too, and
    the figures are those of generation in sessions of its own. The decodes do not run again the calls the data
    pass ran: the baseline's greedy decode starts with the data's batches (its own decode of the prompts), the
    candidate's teacher-forced decode with the prefills its data pass ran."""
    import onnxruntime

    base, other, prompts = decoders
    made: list[str] = []
    runs = {str(base): 0, str(other): 0}

    class Counted(onnxruntime.InferenceSession):
        def __init__(self, path_or_bytes, *a, **k):
            made.append(str(path_or_bytes)[-12:])
            super().__init__(path_or_bytes, *a, **k)

        def run(self, *a, **k):
            runs[self._model_path] += 1
            return super().run(*a, **k)

    ref = generate_compare(GenerateConfig(str(base), (str(other),), str(prompts), TOKENS, batch_size=4))[0]
    monkeypatch.setattr(onnxruntime, "InferenceSession", Counted)
    report = tmp_path / "report"
    r = invoke("compare", base, other, "--data", prompts, "--generate", TOKENS, "--batch-size", 4, "--no-divergence",
               "--report", report)
    assert r.exit_code in (0, 1), r.output
    assert len(made) == 2, made
    doc = json.loads((report / "report.json").read_text())
    (gen,) = doc["data"]["generation"]
    assert gen["metrics"] == pytest.approx(ref.metrics())
    groups = -(-gen["prompts"] // 4)  # calls of 4 prompts: each a prefill, then TOKENS - 1 decode steps
    assert doc["data"]["batches"] == groups * 5 < groups * TOKENS  # the data: prefill + 4 steps of each group
    assert runs[str(base)] == groups * TOKENS  # its decode alone: the data's 5 calls a group are its first 5
    assert runs[str(other)] == doc["data"]["batches"] + groups * (TOKENS - 1)  # every prefill once
    latency = gen["latency"]["4"]
    assert latency["baseline"]["prefill_ms"] > 0 and latency["candidate"]["prefill_ms"] > 0  # the replayed calls' time


def test_compare_generate_runs_the_baseline_once_on_each_decoded_batch(decoders, monkeypatch, invoke, tmp_path):
    """The prompts' decode and the data pass share the baseline's runs: no batch is run twice on the same feeds,
    and the per-output figures are those of a pass that ran every batch again."""
    import onnxruntime

    base, other, prompts = decoders
    args = ["--data", prompts, "--generate", TOKENS, "--batch-size", 4, "--no-divergence", "--quiet"]
    real_outputs_of = passes.Remembered.outputs_of
    monkeypatch.setattr(passes.Remembered, "outputs_of", lambda self, feeds: None)  # every batch run again
    r = invoke("compare", base, other, *args, "--report", tmp_path / "again")
    assert r.exit_code in (0, 1), r.output
    monkeypatch.setattr(passes.Remembered, "outputs_of", real_outputs_of)
    seen: dict[tuple[int, ...], object] = {}  # the ids of a run's input arrays -> the arrays (kept alive)
    repeated = []

    class Counted(onnxruntime.InferenceSession):
        def run(self, names, feeds, *a, **k):
            if self._model_path == str(base):
                key = tuple(sorted(id(v) for v in feeds.values()))
                repeated.extend([key] if key in seen else [])
                seen[key] = list(feeds.values())
            return super().run(names, feeds, *a, **k)

    monkeypatch.setattr(onnxruntime, "InferenceSession", Counted)
    r = invoke("compare", base, other, *args, "--report", tmp_path / "once")
    assert r.exit_code in (0, 1), r.output
    assert seen and not repeated
    once, again = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("once", "again"))
    assert once["candidates"][0]["outputs"] == again["candidates"][0]["outputs"]


def test_generate_reads_each_model_and_the_prompts_once_with_one_session_open(decoders, monkeypatch):
    """compare --generate's config check reads each graph and the prompts once, generate_compare reuses them,
    and no two models are open at once."""
    from types import SimpleNamespace

    from mpinfer import generation
    from mpinfer.generation import Decoder, generate_config

    base, other, prompts = decoders
    read, loads, open_now, most = [], [], [0], [0]
    real_specs, real_load, real_open, real_close = (generation._specs, generation.load_prompts, Decoder.open,
                                                    Decoder.close)

    def spy_open(self, providers, session=None, known=()):
        open_now[0] += 1
        most[0] = max(most[0], open_now[0])
        return real_open(self, providers, session, known)

    def spy_close(self):
        open_now[0] -= 1
        real_close(self)

    monkeypatch.setattr(generation, "_specs", lambda p: read.append(str(p)) or real_specs(p))
    monkeypatch.setattr(generation, "load_prompts", lambda *a: loads.append(a) or real_load(*a))
    monkeypatch.setattr(Decoder, "open", spy_open)
    monkeypatch.setattr(Decoder, "close", spy_close)
    compare = SimpleNamespace(data=str(prompts), baseline=str(base), candidates=[str(other)], batch_size=4,
                              batch_sizes=None)
    (res,) = generate_compare(generate_config(compare, TOKENS))
    assert read == [str(base), str(other)] and len(loads) == 1
    assert most[0] == 1 and open_now[0] == 0
    assert res.prompts == 6 and len(res.step_cosine) == TOKENS


def test_first_divergence_from_the_forced_decode_is_the_free_decodes(decoders):
    """The teacher-forced decode gives each prompt's first divergence: the same as the candidate's own greedy
    continuation against the baseline's."""
    from mpinfer.data.decode import load_prompts
    from mpinfer.generation import Decoder

    base, other, prompts_path = decoders
    (res,) = generate_compare(GenerateConfig(str(base), (str(other),), str(prompts_path), TOKENS, batch_size=3))
    prompts = load_prompts(str(prompts_path))[0]
    runs = []
    for path in (base, other):
        model = Decoder(str(path)).open(())
        runs.append(model.decode(prompts, TOKENS, 3))
        model.close()
    assert res.first_divergence == first_divergence(runs[0].tokens, runs[1].tokens)
    assert min(res.first_divergence) < TOKENS  # a real divergence was located


def test_a_replayed_call_answers_equal_feeds_once_and_runs_any_other():
    """Replay: equal names, dtypes, shapes and values take the known outputs (once, credited with their seconds);
    a dtype, a value or a name that differs runs the session."""
    from mpinfer.generation import KnownCall, Replay

    ran: list[dict] = []

    def run(feeds):
        ran.append(dict(feeds))
        return {"logits": np.zeros((1, 1, 3), np.float32), "present.0.key": np.ones((1, 1, 2, 1), np.float32)}

    feeds = {"input_ids": np.array([[1, 2]], np.int64), "past_key_values.0.key": np.zeros((1, 1, 0, 1), np.float32)}
    outputs = {"logits": np.full((1, 1, 3), 7, np.float32), "present.0.key": np.full((1, 1, 2, 1), 5, np.float32)}
    replay = Replay(run, [KnownCall(feeds, outputs, 0.25)], ["logits", "present.0.key"])
    other_dtype = {**feeds, "input_ids": feeds["input_ids"].astype(np.int32)}
    other_value = {**feeds, "input_ids": np.array([[1, 3]], np.int64)}
    assert replay(other_dtype)["logits"][0, 0, 0] == 0 and replay(other_value)["logits"][0, 0, 0] == 0
    assert replay({"input_ids": feeds["input_ids"]})["logits"][0, 0, 0] == 0
    assert len(ran) == 3 and replay.take_credit() == 0.0
    same = {k: v.copy() for k, v in feeds.items()}  # equal, not the same arrays
    assert replay(same)["present.0.key"][0, 0, 0, 0] == 5 and len(ran) == 3
    assert 0.2 < replay.take_credit() <= 0.25 and replay.take_credit() == 0.0
    assert replay(same)["logits"][0, 0, 0] == 0 and len(ran) == 4  # each known call answers once
