"""Exclusive outputs (mpinfer.claim): lock, reclaim, sweep, publish as one unit, umask."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mpinfer.claim import OutputBusyError, claim_outputs, lock_path
from mpinfer.errors import InvalidInputError
from mpinfer.fileio import pid_alive, sweep_temps

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.Popen:
    """A subprocess running ``code`` with this tree's mpinfer, its stdout piped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                            env=env)


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def holder(tmp_path):
    """A live process holding a claim on tmp_path/m.onnx (until it is killed)."""
    out = tmp_path / "m.onnx"
    proc = _python(f"""
        import time
        from mpinfer.claim import claim_outputs
        with claim_outputs([{str(out)!r}], command="mpinfer convert a.onnx -o m.onnx"):
            print("claimed", flush=True)
            time.sleep(60)
    """)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
    yield proc, out
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_second_claim_fails_at_once_naming_the_first(holder):
    proc, out = holder
    start = time.perf_counter()
    with pytest.raises(OutputBusyError) as info, claim_outputs([out]):
        pass
    assert time.perf_counter() - start < 1.0  # at once, not after waiting for the other run
    msg = str(info.value)
    assert f"pid {proc.pid}" in msg and "mpinfer convert a.onnx -o m.onnx" in msg and "since 20" in msg
    assert str(lock_path(out)) in msg  # what to delete if that process is gone
    assert lock_path(out).is_file()  # the holder's lock is untouched


def test_stale_lock_of_a_killed_process_is_reclaimed(holder, caplog):
    proc, out = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lock_path(out).is_file()  # kill -9 leaves the lock behind
    with caplog.at_level(logging.WARNING, logger="mpinfer"), claim_outputs([out]) as claim:
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
        claim.stage(out).write_text("x")
        claim.publish()
    assert f"pid {proc.pid}" in caplog.text and "which is gone" in caplog.text
    assert out.read_text() == "x" and not lock_path(out).exists()


def test_lock_holds_pid_host_start_and_command_and_goes_on_every_exit(tmp_path):
    out = tmp_path / "m.onnx"
    with claim_outputs([out], command="mpinfer export x.py:build -o m.onnx"):
        info = json.loads(lock_path(out).read_text())
        assert info["pid"] == os.getpid() and info["host"] and info["started"]
        assert info["command"] == "mpinfer export x.py:build -o m.onnx"
    assert not lock_path(out).exists()
    for exc in (InvalidInputError("bad input"), KeyboardInterrupt()):
        with pytest.raises(type(exc)), claim_outputs([out]) as claim:
            claim.stage(out).write_text("half")
            raise exc
        assert sorted(p.name for p in tmp_path.iterdir()) == []  # no lock, no staged file, no output


def test_a_busy_second_output_releases_the_first(holder, tmp_path):
    _, busy = holder
    free = tmp_path / "m.plan.json"
    with pytest.raises(OutputBusyError), claim_outputs([free, busy]):
        pass
    assert not lock_path(free).exists()


