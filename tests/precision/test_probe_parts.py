"""Probes split into parts of ``PROBE_GROUPS`` groups: the same errors as one probe, each part only the FP32 nodes its
groups read."""

from __future__ import annotations

import numpy as np
import pytest

from mpinfer.precision.numerics import probe
from mpinfer.precision.numerics.probe import build_probe, probe_errors, strict_probe_errors
from mpinfer.specs import Precision
from tests.precision.test_probe import _groups as ort_groups
from tests.precision.test_probe import two_outputs
from tests.precision.test_strict_probe import _batches, conv_net
from tests.precision.test_strict_probe import _groups as strict_groups


@pytest.mark.parametrize("size", [1, 2])
def test_strict_probe_parts_give_the_errors_of_one_probe(monkeypatch, size):
    model = conv_net()
    info, groups = strict_groups(model)
    assert len(groups) > size
    batches = _batches()
    whole = strict_probe_errors(info, groups, batches, Precision.FP16).errors
    monkeypatch.setattr(probe, "STRICT_PROBE_GROUPS", size)
    parts = strict_probe_errors(info, groups, batches, Precision.FP16).errors
    assert parts == whole  # (the same nodes on the same tensors: bit for bit)


def test_ort_probe_parts_give_the_errors_of_one_probe(monkeypatch):
    model = two_outputs()
    info, groups = ort_groups(model)
    assert len(groups) == 2
    batches = [{"x": np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)}]
    whole = probe_errors(info, groups, batches, Precision.FP16).errors
    monkeypatch.setattr(probe, "PROBE_GROUPS", 1)
    assert probe_errors(info, groups, batches, Precision.FP16).errors == whole


def test_a_probe_of_the_first_group_holds_only_the_fp32_nodes_it_reads():
    model = conv_net()
    info, groups = strict_groups(model)
    first = groups[0]
    built = build_probe(info, [first], Precision.FP16, exact=True)
    assert built is not None
    kept = {n.name for n in built[0].graph.node if not n.name.startswith(probe.PREFIX)}
    assert first.anchor == "conv1" and "conv1" in kept  # (its FP32 output: the reference its copy is compared with)
    assert {"mm3", "tanh3"}.isdisjoint(kept)  # (downstream of the first group: nothing it reads)
