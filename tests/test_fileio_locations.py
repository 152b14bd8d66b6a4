"""Outputs in places nothing can be written (a file used as a folder, /proc): one clear error, no traceback.

Every command writes through mpinfer.fileio; its output checks and atomic writes turn the OSError of such a
location into an InvalidInputError before any work is done.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpinfer.errors import InvalidInputError
from mpinfer.fileio import check_output_path, check_writable_location, make_dirs, write_text_atomic
from tests.conftest import assert_user_error

UNWRITABLE = r"received a location that cannot be written \((NotADirectoryError|FileNotFoundError|FileExistsError)"


def _proc_refuses_files() -> bool:
    try:
        fd, path = tempfile.mkstemp(dir="/proc")
    except OSError:
        return True
    os.close(fd)
    os.unlink(path)
    return False


needs_proc = pytest.mark.skipif(not Path("/proc").is_dir() or not _proc_refuses_files(),
                                reason="needs a /proc that refuses new files (Linux)")


@pytest.fixture
def a_file(tmp_path):
    """A regular file that the bad outputs use as a folder."""
    path = tmp_path / "plain.onnx"
    path.write_bytes(b"not a folder")
    return path


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_check_output_path_refuses_a_file_used_as_a_folder(tmp_path, a_file):
    with pytest.raises(InvalidInputError, match=r"Output '.*plain.onnx/x.onnx'.*NotADirectoryError.*plain.onnx"):
        check_output_path(a_file / "x.onnx")
    with pytest.raises(InvalidInputError, match="NotADirectoryError.*expected a writable folder. Hint"):
        check_output_path(a_file / "deeper" / "x.onnx")
    assert a_file.read_bytes() == b"not a folder"


def test_check_output_path_accepts_new_folders_and_leaves_nothing_behind(tmp_path):
    assert check_output_path(tmp_path / "new" / "sub" / "x.onnx") == (tmp_path / "new/sub/x.onnx").resolve()
    assert not (tmp_path / "new").exists()  # checked, not created
    assert _leftovers(tmp_path) == []


@needs_proc
def test_check_output_path_refuses_proc():
    with pytest.raises(InvalidInputError, match=r"Output '/proc/x.onnx'.*FileNotFoundError.*'/proc'"):
        check_output_path("/proc/x.onnx")
    with pytest.raises(InvalidInputError, match="FileNotFoundError"):
        check_writable_location("/proc/run")


def test_atomic_writes_turn_os_errors_into_clear_errors(tmp_path, a_file):
    with pytest.raises(InvalidInputError, match=r"Output '.*plain.onnx/x.json'.*\((FileExistsError|NotADirectory)"):
        write_text_atomic(a_file / "x.json", "{}")
    with pytest.raises(InvalidInputError, match="NotADirectoryError|FileExistsError"):
        make_dirs(a_file / "run")
    folder = tmp_path / "a_folder"
    folder.mkdir()
    with pytest.raises(InvalidInputError, match=r"Output '.*a_folder'.*IsADirectoryError"):
        write_text_atomic(folder, "text")  # the rename onto a folder fails
    assert _leftovers(tmp_path) == [] and list(folder.iterdir()) == []


@needs_proc
def test_atomic_writes_refuse_proc():
    with pytest.raises(InvalidInputError, match=r"Output '/proc/x.txt'.*FileNotFoundError"):
        write_text_atomic("/proc/x.txt", "x")
    with pytest.raises(InvalidInputError, match=r"Output '/proc/run'.*FileNotFoundError"):
        make_dirs("/proc/run")


# --- through the CLI ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory) -> Path:
    """x[n,4] @ w → Relu: small enough for convert and compare to take a second."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"], name="r")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    path = tmp_path_factory.mktemp("tiny") / "tiny.onnx"
    onnx.save(model, path)
    return path


def _bad_outputs(a_file: Path, name: str) -> list[Path]:
    bad = [a_file / name, a_file / "sub" / name]
    if Path("/proc").is_dir() and _proc_refuses_files():
        bad.append(Path("/proc") / name)
    return bad


