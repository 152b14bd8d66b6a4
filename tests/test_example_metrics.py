"""The example metrics users copy (models/metrics/): each loaded as --metric loads it, on hand-made outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mpinfer.metrics import USER_OUTPUT, ModelAccumulator
from mpinfer.usermetric import parse_metric

METRICS = Path(__file__).resolve().parents[1] / "models" / "metrics"


def _figures(spec, baseline, candidate, inputs, **settings):
    metric = parse_metric(f"m={METRICS / spec}")
    saved = {k: metric.function.__globals__[k] for k in settings}
    metric.function.__globals__.update(settings)  # the constants a user edits at the top of the file
    acc = ModelAccumulator(list(baseline), user_metrics=[metric])
    try:
        acc.update(baseline, candidate, None, inputs=inputs)
    finally:
        metric.function.__globals__.update(saved)
    return acc.finalize()[USER_OUTPUT]


def test_box_agreement_matches_boxes_at_iou_half_of_the_same_class():
    boxes = np.array([[[0, 0, 10, 10], [20, 20, 30, 30], [50, 50, 60, 60]]], np.float32)
    scores = np.array([[[0.9, 0.1], [0.1, 0.8], [0.2, 0.3]]], np.float32)  # the third is below 0.5
    moved = boxes.copy()
    moved[0, 0] += 4  # IoU 36/164: lost
    moved[0, 1] += 1  # IoU 81/119: found
    names = {"BOXES": "boxes", "SCORES": "scores"}
    base = {"boxes": boxes, "scores": scores}
    same = _figures("boxes.py:box_agreement", base, base, {}, **names)
    got = _figures("boxes.py:box_agreement", base, {"boxes": moved, "scores": scores}, {}, **names)
    flipped = _figures("boxes.py:box_agreement", base, {"boxes": boxes, "scores": scores[..., ::-1]}, {}, **names)
    assert same["m"] == 1.0 and got["m"] == pytest.approx(0.5) and flipped["m"] == 0.0  # a box of another class


def test_box_agreement_reads_a_yolo_head():
    head = np.zeros((2, 3, 4 + 1 + 2), np.float32)
    head[:, 0] = [5, 5, 10, 10, 0.9, 1, 0]  # one confident box per sample, class 0
    cand = head.copy()
    cand[1, 0, 4] = 0.1  # the second sample's box drops below the threshold
    got = _figures("boxes.py:box_agreement", {"out": head}, {"out": cand}, {})
    assert (got["m_min"], got["m_max"]) == (0.0, 1.0)


def test_decision_agreement_counts_elements_on_the_same_side_of_the_threshold():
    b = np.array([[0.1, 0.6, 0.9, 0.4], [0.7, 0.7, 0.2, 0.2]], np.float32)
    c = np.array([[0.1, 0.4, 0.9, 0.4], [0.7, 0.7, 0.2, 0.2]], np.float32)
    got = _figures("decisions.py:decision_agreement", {"notes": b}, {"notes": c}, {})
    assert (got["m_min"], got["m_max"], got["m"]) == (0.75, 1.0, 0.875)


def test_character_error_rate_of_greedy_ctc_decodes():
    def frames(*labels):  # one-hot scores [T, C=4] (blank 0)
        return np.eye(4, dtype=np.float32)[list(labels)]

    b = np.stack([frames(1, 1, 0, 2, 3), frames(1, 2, 3, 0, 0)])  # "123" and "123"
    c = np.stack([frames(1, 0, 1, 2, 3), frames(1, 2, 0, 0, 0)])  # "1123" (one insertion), "12" (one deletion)
    got = _figures("cer.py:character_error_rate", {"logits": b}, {"logits": c}, {})
    assert (got["m_min"], got["m_max"]) == (pytest.approx(1 / 3), pytest.approx(1 / 3))
    assert _figures("cer.py:character_error_rate", {"logits": b}, {"logits": b}, {})["m_max"] == 0.0


def test_accuracy_drop_from_labels():
    b = np.eye(3, dtype=np.float32)[[0, 1, 2, 0]]
    c = np.eye(3, dtype=np.float32)[[0, 2, 2, 1]]
    labels = np.array([0, 1, 1, 1])  # FP32 right on 0, 1; the candidate on 0, 3
    got = _figures("label_accuracy.py:accuracy_drop", {"y": b}, {"y": c}, {"x": b, "_labels": labels})
    assert got["m"] == 0.0 and (got["m_min"], got["m_max"]) == (-1.0, 1.0)
