"""`convert --numerics`: every evaluator's name is offered, and numerics this machine cannot run are refused at once.

The choices come from the evaluator registry (precision/numerics/registry.EVALUATORS), not a second list. `ort-cuda`
without ONNX Runtime's CUDA provider and `tensorrt` without TensorRT or a GPU are user errors (exit 1, what /
received / expected / hint) raised before any work: nothing is written. On a machine that has them the refusal
tests skip (they need their absence, not TensorRT).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import mpinfer
from mpinfer.backends.ort import cuda_usable
from mpinfer.errors import BackendUnavailableError, InvalidInputError
from mpinfer.gpu import gpu_info, tensorrt_installed
from mpinfer.pipeline import run_pipeline
from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.precision.numerics.registry import EVALUATORS, check_numerics
from tests.conftest import assert_user_error
from tests.precision.graphs import mlp, save

# The refusal each numerics gives where it cannot run, and whether it can run here.
MISSING = {
    "ort-cuda": (r"--numerics ort-cuda: received an ONNX Runtime without a usable CUDA provider", cuda_usable),
    "tensorrt": (r"--numerics tensorrt: received no `tensorrt` Python package|--numerics tensorrt: received no CUDA",
                 lambda: tensorrt_installed() and gpu_info(0) is not None),
}

# Test ids apart from the marker names (conftest skips by the `tensorrt` marker; these tests need TensorRT's absence).
NUMERICS_IDS = [f"numerics-{name}" for name in sorted(MISSING)]


def _unavailable(numerics: str) -> str:
    pattern, available = MISSING[numerics]
    if available():
        pytest.skip(f"--numerics {numerics} runs on this machine: nothing to refuse")
    return pattern


@pytest.fixture
def work(tmp_path):
    """A model and calibration data in ``tmp_path``, and the folder convert would write into."""
    model = save(mlp(), tmp_path / "m.onnx")
    data = tmp_path / "cal.npz"
    np.savez(data, x=np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32))
    return model, data, tmp_path / "out"


def test_the_cli_offers_every_evaluator_and_no_other_name(invoke):
    from mpinfer.commands.convert import convert

    (param,) = [p for p in convert.params if p.name == "numerics"]
    assert list(param.type.choices) == list(EVALUATORS) == ["strict", "ort", "ort-cuda", "tensorrt"]
    r = invoke("convert", "--help")
    assert r.exit_code == 0 and all(name in r.output for name in EVALUATORS)


def test_an_unknown_numerics_name_is_a_usage_error_listing_the_names(invoke, work):
    model, data, out = work
    r = invoke("convert", model, "--calibration", data, "--numerics", "cuda", "-o", out / "m.fp16.onnx")
    assert r.exit_code == 2 and "'ort-cuda'" in r.output and "'tensorrt'" in r.output
    with pytest.raises(InvalidInputError, match=r"--numerics: received 'cuda', expected strict or ort or ort-cuda"):
        check_numerics("cuda")
    assert not out.exists()


@pytest.mark.parametrize("numerics", sorted(MISSING), ids=NUMERICS_IDS)
def test_numerics_this_machine_cannot_run_are_refused_before_any_work(invoke, work, numerics):
    pattern = _unavailable(numerics)
    model, data, out = work
    r = invoke("convert", model, "--calibration", data, "--numerics", numerics, "-o", out / "m.fp16.onnx")
    assert_user_error(r, pattern)
    (error,) = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert re.search(r", expected .+\. Hint: .*use --numerics (strict|ort)", error), error
    assert not out.exists()  # nothing written, not even the output folder's lock or staging files
    assert sorted(p.name for p in model.parent.iterdir()) == ["cal.npz", "m.onnx"]


@pytest.mark.parametrize("numerics", sorted(MISSING), ids=NUMERICS_IDS)
def test_the_python_api_and_the_config_refuse_them_the_same_way(work, numerics):
    pattern = _unavailable(numerics)
    model, data, out = work
    with pytest.raises(BackendUnavailableError, match=pattern):
        mpinfer.convert(model, out / "a.onnx", calibration=str(data), numerics=numerics)
    with pytest.raises(BackendUnavailableError, match=pattern):
        convert_precision(ConvertConfig(model=model, output=out / "b.onnx", calibration=str(data), numerics=numerics))
    assert not out.exists()


@pytest.mark.parametrize("numerics", sorted(MISSING), ids=NUMERICS_IDS)
def test_a_pipeline_refuses_them_before_any_stage_runs(tmp_path, invoke, work, numerics):
    pattern = _unavailable(numerics)
    model, data, _ = work
    toml = tmp_path / "p.toml"
    toml.write_text(f'[convert]\nmodel = "{model.name}"\ncalibration = "{data.name}"\nnumerics = "{numerics}"\n')
    with pytest.raises(BackendUnavailableError, match=rf"Pipeline table \[convert\] numerics = '{numerics}': "):
        run_pipeline(toml)
    assert_user_error(invoke("run", toml), pattern)
    assert not (tmp_path / "out").exists()
