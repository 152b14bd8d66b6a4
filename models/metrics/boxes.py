"""Box agreement of a detector: the share of FP32's confident boxes the candidate finds again at IoU >= 0.5.

    mpinfer convert detector.onnx --calibration images/ --image-preprocess size=640x640 \
        --metric boxes=models/metrics/boxes.py:box_agreement --budget "boxes_min>=0.95" -o detector.fp16.onnx

Two output layouts are read:

* ``BOXES`` ``[N, K, 4]`` (x1, y1, x2, y2) with ``SCORES`` ``[N, K]`` or ``[N, K, classes]`` (the best class);
* one raw YOLO-style head ``[N, K, 4 + 1 + classes]`` (cx, cy, w, h, objectness, class scores) or
  ``[N, K, 4 + classes]`` (``OBJECTNESS = False``), when ``BOXES`` is None: the first output.

A box counts when its score is above SCORE (FP32's boxes define what must be found; the candidate's are matched
greedily, best IoU first, each used once, same class). Per sample: matched / FP32's box count (1 when FP32 has
none and the candidate has none either; 0 when only the candidate has some). Non-maximum suppression is left out
on purpose: it is the same code on both sides, and the boxes before it are what the numerics change.
"""

from __future__ import annotations

import numpy as np

BOXES: str | None = None
SCORES: str | None = None
OBJECTNESS = True
SCORE = 0.5
IOU = 0.5
# Boxes per sample kept (the most confident): bounds the IoU matrix of a dense head.
MAX_BOXES = 300


def _detections(outputs):
    """Per sample: (boxes [k, 4] as x1y1x2y2, classes [k]) above SCORE, most confident first."""
    if BOXES is not None:
        boxes = np.asarray(outputs[BOXES], np.float64)
        scores = np.asarray(outputs[SCORES], np.float64)
        cls = scores.argmax(-1) if scores.ndim == 3 else np.zeros(scores.shape, np.int64)
        conf = scores.max(-1) if scores.ndim == 3 else scores
    else:
        head = np.asarray(next(iter(outputs.values())), np.float64)
        xy, wh = head[..., :2], head[..., 2:4]
        boxes = np.concatenate([xy - wh / 2, xy + wh / 2], axis=-1)
        probs = head[..., 5:] * head[..., 4:5] if OBJECTNESS else head[..., 4:]
        cls, conf = probs.argmax(-1), probs.max(-1)
    out = []
    for b, k, s in zip(boxes, cls, conf):
        keep = np.flatnonzero(s > SCORE)
        keep = keep[np.argsort(-s[keep], kind="stable")][:MAX_BOXES]
        out.append((b[keep], k[keep]))
    return out


def iou(a, b):
    """IoU matrix of boxes ``a`` [m, 4] and ``b`` [n, 4] (x1, y1, x2, y2)."""
    lo = np.maximum(a[:, None, :2], b[None, :, :2])
    hi = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=-1)
    area = lambda x: np.prod(np.clip(x[:, 2:] - x[:, :2], 0, None), axis=-1)  # noqa: E731
    union = area(a)[:, None] + area(b)[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def box_agreement(baseline, candidate, inputs):
    """Per sample: the share of FP32's boxes the candidate matches (same class, IoU >= IOU)."""
    return agreement(_detections(baseline), _detections(candidate))


def agreement(reference, candidate):
    """Per sample: matched / reference boxes, given per sample (boxes [k, 4] x1y1x2y2, classes [k]) of each."""
    rates = []
    for (rb, rk), (cb, ck) in zip(reference, candidate):
        if not len(rb):
            rates.append(1.0 if not len(cb) else 0.0)
            continue
        m = iou(rb, cb) * (rk[:, None] == ck[None, :]) if len(cb) else np.zeros((len(rb), 0))
        used, hits = set(), 0
        for i in range(len(rb)):
            order = np.argsort(-m[i], kind="stable") if m.shape[1] else []
            j = next((int(j) for j in order if m[i, j] >= IOU and int(j) not in used), None)
            if j is not None:
                used.add(j)
                hits += 1
        rates.append(hits / len(rb))
    return np.asarray(rates, np.float64)
