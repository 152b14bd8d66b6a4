"""Fixtures for the numerics tests (graph builders live in numerics_graphs.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.precision.numerics_graphs import export_module


@pytest.fixture(scope="session")
def exported():
    """name -> (ModelProto, feeds) for every example model, exported once."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = export_module(name)
        return cache[name]

    return get


@pytest.fixture
def rng():
    return np.random.default_rng(0)
