from __future__ import annotations

import pytest

from tests.compare.helpers import broken_fixture


@pytest.fixture(scope="session")
def report_result(tmp_path_factory):
    """A real comparison (healthy FP16 + broken LayerNorm candidate, with latency) and its report folder."""
    from mpinfer.compare import CompareConfig, compare_models
    from mpinfer.report import write_report

    tmp = tmp_path_factory.mktemp("report")
    files = broken_fixture(tmp)
    result = compare_models(
        CompareConfig(
            str(files["base"]),
            (str(files["fp16"]), str(files["broken"])),
            data=str(files["big"]),
            checks="cosine>=0.9999,top1>=0.99",
            latency=True,
            batch_sizes=(1, 8),
            iterations=5,
            warmup=1,
            show_progress=False,
        )
    )
    paths = write_report(result, tmp / "rep")
    return {"result": result, "paths": paths, "files": files, "dir": tmp}
