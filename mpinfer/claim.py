"""Outputs that two runs can never mix up: claim before the work, publish as one unit after it.

Every command that writes (export, convert, build-engine, compare --report, report -o, train's run folder,
``mpinfer run``'s work folder) wraps its work in :func:`claim_outputs`:

* **Claim.** For each output a lock file ``.<name>.lock`` is created exclusively beside it (filled in under a
  temporary name, then hard-linked into place, which fails when it exists; ``O_CREAT|O_EXCL`` where links are
  unavailable) and held with ``flock`` for the life of the run; it records the pid, host, start time and
  command. A second run on the same output fails at once with :class:`OutputBusyError`, naming the first (pid,
  command, since when). A lock left by a process that is gone (its ``flock`` released by the kernel and its
  pid no longer alive on this host) is reclaimed, with a log line. The locks are removed on exit: normal,
  error or KeyboardInterrupt.
* **Sweep.** Temporary files and folders of the claimed outputs (``.<name>.<pid>.<random>.tmp``, see
  :func:`mpinfer.fileio.temp_prefix`) whose owner pid is gone are removed, and the run says so. A live
  process's temporaries are never touched.
* **Stage and publish.** The outputs are written under :meth:`OutputClaim.stage` (a temporary folder beside
  them), then :meth:`OutputClaim.publish` links them into place together, the first output (the model) last:
  ``os.link`` fails if a target appeared meanwhile (``os.replace`` with ``force``). Just before the first link
  the unit is journalled in the first output's lock; a process killed between two links (microseconds) leaves
  that journal, and the next run that claims the output completes the unit from the staged files. So a model
  and its plan (convert), an engine and its sidecar (build-engine), a model, its data and its ``.export.json``
  (export) are visible both or neither. Published files get the mode of any file the user creates (umask).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.fileio import (
    TEMP_SUFFIX,
    check_writable_location,
    make_dirs,
    make_temp_dir,
    pid_alive,
    signals_deferred,
    sweep_temps,
    user_file_mode,
)

logger = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"
# A lock file younger than this with no readable content is a run between its create and its first write.
LOCK_WRITE_GRACE_S = 5.0


class OutputBusyError(InvalidInputError):
    """Another live run is writing the same output."""


def lock_path(output: str | os.PathLike[str]) -> Path:
    """The lock file of ``output``: ``.<name>.lock`` beside it (for a folder too)."""
    p = Path(output)
    return p.with_name(f".{p.name}{LOCK_SUFFIX}")


def command_line() -> str:
    """This process's command as a user typed it (``mpinfer convert m.onnx -o m16.onnx``)."""
    argv = list(sys.argv) or ["python"]
    if argv[0].endswith(("__main__.py", "/mpinfer")) or argv[0] == "-m":
        argv[0] = "mpinfer"
    return " ".join(shlex.quote(a) for a in argv)


def _try_flock(fd: int) -> bool:
    """Take an exclusive, non-blocking flock on ``fd``; False when another process holds it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: pid liveness alone decides
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:  # a file system without flock: pid liveness alone decides
        return err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN)
    return True


def _read_info(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    try:
        info = json.loads(b"".join(chunks).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("pid"), int) else None


def _write_info(fd: int, info: dict[str, Any]) -> None:
    """Write ``info`` over the lock's content in one ``pwrite``, padded to the old length (never truncated).

    A process killed while rewriting its lock (the publish journal) leaves the old content or the new one, never
    an empty or half file: trailing spaces are valid JSON.
    """
    data = json.dumps(info, indent=1).encode("utf-8")
    data += b" " * max(0, os.fstat(fd).st_size - len(data))
    os.pwrite(fd, data, 0)


def _describe(info: dict[str, Any] | None) -> str:
    if info is None:
        return "a run that is just starting"
    return f"pid {info.get('pid')} on {info.get('host')} (`{info.get('command')}`, since {info.get('started')})"


class _Lock:
    """One held lock file (an open, flocked descriptor)."""

    def __init__(self, output: Path, fd: int, info: dict[str, Any]) -> None:
        self.output, self.path, self.fd, self.info = output, lock_path(output), fd, info

    def record(self, **facts: Any) -> None:
        """Rewrite the lock's content with ``facts`` added (the publish journal)."""
        self.info = {**self.info, **facts}
        _write_info(self.fd, self.info)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(self.fd), os.stat(self.path)):
                os.unlink(self.path)  # unlinked while held: a waiting claimer sees the inode change
        os.close(self.fd)


def _busy(output: Path, info: dict[str, Any] | None) -> OutputBusyError:
    return OutputBusyError(
        format_message(
            f"Output '{output}'",
            f"an output another mpinfer run is writing: {_describe(info)}",
            "an output no other run is writing",
            f"wait for that run to finish or choose another output; if that process is gone, delete "
            f"'{lock_path(output)}'",
        )
    )


