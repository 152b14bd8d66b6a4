"""Label-accuracy drop: how many samples the candidate gets wrong that the FP32 model got right.

    mpinfer convert model.onnx --calibration data.npz --metric drop=models/metrics/label_accuracy.py:accuracy_drop \
        --budget "drop<=0.005" -o model.fp16.onnx

``inputs["_labels"]`` holds the batch's labels (an .npz with a ``_labels`` array); the class scores are the last
axis of OUTPUT (None: the model's first output). Per sample: 1 where only FP32 is right, -1 where only the
candidate is, 0 where both agree with the label or both miss it; the mean (the figure ``drop``) is the baseline's
accuracy minus the candidate's, the built-in ``accuracy_drop`` as a metric of your own to edit (top-k, a
different output, a class map).
"""

from __future__ import annotations

import numpy as np

# The output holding class scores on its last axis (None: the first output).
OUTPUT = None


def accuracy_drop(baseline, candidate, inputs):
    """Per sample: baseline correct minus candidate correct (1, 0 or -1)."""
    if "_labels" not in inputs:
        raise ValueError("accuracy_drop needs labels: calibration/compare data with a _labels array")
    name = OUTPUT or next(iter(baseline))
    labels = np.asarray(inputs["_labels"]).reshape(-1)
    b = np.asarray(baseline[name]).reshape(len(labels), -1).argmax(axis=1)
    c = np.asarray(candidate[name]).reshape(len(labels), -1).argmax(axis=1)
    return (b == labels).astype(np.float64) - (c == labels).astype(np.float64)
