"""A pytest plugin that runs the suite on another ONNX Runtime kernel path: ``-p tests.kernel_paths --ort-threads N``.

ONNX Runtime's CPU kernels (MLAS) split a MatMul, a Conv or a reduction across the session's intra-op threads,
so the thread count decides the order float32 sums are added in, as the CPU's features do (AVX-512 or AVX2
kernels). A test that passes only with the thread count and kernels of the machine it was written on asserts
float noise. With ``--ort-threads N`` every ``onnxruntime.InferenceSession`` the suite creates (mpinfer's and
the tests' own) runs with ``N`` intra-op threads whatever its ``SessionOptions`` asked for; spinning is turned
off so that more threads than cores do not starve each other. ``make test-kernels`` runs the suite this way and
with numpy, OpenBLAS and torch held to narrower SIMD (their own environment variables); see
bench/RESULTS.md, "Test-suite stability".

Nothing in mpinfer reads this: it is a test tool, loaded only when named with ``-p``.
"""

from __future__ import annotations

from typing import Any

import pytest

# Tests that assert the intra-op thread count mpinfer itself asks for: --ort-threads overrides exactly that.
ASSERTS_THREAD_COUNT = ("tests/precision/test_emulate.py::test_onnxruntime_step_sessions_stay_small",)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--ort-threads", type=int, default=None, metavar="N",
        help="run every ONNX Runtime session with N intra-op threads (another kernel split; tests/kernel_paths.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    threads = config.getoption("--ort-threads")
    if threads is None:
        return
    if threads < 1:
        raise pytest.UsageError(f"--ort-threads: received {threads}, expected a thread count >= 1.")
    from onnxruntime.capi import onnxruntime_inference_collection as collection

    cls = collection.InferenceSession
    original = cls.__init__

    def __init__(self: Any, path_or_bytes: Any, sess_options: Any = None, *args: Any, **kwargs: Any) -> None:
        import onnxruntime as ort

        so = sess_options if sess_options is not None else ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        original(self, path_or_bytes, so, *args, **kwargs)

    cls.__init__ = __init__
    config.add_cleanup(lambda: setattr(cls, "__init__", original))


def pytest_report_header(config: pytest.Config) -> str | None:
    threads = config.getoption("--ort-threads")
    return None if threads is None else f"kernel_paths: every ONNX Runtime session runs {threads} intra-op thread(s)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--ort-threads") is None:
        return
    skip = pytest.mark.skip(reason="asserts mpinfer's own intra-op thread count, which --ort-threads overrides")
    for item in items:
        if item.nodeid in ASSERTS_THREAD_COUNT:
            item.add_marker(skip)
