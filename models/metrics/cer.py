"""Character error rate of a CTC recognizer (OCR, speech): the candidate's text against the FP32 model's.

    mpinfer convert crnn.onnx --calibration lines.npz --metric cer=models/metrics/cer.py:character_error_rate \
        --budget "cer<=0.002,cer_max<=0.05" -o crnn.fp16.onnx

OUTPUT (None: the first output) holds per-frame class scores ``[N, T, C]`` (``TIME_MAJOR``: ``[T, N, C]``) with
the CTC blank at index BLANK. Both are decoded greedily (best class per frame, repeats merged, blanks dropped) and
the per-sample figure is the edit distance divided by the FP32 text's length (an empty FP32 text: 0 when the
candidate's is empty too, else 1).
"""

from __future__ import annotations

import numpy as np

OUTPUT = None
BLANK = 0
TIME_MAJOR = False


def greedy_ctc(scores):
    """Per sample, the label sequence of a greedy CTC decode of ``[N, T, C]`` scores."""
    best = np.asarray(scores).argmax(axis=-1)
    out = []
    for row in best:
        keep = np.ones(len(row), bool)
        keep[1:] = row[1:] != row[:-1]
        out.append([int(k) for k in row[keep] if k != BLANK])
    return out


def edit_distance(a, b):
    """Levenshtein distance between two sequences."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def character_error_rate(baseline, candidate, inputs):
    """Per sample: edit distance of the candidate's decode to the baseline's, over the baseline's length."""
    name = OUTPUT or next(iter(baseline))
    b, c = np.asarray(baseline[name]), np.asarray(candidate[name])
    if TIME_MAJOR:
        b, c = b.transpose(1, 0, 2), c.transpose(1, 0, 2)
    rates = []
    for ref, hyp in zip(greedy_ctc(b), greedy_ctc(c)):
        rates.append(edit_distance(ref, hyp) / len(ref) if ref else float(bool(hyp)))
    return np.asarray(rates, np.float64)
