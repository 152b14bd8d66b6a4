"""Two published audio models with their front end in the graph, for bench/published.py and bench/verify_cost.py.

* ``pitch``: Spotify's Basic Pitch (``basic-pitch``, ``nmp.onnx``): a constant-Q transform computed by
  convolutions, log-magnitude, then a CNN; three outputs (notes, onsets, pitch contour), all sigmoid
  probabilities in [0, 1] over (frame, bin). Input: (N, 43844, 1) audio.
* ``dnsmos``: Microsoft's DNSMOS P.835 (``speechmos``, ``dnsmos_models/sig_bak_ovr.onnx``): an STFT by
  convolutions, power, log, then a CNN; output (N, 3): speech, background and overall quality on a 1-5 scale.
  Input: (N, 144160) audio at 16 kHz (9.01 s).

Both are fed bench/published.py's formant-synthesised speech, cut into windows of the model's length.
"""

from __future__ import annotations

import numpy as np

PITCH_SAMPLES, DNSMOS_SAMPLES = 43844, 144160
MEMBERS = {
    "pitch": "basic_pitch/saved_models/icassp_2022/nmp.onnx",
    "dnsmos": "speechmos/dnsmos_models/sig_bak_ovr.onnx",
}
PACKAGES = ("basic-pitch==0.4.0", "speechmos==0.0.1.1")


def windows(n: int, length: int, seed: int) -> np.ndarray:
    """``n`` windows of ``length`` samples of synthetic speech (one stream, cut), float32."""
    from published import CHUNK, SR, vad_stream

    audio = vad_stream(n * length / SR + CHUNK / SR * 2, seed).reshape(-1)
    return audio[: n * length].reshape(n, length).astype(np.float32)


def pitch_calibration() -> dict[str, np.ndarray]:
    return {"serving_default_input_2:0": windows(16, PITCH_SAMPLES, 1)[..., None]}


def dnsmos_calibration() -> dict[str, np.ndarray]:
    return {"input_1": windows(8, DNSMOS_SAMPLES, 1)}


def pitch_eval(ref, got) -> dict:  # noqa: ANN001 - onnxruntime sessions
    """Jaccard index of the (frame, bin) cells above 0.5 over the three maps, and the largest difference."""
    x = {"serving_default_input_2:0": windows(8, PITCH_SAMPLES, 2)[..., None]}
    a, b = ref.run(None, x), got.run(None, x)
    sa = np.concatenate([o.reshape(-1) for o in a]) > 0.5
    sb = np.concatenate([o.reshape(-1) for o in b]) > 0.5
    return {
        "agree": float((sa & sb).sum() / max(1, (sa | sb).sum())),
        "cells": int(sa.sum()),
        "max_abs": max(float(np.abs(p - q).max()) for p, q in zip(a, b, strict=True)),
    }


def dnsmos_eval(ref, got) -> dict:  # noqa: ANN001 - onnxruntime sessions
    """Share of the (clip, score) pairs within 0.05 of FP32's (half the 0.1 step a MOS is reported in)."""
    x = {"input_1": windows(4, DNSMOS_SAMPLES, 2)}
    a, b = ref.run(None, x)[0], got.run(None, x)[0]
    d = np.abs(a - b)
    return {"agree": float(np.mean(d < 0.05)), "max_abs": float(d.max()), "fp32_scores": a.round(2).tolist()}
