from __future__ import annotations

import pytest

from tests.compare.helpers import broken_fixture


@pytest.fixture(scope="session")
def mlp_files(tmp_path_factory):
    """Exported MLP, FP16 copy, LayerNorm-forced-FP16 copy (+ plan), normal and overflowing data."""
    return broken_fixture(tmp_path_factory.mktemp("mlp"))