def test_cli_convert_to_an_unwritable_location(invoke, tmp_path, a_file, tiny_onnx):
    for out in _bad_outputs(a_file, "m.fp16.onnx"):
        r = invoke("convert", tiny_onnx, "--calibration", "none", "-o", out)
        assert_user_error(r, UNWRITABLE)
    assert a_file.read_bytes() == b"not a folder" and _leftovers(tmp_path) == []


def test_cli_build_engine_to_an_unwritable_location(invoke, tmp_path, a_file, tiny_onnx):
    for out in _bad_outputs(a_file, "m.ort"):
        r = invoke("build-engine", tiny_onnx, "-o", out)
        assert_user_error(r, UNWRITABLE)


def test_cli_compare_and_report_to_an_unwritable_location(invoke, tmp_path, a_file, tiny_onnx):
    for out in _bad_outputs(a_file, "rep"):
        r = invoke("compare", tiny_onnx, tiny_onnx, "--quiet", "--report", out)
        assert_user_error(r, UNWRITABLE)
    r = invoke("compare", tiny_onnx, tiny_onnx, "--quiet", "--report", tmp_path / "rep")
    assert r.exit_code == 0, r.output
    for out in _bad_outputs(a_file, "r.html"):
        r = invoke("report", tmp_path / "rep" / "report.json", "--format", "html", "-o", out)
        assert_user_error(r, UNWRITABLE)


def test_an_output_whose_data_file_is_the_inputs_is_refused(invoke, tmp_path):
    # a.onnx keeps its weights in "b.onnx.data": writing b.onnx (and its b.onnx.data) would destroy them
    w = numpy_helper.from_array(np.random.default_rng(0).random((256, 256), dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 256])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(tmp_path / "a.onnx"), save_as_external_data=True, location="b.onnx.data")
    data = (tmp_path / "b.onnx.data").read_bytes()
    for args in (
        ("convert", tmp_path / "a.onnx", "--calibration", "none", "-o", tmp_path / "b.onnx", "--force"),
        ("build-engine", tmp_path / "a.onnx", "--backend", "onnxruntime", "-o", tmp_path / "b.onnx", "--force"),
    ):
        assert_user_error(invoke(*args), r"b.onnx.data': received the same path as an input")
    assert (tmp_path / "b.onnx.data").read_bytes() == data and not (tmp_path / "b.onnx").exists()
    # elsewhere it converts, also when run from the output's folder with its data file there (onnx's own
    # external-data writer checks the location against the current folder and refused)
    ok = invoke("convert", tmp_path / "a.onnx", "--calibration", "none", "-o", tmp_path / "c.onnx")
    assert ok.exit_code == 0, ok.output
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        again = invoke("convert", "a.onnx", "--calibration", "none", "-o", "c.onnx", "--force")
    finally:
        os.chdir(cwd)
    assert again.exit_code == 0, again.output


class _Interrupted(Exception):
    pass


def test_a_ctrl_c_the_moment_the_probe_exists_leaves_no_probe_behind(tmp_path, monkeypatch):
    """The writability probe holds Ctrl-C back between creating and removing its file (CI found a leftover
    ``.mpinfer-probe-*`` after a Ctrl-C during convert): the interrupt still arrives, after the cleanup. Another
    thread is alive, as in convert: a thread's signal mask alone let the interrupt through there."""
    real_mkstemp = tempfile.mkstemp

    def mkstemp_then_ctrl_c(*args, **kwargs):
        made = real_mkstemp(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # to the process, as a Ctrl-C: any thread may take it
        time.sleep(0.05)  # (its handler runs in this, the main, thread at the next bytecode after that)
        return made

    def raise_interrupted(signum, frame):
        raise _Interrupted

    idle = threading.Event()
    other = threading.Thread(target=idle.wait)  # another thread, as ONNX Runtime's and torch's in convert
    other.start()
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_ctrl_c)
    before = signal.signal(signal.SIGINT, raise_interrupted)
    try:
        with pytest.raises(_Interrupted):
            check_writable_location(tmp_path / "out")
    finally:
        signal.signal(signal.SIGINT, before)
        idle.set()
        other.join()
    assert list(tmp_path.iterdir()) == []
