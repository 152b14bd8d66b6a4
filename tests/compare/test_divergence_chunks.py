"""How the per-layer divergence packs intermediate tensors into chunks (one session of each model per chunk)."""

from __future__ import annotations

import logging
import re

import numpy as np
from onnx import helper

import mpinfer.compare.divergence as dv
from tests.budget import set_slice
from tests.precision.graphs import fvi, init, make

MIB = 2**20


def _chain(scale: float, steps: int = 6) -> object:
    """x [N, 32, 32, 32] -> (Mul by a constant, Tanh) x steps: no weights to speak of, 2 MiB tensors a batch of 16."""
    nodes, inits, prev = [], [], "x"
    for i in range(steps):
        inits.append(init(f"w{i}", np.float32(scale * (1.0 + i / 10))))
        nodes.append(helper.make_node("Mul", [prev, f"w{i}"], [f"m{i}"], name=f"mul{i}"))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"t{i}"], name=f"tanh{i}"))
        prev = f"t{i}"
    return make(nodes, [fvi("x", ["N", 32, 32, 32])], [fvi(prev, ["N", 32, 32, 32])], inits)


def test_chunk_limit_takes_the_largest_of_the_weight_share_the_largest_tensors_and_the_floor(monkeypatch):
    """A model with next to no weights and 75 MB feature maps (the 8-layer CNN) got the 16 MiB floor, so each map was
    a chunk of its own; four of its largest tensors fit a chunk now, never past the budget's divergence slice."""
    set_slice(monkeypatch, "divergence_chunk", 256 * MIB)
    model = _chain(0.9)
    assert dv.chunk_limit(model) == dv.MIN_CHUNK_BYTES
    assert dv.chunk_limit(model, 2 * MIB) == dv.MIN_CHUNK_BYTES  # (four of them: 8 MiB, under the floor)
    assert dv.chunk_limit(model, 10 * MIB) == dv.ACTIVATION_CHUNK * 10 * MIB
    assert dv.chunk_limit(model, 75 * 10**6) == 256 * MIB  # (300 MB: the slice)


def test_tensors_pack_four_of_the_largest_to_a_chunk_and_measure_as_one_by_one(monkeypatch, caplog):
    """Twelve 2 MiB tensors with a 3 MiB floor: one chunk each by the weight rule alone, three chunks of four by the
    largest tensor; a Mul/Tanh chain has no fusion to change with the outputs a session exposes, so every tensor's
    error and max_abs come out the same both ways."""
    set_slice(monkeypatch, "divergence_chunk", 256 * MIB)
    monkeypatch.setattr(dv, "MIN_CHUNK_BYTES", 3 * MIB)
    base, cand = _chain(0.9), _chain(0.9 * (1 + 2**-11))  # (the candidate's constants one FP16 step off)
    names = [o for n in base.graph.node for o in n.output]
    batches = [{"x": np.random.default_rng(s).standard_normal((16, 32, 32, 32)).astype(np.float32)} for s in (0, 1)]

    def measured() -> tuple[int, dict]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mpinfer.compare.divergence"):
            accs = dv.measure_tensors(base, cand, names, batches, ["CPUExecutionProvider"])
        found = re.search(r"in (\d+) chunk", caplog.text)
        assert found is not None
        return int(found.group(1)), {n: (a.error, a.max_abs) for n, a in accs.items()}

    chunks, figures = measured()
    monkeypatch.setattr(dv, "ACTIVATION_CHUNK", 0)  # (the weight rule alone, as before)
    one_by_one, before = measured()
    assert (chunks, one_by_one) == (3, 12)
    assert sorted(figures) == sorted(names) and all(figures[n][0] > 0 for n in names)
    assert figures == before
