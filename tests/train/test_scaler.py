"""The FP16 loss-scaling path on CPU (torch >= 2.3 ships a CPU GradScaler) and on CUDA (marked gpu)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpinfer.train import AmpConfig, AmpTrainer, LossScaleCollapseError
from mpinfer.train.scaling import LossScaler
from tests.tolerances import reorder_atol
from tests.train.helpers import amplified_mlp, tiny_cnn


def _linear_and_grads(scaler: LossScaler):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    scaler.backward(model(x).pow(2).mean())
    return model, opt, x


def test_inf_gradient_skips_step_halves_scale_and_counts_it():
    scaler = LossScaler("cpu", enabled=True, init_scale=1024.0, min_scale=1.0)
    model, opt, _ = _linear_and_grads(scaler)
    w0 = model.weight.detach().clone()
    model.weight.grad[0, 0] = float("inf")
    outcome = scaler.step(opt, step=0)
    assert not outcome.applied and outcome.scale == 512.0 and scaler.skipped == 1
    assert torch.equal(model.weight, w0)


def test_clean_step_applies_unscaled_gradients():
    scaler = LossScaler("cpu", enabled=True, init_scale=1024.0, min_scale=1.0)
    model, opt, x = _linear_and_grads(scaler)
    ref = nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    ref(x).pow(2).mean().backward()
    assert torch.allclose(model.weight.grad, ref.weight.grad * 1024.0)  # scaled before the step
    outcome = scaler.step(opt, step=0)
    assert outcome.applied and outcome.scale == 1024.0 and scaler.skipped == 0
    # the step w - 0.1 g: torch's fused add against the two roundings here, each within 3 half-ulps
    magnitude = float((ref.weight.abs() + 0.1 * ref.weight.grad.abs()).max().detach())
    stepped = ref.weight - 0.1 * ref.weight.grad
    assert torch.allclose(model.weight, stepped, rtol=0, atol=reorder_atol(n=2, magnitude=magnitude))


def test_scale_collapse_stops_with_scale_step_and_hint():
    scaler = LossScaler("cpu", enabled=True, init_scale=4.0, min_scale=1.0)
    for step in range(3):
        model, opt, _ = _linear_and_grads(scaler)
        model.bias.grad[0] = float("nan")
        if step < 2:
            scaler.step(opt, step=step)
    with pytest.raises(LossScaleCollapseError, match=r"step 2: received scale 0.5 .*--precision bf16.*FP32"):
        scaler.step(opt, step=2)


def test_disabled_scaler_is_a_plain_step():
    scaler = LossScaler("cpu", enabled=False, init_scale=1024.0, min_scale=1.0)
    model, opt, _ = _linear_and_grads(scaler)
    w0 = model.weight.detach().clone()
    assert scaler.step(opt, step=0).applied and scaler.scale == 1.0 and scaler.state_dict() == {}
    assert not torch.equal(model.weight, w0)


def test_trainer_fp16_collapse_on_overflowing_model_writes_overflow_report(tmp_path, digits_small, caplog):
    train, evl = digits_small
    cfg = AmpConfig(
        amplified_mlp,
        tmp_path / "run",
        data=train,
        eval_data=evl,
        precision="fp16",
        device="cpu",
        epochs=1,
        batch_size=32,
        init_scale=8.0,
        min_loss_scale=1.0,
        overflow_report=True,
        overflow_every=1,
        quiet=True,
    )
    with pytest.raises(LossScaleCollapseError, match=r"optimizer step 3: received scale 0.5 after 4 skipped"):
        AmpTrainer(cfg).fit()
    assert "fp16 on CPU" in caplog.text
    import json

    report = json.loads((tmp_path / "run" / "overflow.json").read_text())
    assert any(
        e["module"] == "3" and e["kind"] == "activation" and e["overflow_frac"] > 0 for e in report["modules"]
    )
    assert not (tmp_path / "run" / "last.pt").exists()


def test_fp16_clipping_sees_unscaled_gradients(tmp_path, digits_small, monkeypatch):
    """Unscale before clipping: clip_grad_norm_ sees the FP32 run's gradient norm, not 1024 times it."""
    train, evl = digits_small
    real_clip = torch.nn.utils.clip_grad_norm_
    norms: dict[str, list[float]] = {"fp16": [], "fp32": []}
    for precision in norms:

        def spy(params, max_norm, *args, _seen=norms[precision], **kwargs):
            total = real_clip(params, max_norm, *args, **kwargs)
            _seen.append(float(total))
            return total

        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
        cfg = AmpConfig(
            tiny_cnn,
            tmp_path / precision,
            data=train,
            eval_data=evl,
            precision=precision,
            device="cpu",
            epochs=1,
            batch_size=64,
            clip_grad_norm=0.5,
            init_scale=2.0**10,
            quiet=True,
        )
        assert AmpTrainer(cfg).fit().summary["skipped_steps"] == 0
    assert len(norms["fp16"]) == len(norms["fp32"]) == 4
    assert norms["fp16"][0] == pytest.approx(norms["fp32"][0], rel=0.05)


@pytest.mark.gpu
def test_fp16_cuda_training_reaches_accuracy(tmp_path):
    cfg = AmpConfig(
        "models/digits_cnn.py:build", tmp_path / "run", precision="fp16", device="cuda", epochs=3, quiet=True
    )
    result = AmpTrainer(cfg).fit()
    assert result.summary["eval_accuracy"] >= 0.9
    assert result.summary["peak_memory_kind"] == "cuda_max_memory_allocated"
    ckpt = torch.load(result.last, weights_only=True)
    assert ckpt["amp_scaler"]["scale"] == result.summary["loss_scale"]


@pytest.mark.gpu
def test_fp16_cuda_collapse_on_overflowing_model(tmp_path, digits_small):
    train, evl = digits_small
    cfg = AmpConfig(
        amplified_mlp,
        tmp_path / "run",
        data=train,
        eval_data=evl,
        precision="fp16",
        device="cuda",
        epochs=1,
        batch_size=32,
        init_scale=8.0,
        quiet=True,
    )
    with pytest.raises(LossScaleCollapseError, match="scale 0.5"):
        AmpTrainer(cfg).fit()
