"""Shared fixtures and marker handling.

``gpu`` tests skip without CUDA, ``tensorrt`` tests skip without the tensorrt package; neither is imported
here at module level.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # so tests can import models/


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False on this machine")
    no_trt = pytest.mark.skip(reason="needs TensorRT: `pip install tensorrt` from NVIDIA's package index, and a GPU")
    has_gpu = None
    has_trt = find_spec("tensorrt") is not None
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not any keyword (a test or param id)
            if has_gpu is None:
                has_gpu = _cuda_available()
            if not has_gpu:
                item.add_marker(no_gpu)
        if item.get_closest_marker("tensorrt") is not None and not has_trt:
            item.add_marker(no_trt)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze the heap the imports left (torch, onnx, the test modules) out of the garbage collector's scans.

    ``release_memory`` (mpinfer.memory) runs ``gc.collect()`` between convert's and compare's phases; in the suite's
    one process every such full collection walks every object that torch, onnx, transformers and ~130 test modules
    keep alive for the whole run (seconds of the suite's time over its few hundred converts). Frozen objects are
    never collected, which costs nothing here: nothing imported goes away before the process ends. Cycles a test
    makes are still collected as they are in a user's process.
    """
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _freeze_what_the_module_left():
    """After each test module (its module fixtures gone, their cycles collected): freeze what is still alive
    (session fixtures, lazy imports such as onnxscript's), for the reason given in ``pytest_collection_finish``."""
    import gc

    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _mpinfer_logger_as_imported():
    """Each test starts with the "mpinfer" logger as imported, whatever order the tests run in.

    The CLI sets that logger's level from -q/-v and adds a stderr handler bound to the stream of the CliRunner
    that ran it; in one test process both outlived their test (a ``-q`` run hid the WARNING a later test reads
    from caplog, seen in random order).
    """
    import logging

    log = logging.getLogger("mpinfer")
    level, handlers = log.level, list(log.handlers)
    yield
    log.setLevel(level)
    log.handlers[:] = handlers


@pytest.fixture
def cli_runner():
    from click.testing import CliRunner

    return CliRunner()


@pytest.fixture
def invoke(cli_runner):
    """Invoke the mpinfer CLI; returns click's Result (``exit_code``, ``output``, ``stderr``)."""
    from mpinfer.cli import main

    def _invoke(*args: str):
        return cli_runner.invoke(main, [str(a) for a in args], catch_exceptions=True)

    return _invoke


def assert_user_error(result, pattern: str | None = None) -> None:
    """A user mistake: exit 1, one ``Error:`` line, no traceback."""
    import re

    out = result.output  # click >= 8.2 mixes stderr into output
    assert result.exit_code == 1, f"exit {result.exit_code}: {out}\n{result.exception!r}"
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, out
    assert "Traceback" not in out
    if pattern:
        assert re.search(pattern, errors[0]), errors[0]


def unwritable_outputs(tmp_path: Path, name: str) -> list[Path]:
    """Output paths nothing can be written to: under a regular file, and (where /proc exists) under /proc."""
    (tmp_path / "plain").write_text("a file, not a folder")
    outs = [tmp_path / "plain" / name]
    if Path("/proc/self").exists():
        outs.append(Path("/proc") / name)
    return outs


@pytest.fixture(scope="session")
def exported_llama(tmp_path_factory):
    """``exported_llama(seed, exporter="dynamo")``: (folder, ExportResult) of the tiny Llama of tests/kv_models.py
    with that seed, exported with its KV cache once per session (torch.export takes ~15 s of CPU a model; the
    TorchScript exporter ~1 s, for a second decoder that only needs other weights); read-only for tests."""
    done: dict[tuple[int, str], tuple[Path, object]] = {}

    def get(seed: int = 0, exporter: str = "dynamo"):
        if (seed, exporter) not in done:
            from mpinfer.export import ExportConfig, export_onnx
            from tests.kv_models import llama_folder

            tmp = tmp_path_factory.mktemp(f"llama{seed}{exporter}")
            folder = llama_folder(tmp / "llama", seed=seed)
            done[seed, exporter] = folder, export_onnx(ExportConfig(source=str(folder), output=tmp / "llama.onnx",
                                                                   exporter=exporter))
        return done[seed, exporter]

    return get
