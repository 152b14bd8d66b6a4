"""Thresholded decision agreement for multi-label maps (sigmoid probabilities: notes, tags, masks).

    mpinfer convert transcriber.onnx --calibration audio.npz \
        --metric notes=models/metrics/decisions.py:decision_agreement --budget "notes_min>=0.999" -o t.fp16.onnx

Per sample: the share of elements, over OUTPUTS (None: every float output), where FP32 and the candidate make
the same decision ``value > THRESHOLD``. ``notes_min>=0.999`` asks every sample to keep 99.9% of its decisions:
an element that sits on the threshold may flip, a note that moves from 0.9 to 0.4 may not.
"""

from __future__ import annotations

import numpy as np

THRESHOLD = 0.5
OUTPUTS: tuple[str, ...] | None = None


def decision_agreement(baseline, candidate, inputs):
    """Per sample: the share of elements on the same side of THRESHOLD in both models."""
    names = OUTPUTS or tuple(n for n, v in baseline.items() if np.asarray(v).dtype.kind == "f")
    same = total = 0
    for name in names:
        b, c = np.asarray(baseline[name]), np.asarray(candidate[name])
        rows = len(b)
        agree = (b > THRESHOLD) == (c > THRESHOLD)
        same = same + agree.reshape(rows, -1).sum(axis=1)
        total = total + agree.reshape(rows, -1).shape[1]
    return same / max(total, 1)
