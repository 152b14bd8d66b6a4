"""Pipeline errors in the TOML's own words, Ctrl-C that says what was kept, and one run per work folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpinfer.claim import OutputBusyError, claim_outputs, lock_path
from mpinfer.errors import InvalidInputError
from mpinfer.pipeline import PipelineInterrupted, Stage, StageOutput, StagePlan, run_pipeline
from tests.conftest import assert_user_error
from tests.test_fault_injection import make_mlp
from tests.test_pipeline import REGISTRY

ROOT = Path(__file__).resolve().parents[1]


def test_a_typo_names_the_table_and_key_lists_its_keys_and_suggests_the_closest(tmp_path, invoke):
    make_mlp(tmp_path / "m.onnx", width=8, layers=1)
    toml = tmp_path / "p.toml"
    toml.write_text('[convert]\nmodel = "m.onnx"\nbudgte = "cosine>=0.99"\n')
    with pytest.raises(InvalidInputError) as info:
        run_pipeline(toml)
    msg = str(info.value)
    assert "Pipeline table [convert]: received unknown key 'budgte'" in msg
    assert "budget, calibration" in msg and "Hint: did you mean 'budget'?" in msg
    assert "ConvertConfig" not in msg and "fields of" not in msg  # no Python class names
    assert_user_error(invoke("run", toml), r"\[convert\].*'budgte'.*did you mean 'budget'")
    assert not (tmp_path / "out").exists()  # refused before any stage ran


def test_a_key_far_from_every_key_gets_no_suggestion(tmp_path):
    (tmp_path / "p.toml").write_text('[compare]\nbaseline = "m.onnx"\nzzzz = 1\n')
    with pytest.raises(InvalidInputError, match=r"\[compare\]: received unknown key 'zzzz'.*Hint: remove it") as info:
        run_pipeline(tmp_path / "p.toml")
    assert "did you mean" not in str(info.value)


def test_a_missing_calibration_file_names_the_table_and_key(tmp_path, invoke):
    make_mlp(tmp_path / "m.onnx", width=8, layers=1)
    toml = tmp_path / "p.toml"
    toml.write_text('[convert]\nmodel = "m.onnx"\ncalibration = "calibration/digitz.npz"\n')
    with pytest.raises(InvalidInputError, match=r"\[convert\] calibration = 'calibration/digitz.npz'.*no such file"):
        run_pipeline(toml)
    assert_user_error(invoke("run", toml), r"\[convert\] calibration = .*digitz.npz.*no such file")
    toml.write_text('[convert]\nmodel = "m.onnx"\ncalibration = "random:2"\n')  # a source, not a path: fine
    assert run_pipeline(toml).stages[0].status == "ran"


def _interrupt(plan: StagePlan, out: Path) -> StageOutput:
    raise KeyboardInterrupt


def test_ctrl_c_in_a_stage_says_what_was_kept_and_how_to_resume(tmp_path):
    np.save(tmp_path / "data.npy", np.arange(4, dtype=np.float32))
    toml = tmp_path / "p.toml"
    toml.write_text('[pipeline]\nwork_dir = "work"\n[scale]\ndata = "data.npy"\n[total]\n')
    registry = {**REGISTRY, "total": Stage("total", REGISTRY["total"].plan, _interrupt)}
    with pytest.raises(PipelineInterrupted) as info:
        run_pipeline(toml, registry=registry)
    msg = str(info.value)
    assert "Kept the finished stage(s) scale" in msg and "pipeline-state.json" in msg
    assert "'total' wrote nothing" in msg and f"Resume with: mpinfer run {toml}" in msg
    assert not lock_path(tmp_path / "work").exists()
    assert not list((tmp_path / "work" / "artefacts").glob("total-*"))  # the interrupted stage left nothing
    assert [s.status for s in run_pipeline(toml, registry=REGISTRY).stages] == ["skipped", "ran"]


def test_a_second_run_on_a_work_dir_fails_at_once(tmp_path):
    np.save(tmp_path / "data.npy", np.arange(4, dtype=np.float32))
    toml = tmp_path / "p.toml"
    toml.write_text('[pipeline]\nwork_dir = "work"\n[scale]\ndata = "data.npy"\n')
    (tmp_path / "work").mkdir()
    with claim_outputs([tmp_path / "work"], command="mpinfer run p.toml"):  # as a run in progress holds it
        with pytest.raises(OutputBusyError, match=rf"pid {os.getpid()} .*mpinfer run p.toml"):
            run_pipeline(toml, registry=REGISTRY)
    assert run_pipeline(toml, registry=REGISTRY).stages[0].status == "ran"


def _default_sigint() -> None:
    """In the child before exec: SIGINT as a terminal delivers it. A harness that starts the suite in the background
    (`cmd &` in a non-interactive shell) has SIGINT ignored, an ignored signal stays ignored across exec, and Python
    then installs no KeyboardInterrupt handler: the Ctrl-C would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_convert_exits_130_and_writes_nothing(tmp_path):
    model = make_mlp(tmp_path / "m.onnx", width=512, layers=8)
    out = tmp_path / "m16.onnx"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "mpinfer", "convert", str(model), "-o", str(out),
                             "--calibration", "random:64", "--budget", "cosine>=0.9999999"],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    deadline = time.monotonic() + 60
    while not lock_path(out).exists():  # claimed: the work has started
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Interrupted. Nothing was written" in err and "Start again with: mpinfer convert" in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # no output, no lock, no temporary


def _cli_cases(tmp_path: Path) -> dict[str, tuple[list[str], Path]]:
    model = make_mlp(tmp_path / "m.onnx", width=8, layers=1)
    return {
        "convert": (["convert", str(model), "-o", str(tmp_path / "c.onnx")], tmp_path / "c.onnx"),
        "build-engine": (["build-engine", str(model), "--backend", "onnxruntime", "-o", str(tmp_path / "e.ort")],
                         tmp_path / "e.ort"),
        "compare --report": (["compare", str(model), str(model), "--data", "random:2", "--report",
                              str(tmp_path / "rep")], tmp_path / "rep" / "report.json"),
        "export": (["export", "models/mlp.py:build", "-o", str(tmp_path / "x.onnx")], tmp_path / "x.onnx"),
        "train": (["train", "models/digits_cnn.py:build", "--epochs", "1", "--precision", "fp32", "--quiet", "-o",
                   str(tmp_path / "run")], tmp_path / "run"),
    }


@pytest.mark.parametrize("command", ["convert", "build-engine", "compare --report", "export", "train"])
def test_every_writing_command_fails_at_once_on_an_output_another_run_holds(tmp_path, invoke, command):
    args, held = _cli_cases(tmp_path)[command]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with claim_outputs([held], command="mpinfer something else"):
        start = time.perf_counter()
        result = invoke(*args)
        took = time.perf_counter() - start
    assert_user_error(result, rf"received an output another mpinfer run is writing: pid {os.getpid()} .*"
                              r"mpinfer something else.*since")
    assert took < 20  # no work done: the claim comes first (the time is the command's imports)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written, no lock left


def test_report_o_fails_at_once_on_an_output_another_run_holds(tmp_path, invoke):
    args, _ = _cli_cases(tmp_path)["compare --report"]
    assert invoke(*args).exit_code == 0
    out = tmp_path / "r.md"
    with claim_outputs([out], command="mpinfer report again"):
        result = invoke("report", str(tmp_path / "rep"), "--format", "md", "-o", str(out))
    assert_user_error(result, r"another mpinfer run is writing: .*mpinfer report again")
    assert not out.exists()
