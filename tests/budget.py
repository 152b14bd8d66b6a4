"""Tests set one slice of the memory budget (:mod:`mpinfer.memory`) to a few bytes."""

from __future__ import annotations

from typing import Any


def set_slice(monkeypatch: Any, name: str, nbytes: int) -> None:
    """For the rest of the test the default budget's slice ``name`` is ``nbytes`` (the limit scaled to match)."""
    from mpinfer import memory

    budget = memory.MemoryBudget(nbytes * memory.SHARES[name], "test")
    assert budget.slice(name) == nbytes
    monkeypatch.setattr(memory, "default_budget", lambda: budget)