def _stale(info: dict[str, Any] | None, fd: int) -> bool:
    """Whether a lock whose flock this process just got was left by a process that is gone."""
    if info is None:  # unreadable: a run between create and write, or one killed there
        return time.time() - os.fstat(fd).st_mtime > LOCK_WRITE_GRACE_S
    if info.get("host") != socket.gethostname():
        return False  # another machine's run on a shared folder: its pid means nothing here
    return not pid_alive(int(info["pid"]))


def _acquire(output: Path, info: dict[str, Any], told: set[Any]) -> _Lock:
    """Create (or reclaim) ``output``'s lock file; raise OutputBusyError when a live run holds it.

    A reclaimed lock is logged once per gone process (``told`` holds the pids already named).
    """
    path = lock_path(output)
    for _ in range(100):  # a lock released and re-created under us: look again
        try:
            fd = _create(path, info)
            if fd is not None:
                return _Lock(output, fd, info)
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue
        except OSError as err:
            raise InvalidInputError(
                format_message(f"Output '{output}'", f"a folder where no lock file can be created ({err})",
                               "a writable folder")
            ) from err
        held = not _try_flock(fd)
        old = _read_info(fd)
        if held or not _stale(old, fd):
            os.close(fd)
            raise _busy(output, old)
        if not _same_file(fd, path):
            os.close(fd)
            continue
        holder = (old or {}).get("pid")
        if holder not in told:
            told.add(holder)
            logger.warning("Took over the outputs of %s, which is gone: '%s'", _describe(old),
                           "', '".join((old or {}).get("outputs") or [str(output)]))
        lock = _Lock(output, fd, info)
        lock.record()
        _finish_publish(old)
        return lock
    raise _busy(output, None)  # pragma: no cover - 100 races in a row


def _create(path: Path, info: dict[str, Any]) -> int | None:
    """Create the lock file ``path`` exclusively, already flocked and filled in; None when it exists.

    The file is written and locked under a temporary name and linked into place (``link`` fails when the
    target exists, as ``O_EXCL`` does), so no process ever sees a lock without its owner's facts, even one
    killed half-way. File systems without hard links get ``O_CREAT|O_EXCL`` and a write.
    """
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.{os.getpid()}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        _flock_own(fd)
        _write_info(fd, info)
        try:
            os.link(tmp, path)
            return fd
        except FileExistsError:
            os.close(fd)
            return None
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
    finally:
        os.unlink(tmp)
    os.close(fd)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    except FileExistsError:
        return None
    _flock_own(fd)
    _write_info(fd, info)
    return fd