def test_publish_is_all_or_nothing_and_refuses_a_file_that_appeared(tmp_path):
    model, plan = tmp_path / "m.onnx", tmp_path / "m.plan.json"
    with pytest.raises(InvalidInputError, match="appeared while this run worked"), \
            claim_outputs([model, plan]) as claim:
        claim.stage(model).write_text("model")
        claim.stage(plan).write_text("plan")
        plan.write_text("someone else's")  # another program wrote it meanwhile
        claim.publish()
    assert not model.exists() and plan.read_text() == "someone else's"
    with claim_outputs([model, plan], force=True) as claim:  # --force replaces it
        claim.stage(model).write_text("model")
        claim.stage(plan).write_text("plan")
        claim.publish()
    assert (model.read_text(), plan.read_text()) == ("model", "plan")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.plan.json"]


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_published_files_take_the_umask(tmp_path, mask):
    out = tmp_path / "m.onnx"
    old = os.umask(mask)
    try:
        with claim_outputs([out, tmp_path / "m.onnx.data"]) as claim:
            staged = claim.stage(out)
            staged.write_text("m")
            fd = os.open(claim.stage(tmp_path / "m.onnx.data"), os.O_CREAT | os.O_WRONLY, 0o600)  # as onnx does
            os.close(fd)
            claim.publish()
    finally:
        os.umask(old)
    for name in ("m.onnx", "m.onnx.data"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask, name


def test_leftovers_of_dead_processes_are_swept_live_ones_kept(tmp_path, caplog):
    out = tmp_path / "m16.onnx"
    dead, live = _dead_pid(), os.getppid()
    assert not pid_alive(dead) and pid_alive(live)
    stale_dir = tmp_path / f".m16.onnx.{dead}.ab12cd.tmp"
    stale_dir.mkdir()
    (stale_dir / "m16.onnx.data").write_bytes(b"\0" * 4096)
    stale_file = tmp_path / f".m16.onnx.{dead}.x_y1.tmp"
    stale_file.write_text("x")
    kept = [tmp_path / f".m16.onnx.{live}.zz99.tmp",  # a live process's
            tmp_path / f".other.onnx.{dead}.ab12cd.tmp",  # another output's
            tmp_path / f".m16.onnx.data.{dead}.ab12cd.tmp"]  # another output's (same prefix)
    for p in kept:
        p.write_text("keep")
    with caplog.at_level(logging.WARNING, logger="mpinfer"):
        assert sorted(sweep_temps(out)) == sorted([stale_dir, stale_file])
    assert all(p.exists() for p in kept) and not stale_dir.exists() and not stale_file.exists()
    assert f"left by pid {dead}, which is gone" in caplog.text and "4 KB" in caplog.text


def test_a_kill_between_two_links_is_completed_by_the_next_run(tmp_path, caplog):
    """The journal in the lock lets the next run finish a unit whose publish was cut between two links."""
    model, plan = tmp_path / "m.onnx", tmp_path / "m.plan.json"
    proc = _python(f"""
        import os, signal
        import mpinfer.claim as c
        place = c._place
        def place_then_die(tmp, out, *, replace):
            place(tmp, out, replace=replace)
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9 right after the first link
        c._place = place_then_die
        with c.claim_outputs([{str(model)!r}, {str(plan)!r}]) as claim:
            claim.stage({str(model)!r}).write_text("model")
            claim.stage({str(plan)!r}).write_text("plan")
            claim.publish()
    """)
    assert proc.wait() == -signal.SIGKILL
    assert plan.exists() and not model.exists()  # the plan went first; the model (the commit) is missing
    assert json.loads(lock_path(model).read_text())["publishing"]
    with caplog.at_level(logging.WARNING, logger="mpinfer"), claim_outputs([model, plan]):
        assert (model.read_text(), plan.read_text()) == ("model", "plan")
    assert "Completed the publish" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.plan.json"]  # staging swept, locks gone


def test_folders_made_for_outputs_go_again_when_nothing_was_published(tmp_path):
    out = tmp_path / "new" / "deeper" / "m.onnx"
    with pytest.raises(InvalidInputError), claim_outputs([out]):
        raise InvalidInputError("bad budget")
    assert list(tmp_path.iterdir()) == []
    with claim_outputs([out]) as claim:
        claim.stage(out).write_text("m")
        claim.publish()
    assert out.read_text() == "m"


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_convert_and_save_onnx_publish_weights_with_the_umask(tmp_path, mask):
    """onnx writes external data 0600; a model server under another account must read the weights too."""
    import onnx

    from mpinfer.modelio import save_onnx
    from mpinfer.precision import ConvertConfig, convert_precision
    from tests.test_fault_injection import make_mlp

    model = make_mlp(tmp_path / "m.onnx", width=64, layers=2, external=True)
    old = os.umask(mask)
    try:
        save_onnx(onnx.load(str(model)), tmp_path / "s.onnx", external_data=True)
        convert_precision(ConvertConfig(model=model, output=tmp_path / "m16.onnx", calibration="none"))
    finally:
        os.umask(old)
    written = ["s.onnx", "s.onnx.data", "m16.onnx", "m16.onnx.data", "m16.plan.json"]
    assert {p.name for p in tmp_path.iterdir()} == {"m.onnx", "m.onnx.data", *written}
    for name in written:
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask, name


@pytest.mark.parametrize("where", ["mkstemp", "link"])
def test_ctrl_c_while_the_locks_are_made_leaves_no_lock_and_no_temporary(tmp_path, monkeypatch, where):
    """A Ctrl-C that lands inside a lock's making (its temporary just created, or the lock just linked into place)
    is raised once every lock made is held, so the claim releases them all: nothing is left. Before, the
    KeyboardInterrupt left the temporary lock (or the lock itself) behind; the Ctrl-C test of the CLI caught
    '.m16.plan.json.lock.<pid>.<random>.tmp' in one CI run."""
    import tempfile

    import mpinfer.claim as claim

    real_mkstemp, real_link = tempfile.mkstemp, os.link

    def mkstemp(*args, **kwargs):
        made = real_mkstemp(*args, **kwargs)
        if where == "mkstemp" and ".plan" in kwargs.get("prefix", ""):
            signal.raise_signal(signal.SIGINT)  # (the file exists; mkstemp has not returned its name yet)
        return made

    def link(src, dst, *args, **kwargs):
        real_link(src, dst, *args, **kwargs)
        if where == "link" and ".plan" in str(dst):
            signal.raise_signal(signal.SIGINT)  # (the lock is in place; _create has not returned it yet)

    monkeypatch.setattr(claim.tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(claim.os, "link", link)
    outputs = [tmp_path / "m16.onnx", tmp_path / "m16.plan.json"]
    # Python's own Ctrl-C handler for the test: a suite started in the background (`cmd &`) has SIGINT ignored
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), claim_outputs(outputs):
            pytest.fail("the claim was made despite the Ctrl-C")  # (never reached: the interrupt comes first)
    finally:
        signal.signal(signal.SIGINT, before)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
