"""Atomic writes, temporaries and output-path checks shared by every stage.

Every file mpinfer writes goes through here: it is written to a temporary file in the same folder and
renamed into place, so a crash or an error never leaves a half-written file, and an input file is never
overwritten. Temporaries carry their owner's pid (:func:`temp_prefix`), so :func:`sweep_temps` can remove
those of processes that are gone. Outputs of a command are claimed and published as one unit by
:mod:`mpinfer.claim`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mpinfer.errors import InvalidInputError, MpinferError, format_message

logger = logging.getLogger(__name__)

# Suffix of every temporary file and folder (after the owner's pid and a random part, see temp_prefix).
TEMP_SUFFIX = ".tmp"


def check_output_path(
    output: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str] | None] = (),
    *,
    force: bool = False,
) -> Path:
    """Refuse an output path that equals an input, or that exists without ``force``.

    Args:
        output: The path about to be written.
        inputs: Paths read by the same command (None entries are ignored).
        force: Allow overwriting an existing output that is not an input.

    Returns:
        The output path, resolved.

    Raises:
        InvalidInputError: If the output is an input, a folder, exists without ``force``, or lies where
            nothing can be written (see :func:`check_writable_location`).
    """
    out = Path(output).expanduser().resolve()
    for inp in inputs:
        if inp is None:
            continue
        if Path(inp).expanduser().resolve() == out:
            raise InvalidInputError(
                format_message(
                    f"Output path '{output}'",
                    "the same path as an input",
                    "a new file",
                    "choose another -o/--output; mpinfer never overwrites its input",
                )
            )
    if out.is_dir():
        raise InvalidInputError(
            format_message(f"Output path '{output}'", "an existing folder", "a file path", "add a file name")
        )
    if out.exists() and not force:
        raise InvalidInputError(
            format_message(
                f"Output file '{output}'", "an existing file", "a new path", "pass --force to overwrite it"
            )
        )
    check_writable_location(out.parent, output)
    return out


def _unwritable(what: object, err: OSError, where: object = None) -> InvalidInputError:
    """The error for an output location that refuses writes; ``where`` replaces the path ``err`` names."""
    place = where if where is not None else err.filename
    detail = f"{type(err).__name__}: {err.strerror or err}" + (f": '{place}'" if place is not None else "")
    return InvalidInputError(
        format_message(
            f"Output '{what}'",
            f"a location that cannot be written ({detail})",
            "a writable folder",
            "write to a folder you can create files in",
        )
    )


def check_writable_location(folder: str | os.PathLike[str], what: object = None) -> None:
    """Refuse a folder that cannot be created or written to, before any long work starts.

    The nearest existing ancestor of ``folder`` must be a folder in which a file can be created (a probe
    file is created and removed at once); nothing else is created. Permissions alone do not tell: root may
    write anywhere by mode bits, yet not into ``/proc``.

    Args:
        folder: The folder an output will be written into (it need not exist yet).
        what: The output as the user gave it, for the message (default: ``folder``).

    Raises:
        InvalidInputError: If a path component is a file, or the location refuses new files.
    """
    what = folder if what is None else what
    probe_dir = Path(folder).expanduser().absolute()
    while not probe_dir.exists() and not probe_dir.is_symlink() and probe_dir.parent != probe_dir:
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        err = NotADirectoryError(errno.ENOTDIR, "a file stands where a folder is needed", str(probe_dir))
        raise _unwritable(what, err)
    try:
        with signals_deferred():  # a Ctrl-C between create and unlink would leave the probe behind
            fd, probe = tempfile.mkstemp(prefix=".mpinfer-probe-", dir=probe_dir)
            try:
                os.close(fd)
            finally:
                os.unlink(probe)
    except OSError as err:
        raise _unwritable(what, err, where=probe_dir) from err


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for a few system calls: they are handled, as usual, when the block ends.

    Python runs signal handlers in the main thread between bytecodes, whichever thread the signal reached, so
    a thread's signal mask cannot keep a KeyboardInterrupt out of a block once other threads (ONNX Runtime's,
    torch's) exist. The handlers are swapped instead for one that only records; on exit the real ones are put
    back and each recorded signal is raised again. Outside the main thread (where handlers cannot be set),
    nothing is held.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def record(signum: int, frame: object) -> None:
        caught.append(signum)

    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, record) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def make_dirs(folder: str | os.PathLike[str], what: object = None) -> Path:
    """Create ``folder`` and its parents (if missing), as a clear error when that is impossible.

    Args:
        folder: The folder to create.
        what: The output as the user gave it, for the message (default: ``folder``).

    Returns:
        The folder.

    Raises:
        InvalidInputError: If the folder cannot be created (a file in the way, a read-only or virtual
            file system, no permission).
    """
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _unwritable(folder if what is None else what, err) from err
    return path


def temp_prefix(dest: str | os.PathLike[str]) -> str:
    """The name every temporary file or folder of ``dest`` starts with: ``.<name>.<pid>.`` (then random, ``.tmp``).

    The owner's pid in the name lets a later run tell a leftover of a killed process (swept, see
    :func:`sweep_temps`) from the work of a live one (never touched).
    """
    return f".{Path(dest).name}.{os.getpid()}."


def make_temp_dir(dest: str | os.PathLike[str]) -> Path:
    """A new temporary folder next to the file ``dest`` (its folder created), as a clear error when impossible.

    For writers that stage several files (a model and its external data) before renaming them into place.

    Raises:
        InvalidInputError: If the folder or the temporary folder cannot be created.
    """
    out = Path(dest)
    make_dirs(out.parent, dest)
    try:
        return Path(tempfile.mkdtemp(prefix=temp_prefix(out), suffix=TEMP_SUFFIX, dir=out.parent))
    except OSError as err:
        raise _unwritable(dest, err, where=out.parent) from err


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` if the block succeeds.

    Args:
        path: The final destination.

    Yields:
        A temporary path in the same folder to write to.

    Raises:
        InvalidInputError: If the folder cannot be created, the temporary file cannot be made there, or the
            rename fails (a file in the way, a read-only or virtual file system, ``path`` is a folder).
    """
    dest = Path(path)
    make_dirs(dest.parent, path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(dest), suffix=TEMP_SUFFIX, dir=dest.parent)
    except OSError as err:
        raise _unwritable(path, err, where=dest.parent) from err
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        os.chmod(tmp_path, user_file_mode())  # mkstemp makes 0600; outputs get the usual permissions
        yield tmp_path
        try:
            os.replace(tmp_path, dest)
        except OSError as err:
            raise _unwritable(path, err, where=dest) from err
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def user_file_mode() -> int:
    """The mode of a new file the user creates: ``0o666`` less the process umask (read without changing it)."""
    try:  # Linux: the umask without the umask(0)/umask(mask) dance, which races with other threads
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and return the path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically and return the path."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented, key-stable JSON to ``path`` atomically and return the path."""
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def read_json(
    path: str | os.PathLike[str],
    what: str,
    expected: str,
    *,
    error: type[MpinferError] = InvalidInputError,
    hint: str | None = None,
) -> dict[str, Any]:
    """Read a JSON object written by mpinfer, with one clear error for every way it can be wrong.

    Args:
        path: The file.
        what: What it is, for the message (``"Plan"``, ``"Report"``).
        expected: What a good file is (``"a .plan.json written by mpinfer convert"``).
        error: The MpinferError subclass to raise.
        hint: How to fix it.

    Returns:
        The parsed object.

    Raises:
        MpinferError: (of type ``error``) missing, unreadable, not JSON, or not a JSON object.
    """
    p = Path(path)
    if not p.is_file():
        raise error(format_message(f"{what} '{path}'", "no such file", expected, hint))
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise error(format_message(f"{what} '{path}'", f"an unreadable or non-JSON file ({err})", expected,
                                   hint)) from err
    if not isinstance(data, dict):
        raise error(format_message(f"{what} '{path}'", f"a JSON {type(data).__name__}", f"a JSON object: {expected}",
                                   hint))
    return data


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Return the hex sha256 of a file, read in 1 MiB chunks."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie (a killed, unreaped child is gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[A-Za-z0-9_]+" + re.escape(TEMP_SUFFIX) + "$")