def _flock_own(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return
    with contextlib.suppress(OSError):  # a file system without flock: pid liveness alone decides
        fcntl.flock(fd, fcntl.LOCK_EX)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _finish_publish(old: dict[str, Any] | None) -> None:
    """Complete the publish a killed run had journalled (its files were staged and checked)."""
    pairs = (old or {}).get("publishing") or []
    done = []
    for tmp, dest in pairs:
        t, d = Path(tmp), Path(dest)
        if not t.exists():
            continue
        if d.exists() and os.path.samefile(t, d):
            t.unlink()
        else:
            os.replace(t, d)
        done.append(d.name)
    if done:
        logger.warning("Completed the publish that %s was killed in: %s", _describe(old), ", ".join(done))


class OutputClaim:
    """The outputs a run holds: where to stage them and how to publish them (see :func:`claim_outputs`).

    Attributes:
        outputs: The claimed paths, the primary (published last) first.
        force: Whether publishing may replace an existing file.
    """

    def __init__(self, outputs: Sequence[Path], locks: list[_Lock], force: bool, replaceable: Iterable[Path]) -> None:
        self.outputs = tuple(outputs)
        self.force = force
        self._replaceable = frozenset(replaceable)
        self._locks = locks
        self._staging: dict[Path, Path] = {}
        self.published = False

    def stage(self, output: str | os.PathLike[str]) -> Path:
        """The path to write ``output`` (a claimed path) to; :meth:`publish` moves it into place.

        A model saved at the staged path of ``m.onnx`` with its weights in ``m.onnx.data`` beside it publishes
        both (when ``m.onnx.data`` is claimed too).
        """
        out = Path(output).resolve()
        if out not in self.outputs:
            raise ValueError(f"{out} is not among the claimed outputs {self.outputs}")
        folder = self._staging.get(out.parent)
        if folder is None:  # named after the primary output where it shares its folder (swept with it)
            owner = self.outputs[0] if out.parent == self.outputs[0].parent else out
            folder = self._staging[out.parent] = make_temp_dir(owner)
        return folder / out.name

    def scratch(self) -> Path:
        """A private folder for intermediate files, removed with the staging folder (never published)."""
        folder = self.stage(self.outputs[0]).parent / ".scratch"
        folder.mkdir(exist_ok=True)
        return folder

    def publish(self) -> list[Path]:
        """Move every staged output into place, the primary last; both or neither are visible.

        Returns:
            The outputs published.

        Raises:
            InvalidInputError: An output appeared meanwhile (without ``force``), or cannot be written.
        """
        pairs = [(self.stage(o), o) for o in reversed(self.outputs) if o.parent in self._staging]
        pairs = [(t, o) for t, o in pairs if t.exists()]
        mode = user_file_mode()
        for tmp, _ in pairs:
            if tmp.is_file():
                os.chmod(tmp, mode)  # temporaries may be 0600: published files take the user's umask
        for _, out in pairs:
            if not self._replaces(out) and (out.exists() or out.is_symlink()):
                raise _appeared(out)
        self._locks[0].record(publishing=[[str(t), str(o)] for t, o in pairs])
        for tmp, out in pairs:
            _place(tmp, out, replace=self._replaces(out))
        self._locks[0].record(publishing=[])
        self.published = True
        self._cleanup()
        return [o for _, o in pairs]

    def _replaces(self, out: Path) -> bool:
        return self.force or out in self._replaceable

    def _cleanup(self) -> None:
        for folder in self._staging.values():
            shutil.rmtree(folder, ignore_errors=True)
        self._staging.clear()

    def release(self) -> None:
        """Drop whatever was staged and not published, and remove the lock files."""
        self._cleanup()
        for lock in reversed(self._locks):
            lock.release()


def _appeared(out: Path) -> InvalidInputError:
    return InvalidInputError(
        format_message(
            f"Output '{out}'",
            "a file that appeared while this run worked (another program wrote it)",
            "a path nothing else writes",
            "nothing of this run was published; pass --force to replace it, or choose another output",
        )
    )


def _place(tmp: Path, out: Path, *, replace: bool) -> None:
    """Publish one file: ``os.link`` (fails when ``out`` exists) then unlink, or ``os.replace`` with ``replace``."""
    try:
        if replace or tmp.is_dir():
            os.replace(tmp, out)
            return
        try:
            os.link(tmp, out)
        except FileExistsError as err:
            raise _appeared(out) from err
        except OSError as err:  # no hard links on this file system: checked rename under our lock
            if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
                raise
            if out.exists():
                raise _appeared(out) from err
            os.rename(tmp, out)
            return
        tmp.unlink()
    except InvalidInputError:
        raise
    except OSError as err:
        raise InvalidInputError(
            format_message(f"Output '{out}'", f"a location that cannot be written ({err})", "a writable folder")
        ) from err


@contextlib.contextmanager
def claim_outputs(
    outputs: Iterable[str | os.PathLike[str]],
    *,
    force: bool = False,
    replaceable: Iterable[str | os.PathLike[str]] = (),
    command: str | None = None,
) -> Iterator[OutputClaim]:
    """Hold ``outputs`` exclusively for the ``with`` block: lock, sweep leftovers, stage, publish, release.

    Args:
        outputs: The paths the run writes, the primary (the model, the engine, the folder) first. Their
            folders are created.
        force: :meth:`OutputClaim.publish` may replace existing files (it never replaces a live run's lock).
        replaceable: Outputs replaced even without ``force`` (a model's data file goes with the model).
        command: What the lock records as the holder's command (default: this process's command line).

    Yields:
        The claim; write under :meth:`OutputClaim.stage` and call :meth:`OutputClaim.publish` when done.
        Whatever is not published when the block ends (an error, Ctrl-C) is removed.

    Raises:
        OutputBusyError: Another live run holds one of the outputs (nothing is claimed then).
        InvalidInputError: A folder where no lock file can be created.
    """
    paths = list(dict.fromkeys(Path(o).resolve() for o in outputs))
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": command or command_line(),
        "outputs": [str(p) for p in paths],
    }
    locks: list[_Lock] = []
    told: set[Any] = set()
    made: list[Path] = []  # folders this claim created: removed again when nothing was published into them
    claim = None
    try:
        # Ctrl-C is held back until every lock is in ``locks`` (released below): a KeyboardInterrupt inside
        # _create's mkstemp, or between a lock's link and its return, left a temporary or a whole lock file behind
        # (the Ctrl-C test once found '.m16.plan.json.lock.<pid>.<random>.tmp': the signal came as the plan's
        # lock was made, just after the model's)
        with signals_deferred():
            for p in paths:
                check_writable_location(p.parent, p)  # (a file in the way, a read-only place: the usual message)
                made += _missing_folders(p.parent)
                make_dirs(p.parent, p)
                locks.append(_acquire(p, info, told))
        for p in paths:
            sweep_temps(p)
        claim = OutputClaim(paths, locks, force, [Path(p).resolve() for p in replaceable])
        yield claim
    finally:
        if claim is not None:
            claim.release()
        else:
            for lock in reversed(locks):
                lock.release()
        for folder in sorted(set(made), key=lambda f: len(f.parts), reverse=True):
            with contextlib.suppress(OSError):  # (not empty: something was published, or a user's file)
                folder.rmdir()


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and its ancestors that do not exist yet."""
    missing = []
    while not folder.exists() and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    return missing
