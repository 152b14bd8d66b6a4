"""Fixtures for the AMP trainer tests: small digits subsets and tiny models, built in the test."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def digits_small():
    """(train, eval) TensorDatasets: 256 training and 128 test digits."""
    import torch
    from torch.utils.data import TensorDataset

    from mpinfer.train.data import digits_arrays

    xtr, ytr, xte, yte = digits_arrays()
    return (
        TensorDataset(torch.from_numpy(xtr[:256]), torch.from_numpy(ytr[:256])),
        TensorDataset(torch.from_numpy(xte[:128]), torch.from_numpy(yte[:128])),
    )


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread: on the shared 2-core CI box, two threads per process oversubscribe the cores and
    run these small models several times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
