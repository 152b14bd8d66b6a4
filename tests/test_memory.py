"""The one memory budget: --memory-limit parsing, its default, and the slices derived from it."""

from __future__ import annotations

import pytest

from mpinfer import memory
from mpinfer.errors import InvalidInputError
from mpinfer.memory import SHARES, MemoryBudget, current_budget, parse_size, use_budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GB", 8 * 10**9), ("8G", 8 * 10**9), ("6GiB", 6 * 2**30), ("512MiB", 512 * 2**20), ("1.5 GiB", 3 * 2**29),
     ("2048000000", 2_048_000_000), (3 * 2**30, 3 * 2**30)],
)
def test_memory_limit_sizes(text, expected):
    budget = MemoryBudget.from_setting(text)
    assert budget.limit == expected and "--memory-limit" in budget.source


@pytest.mark.parametrize(
    ("text", "words"),
    [("lots", "a number with an optional unit"), ("-1GB", "a number"), ("0", "a positive size"),
     ("100MB", "at least 256 MiB"), ("0%", r"a share in \(0, 100\]%"), ("150%", r"a share in \(0, 100\]%"),
     ("x%", "a share")],
)
def test_bad_memory_limits_are_user_errors(text, words):
    with pytest.raises(InvalidInputError, match=words):
        MemoryBudget.from_setting(text)


def test_a_share_of_the_available_memory(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda: 20 * 10**9)
    budget = MemoryBudget.from_setting("40%")
    assert budget.limit == 8 * 10**9 and "40% of 20.0 GB available" in budget.source


def test_default_is_half_the_available_memory_capped(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda: 10 * 10**9)
    assert MemoryBudget.from_setting(None).limit == 5 * 10**9
    monkeypatch.setattr(memory, "available_memory", lambda: 100 * 10**9)
    assert MemoryBudget.from_setting(None).limit == memory.DEFAULT_MAX
    monkeypatch.setattr(memory, "available_memory", lambda: None)
    assert MemoryBudget.from_setting(None).limit == memory.FALLBACK_LIMIT


def test_every_slice_scales_with_the_limit():
    small, big = MemoryBudget(48 * 10**7), MemoryBudget(4 * 48 * 10**7)  # divisible by every share
    for name in SHARES:
        assert big.slice(name) == 4 * small.slice(name), name
        assert 0 < small.slice(name) < small.limit
    assert big.search == big.limit // SHARES["search"] and big.calibration_call == big.slice("calibration_call")


def test_use_budget_activates_and_restores(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda: 10 * 10**9)
    with use_budget("1GB") as outer:
        assert current_budget() == outer and current_budget().limit == 10**9
        with use_budget(MemoryBudget(2 * 10**9)):
            assert current_budget().limit == 2 * 10**9
        assert current_budget().limit == 10**9
    assert current_budget().limit == 5 * 10**9


def test_engine_sizes_share_the_parser():
    from mpinfer.engine import parse_size as engine_parse_size

    assert engine_parse_size is parse_size


def test_memory_limit_on_the_cli(invoke, tmp_path):
    """convert and compare take --memory-limit; a bad one is a user error before any work. build-engine sizes
    nothing from it (its host memory is TensorRT's or ONNX Runtime's builder's): not an option there."""
    from mpinfer.engine import BuildConfig
    from tests.conftest import assert_user_error
    from tests.precision.graphs import mlp, save

    src = save(mlp(), tmp_path / "m.onnx")
    for args in (("convert", src, "-o", tmp_path / "o.onnx"), ("compare", src, src)):
        assert_user_error(invoke(*args, "--memory-limit", "lots"), "--memory-limit")
    r = invoke("build-engine", src, "--backend", "onnxruntime", "-o", tmp_path / "m.ort", "--memory-limit", "1GB")
    assert r.exit_code == 2 and "No such option '--memory-limit'" in r.output
    with pytest.raises(InvalidInputError, match=r"unknown key\(s\) \['memory_limit'\].*--workspace"):
        BuildConfig.from_mapping({"model": src, "memory_limit": "8GB"})
    assert not (tmp_path / "o.onnx").exists() and not (tmp_path / "m.ort").exists()
    r = invoke("convert", src, "--calibration", "none", "-o", tmp_path / "o.onnx", "--memory-limit", "1GB")
    assert r.exit_code == 0, r.output


def test_a_run_keeps_what_was_alive_out_of_the_collector_and_collects_its_own_cycles():
    """budgeted runs collect, then freeze the heap they start with; their own cycles are collected on the way out."""
    import gc
    import weakref

    class Node:
        pass

    seen = {}

    @memory.budgeted
    def run(config):
        seen["frozen"] = gc.get_freeze_count()
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made by the run
        seen["cycle"] = weakref.ref(a)
        return 1

    gc.collect()
    gc.unfreeze()  # (the suite freezes its heap: conftest.py)
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle the caller left: collected when the run starts, not frozen with it
        before = weakref.ref(a)
        del a, b
        seen["before"] = None

        @memory.budgeted
        def look(config):
            seen["before"] = before()
            return run(config)

        assert look(object()) == 1
        assert seen["before"] is None
        assert seen["frozen"] > 0 and gc.get_freeze_count() == 0 and seen["cycle"]() is None
        gc.freeze()  # a caller that froze its heap itself: left as it is
        frozen = gc.get_freeze_count()
        run(object())
        assert seen["frozen"] <= frozen and gc.get_freeze_count() > 0  # (not frozen again nor unfrozen)
    finally:
        gc.collect()
        gc.freeze()
