"""Atomic writes and output-path checks shared by every stage.

Every file mpinfer writes goes through here: it is written to a temporary file in the same folder and
renamed into place, so a crash or an error never leaves a half-written file, and an input file is never
overwritten.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mpinfer.errors import InvalidInputError, MpinferError, format_message


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
        InvalidInputError: If the output is an input, a folder, or exists without ``force``.
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
    return out


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` if the block succeeds.

    Args:
        path: The final destination.

    Yields:
        A temporary path in the same folder to write to.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
    try:
        yield tmp_path
        os.replace(tmp_path, dest)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
