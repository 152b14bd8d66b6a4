from __future__ import annotations

from importlib.util import find_spec

import numpy as np
import pytest
import torch

from mpinfer.backends.ort import OrtRunner
from mpinfer.backends.torch_runner import TorchRunner
from mpinfer.errors import BackendUnavailableError, InvalidInputError, ModelLoadError
from mpinfer.runners import open_runner
from tests.tolerances import torch_reorder_atol


def _x(n=3):
    return np.random.default_rng(0).standard_normal((n, 64)).astype(np.float32)


def test_spec_matches_module():
    from models import mlp

    with TorchRunner("models/mlp.py:build") as runner:
        assert [str(s) for s in runner.input_specs()] == ["x:batchx64:float32"]
        out = runner.infer({"x": _x()})
    assert list(out) == ["output_0"]
    net = mlp.build()
    with torch.no_grad():
        ref = net(torch.from_numpy(_x())).numpy()
    # the same kernels, but torch may pick another blocking for another buffer: format-derived, not bitwise
    np.testing.assert_allclose(out["output_0"], ref, rtol=0, atol=torch_reorder_atol(net, torch.from_numpy(_x())))
    assert runner.describe()["backend"] == "torch"


def test_weights_and_checkpoint(tmp_path):
    from models import mlp

    other = mlp.build()
    g = torch.Generator().manual_seed(1)  # noise, not +0.5: a common offset makes LayerNorm cancel digits
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    torch.save(other.state_dict(), tmp_path / "w.pt")
    torch.save({"model": other.state_dict(), "epoch": 3}, tmp_path / "ckpt.pt")
    with torch.no_grad():
        ref = other(torch.from_numpy(_x())).numpy()
    for weights in ("w.pt", "ckpt.pt"):
        with TorchRunner(f"models/mlp.py:build@{tmp_path / weights}") as runner:
            got = runner.infer({"x": _x()})["output_0"]
            np.testing.assert_allclose(got, ref, rtol=0, atol=torch_reorder_atol(other, torch.from_numpy(_x())))


def test_loaded_module_with_specs_and_output_names():
    from models import mlp
    from mpinfer.specs import parse_tensor_spec

    runner = TorchRunner(
        mlp.build(), input_specs=[parse_tensor_spec("x:batchx64:float32")], output_names=["p"]
    )
    with runner:
        assert list(runner.infer({"x": _x()})) == ["p"]
        with pytest.raises(InvalidInputError, match="Input 'x'.*dtype float64"):
            runner.infer({"x": _x().astype(np.float64)})


def test_module_without_specs_refused():
    from models import mlp

    with pytest.raises(InvalidInputError, match="no input specs"):
        TorchRunner(mlp.build()).activate()


def test_bad_specs(tmp_path):
    with pytest.raises(InvalidInputError, match="file.py:factory"):
        TorchRunner("models/mlp.py").activate()
    with pytest.raises(ModelLoadError, match="no callable factory 'nope'"):
        TorchRunner("models/mlp.py:nope").activate()
    with pytest.raises(ModelLoadError, match="no such file"):
        TorchRunner("models/absent.py:build").activate()
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="weights_only=True"):
        TorchRunner(f"models/mlp.py:build@{tmp_path / 'bad.pt'}").activate()
    torch.save({"nope": torch.zeros(1)}, tmp_path / "wrong.pt")
    with pytest.raises(ModelLoadError, match="do not match the model"):
        TorchRunner(f"models/mlp.py:build@{tmp_path / 'wrong.pt'}").activate()


def test_open_runner_dispatch(tmp_path):
    assert isinstance(open_runner("models/mlp.py:build"), TorchRunner)
    onnx_file = tmp_path / "m.onnx"
    onnx_file.write_bytes(b"x")
    assert isinstance(open_runner(onnx_file), OrtRunner)
    with pytest.raises(ModelLoadError, match="no such file"):
        open_runner(tmp_path / "absent.onnx")
    (tmp_path / "m.txt").write_text("x")
    with pytest.raises(InvalidInputError, match="a '.txt' file"):
        open_runner(tmp_path / "m.txt")
    with pytest.raises(InvalidInputError, match="Numerics"):
        open_runner(onnx_file, numerics="exact")


def test_engine_artifacts_route_to_the_engine_backend(tmp_path):
    """A .engine file goes to mpinfer.engine (a clear error without TensorRT), never to onnxruntime."""
    from mpinfer.errors import MpinferError

    (tmp_path / "m.engine").write_bytes(b"x")
    if find_spec("mpinfer.engine") is None:
        with pytest.raises(BackendUnavailableError, match="mpinfer.engine"):
            open_runner(tmp_path / "m.engine")
        return
    with pytest.raises(MpinferError) as info:
        open_runner(tmp_path / "m.engine").activate()
    assert "TensorRT" in str(info.value) or "engine" in str(info.value).lower()