def sweep_temps(output: Path) -> list[Path]:
    """Remove the temporaries of ``output`` left by processes that are gone; say so; return what went.

    Only names of the form ``.<name>.<pid>.<random>.tmp`` are considered, and only those whose pid is not a live
    process on this host (this process's own are kept).
    """
    removed = []
    try:
        entries = list(output.parent.iterdir())
    except OSError:
        return []
    for entry in entries:
        m = _TEMP_NAME.match(entry.name)
        if m is None or m["name"] not in (output.name, f"{output.name}.lock"):  # its temporary lock file too
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or pid_alive(pid):
            continue
        size = _size(entry)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        logger.warning("Removed '%s' (%s), a temporary of '%s' left by pid %d, which is gone",
                       entry, _human(size), output.name, pid)
        removed.append(entry)
    return removed


def discard(path: Path) -> None:
    """Remove the file or folder ``path`` all at once: renamed to a temporary name first, then deleted.

    A process killed while deleting leaves a temporary (swept by the next run), never half of ``path``.
    """
    if not path.exists() and not path.is_symlink():
        return
    gone = path.with_name(f"{temp_prefix(path)}{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")
    os.rename(path, gone)
    if gone.is_dir() and not gone.is_symlink():
        shutil.rmtree(gone, ignore_errors=True)
    else:
        gone.unlink(missing_ok=True)


def _size(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file())


def _human(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.0f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} bytes"  # pragma: no cover
