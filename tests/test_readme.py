"""Every command in the README's quick tour runs (STYLE: every command shown in the README runs in CI)."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.conftest import ROOT


def quick_tour_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- quick-tour:start -->", 1)[1].split("<!-- quick-tour:end -->", 1)[0]
    body = block.split("```bash", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*", " ", body)
    commands = []
    for line in joined.splitlines():
        line = line.split("  #", 1)[0].strip()
        if line:
            commands.append(shlex.split(line))
    return commands


def test_quick_tour_block_is_found():
    cmds = quick_tour_commands()
    assert [c[1] for c in cmds][:4] == ["doctor", "train", "export", "convert"]
    assert all(c[0] == "mpinfer" for c in cmds)


def test_quick_tour_runs(tmp_path, monkeypatch, cli_runner):
    from mpinfer.cli import main

    for name in ("models", "calibration"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    for cmd in quick_tour_commands():
        quiet = [] if cmd[1] == "compare" else ["-q"]  # compare's console shows "Plan said / measured"
        result = cli_runner.invoke(main, [*quiet, *cmd[1:]])
        assert result.exit_code == 0, f"{shlex.join(cmd)}\n{result.output}\n{result.exception!r}"
        assert "not comparable" not in result.output, f"{shlex.join(cmd)}\n{result.output}"
    assert (tmp_path / "out" / "digits.fp16.plan.json").is_file()
    assert (tmp_path / "out" / "report" / "index.html").is_file()
    assert (tmp_path / "out" / "report.md").read_text().strip()
    _assert_tour_compare_reproduces_the_plan(tmp_path / "out")
    _assert_bf16_example_converts_the_heavy_ops(tmp_path / "out" / "digits.bf16.plan.json")


def _assert_tour_compare_reproduces_the_plan(out):
    """The tour's compare (report.json) runs convert's data and numerics: every verified figure matches."""
    import json

    from mpinfer.report import load_report
    from mpinfer.report.plan_check import plan_check

    plan = json.loads((out / "digits.fp16.plan.json").read_text())
    result = load_report(out / "report" / "report.json")
    cand = next(c for c in result.candidates if c.path.endswith("digits.fp16.onnx"))
    notes, rows = plan_check(result, cand)
    assert rows and not any("not comparable" in n for n in notes), notes
    assert {r[1] for r in rows} >= {"cosine", "top1", "max_abs"}, rows
    assert all(r[-1] == "match" for r in rows), rows
    verified = plan["summary"]["verification"]
    assert verified["samples"] == result.data["samples"]


def _assert_bf16_example_converts_the_heavy_ops(plan_path):
    """The README's BF16 line (opset 22: BF16 Conv) lowers most of the FLOPs, as it says."""
    import json

    summary = json.loads(plan_path.read_text())["summary"]
    assert summary["low_share_flops"] > 0.9, summary


@pytest.mark.parametrize("target", ["demo", "test"])
def test_makefile_has_the_two_setup_targets(target):
    assert re.search(rf"^{target}:", (ROOT / "Makefile").read_text(), re.M)


def test_readme_python_api_snippet_runs(tmp_path):
    import os
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    snippet = text.split("Python API", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    (tmp_path / "models").symlink_to(ROOT / "models")
    (tmp_path / "snippet.py").write_text(snippet)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]  # the snippet asserts bool(result) itself
    assert (tmp_path / "out" / "resnet-report" / "index.html").is_file()
