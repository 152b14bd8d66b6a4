"""Reports of a comparison: console (rich), JSON (versioned), Markdown and one self-contained HTML file.

:func:`write_report` writes the files of a :class:`~mpinfer.compare.ComparisonResult` (or its JSON dict);
:func:`load_report` reads a ``report.json`` back, refusing newer schema versions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mpinfer.claim import OutputClaim, claim_outputs
from mpinfer.compare.result import ComparisonResult
from mpinfer.errors import InvalidInputError, format_message
from mpinfer.fileio import check_output_path, read_json
from mpinfer.report.html import render_html
from mpinfer.report.markdown import render_markdown

logger = logging.getLogger(__name__)

# Report files by format, inside the report folder.
FILE_NAMES = {"json": "report.json", "md": "report.md", "html": "index.html"}
FORMATS = ("html", "md", "json", "console")


def _as_result(result_or_dict: ComparisonResult | Mapping[str, Any]) -> ComparisonResult:
    if isinstance(result_or_dict, ComparisonResult):
        return result_or_dict
    return ComparisonResult.from_dict(result_or_dict)


def render(result_or_dict: ComparisonResult | Mapping[str, Any], fmt: str) -> str:
    """The report as text in one format (``html``, ``md`` or ``json``).

    Raises:
        InvalidInputError: For an unknown format.
    """
    result = _as_result(result_or_dict)
    if fmt == "json":
        return json.dumps(result.to_dict(), indent=2) + "\n"
    if fmt == "md":

        return render_markdown(result)
    if fmt == "html":

        return render_html(result)
    raise InvalidInputError(format_message("Report format", repr(fmt), "one of html, md, json"))


def write_report(
    result_or_dict: ComparisonResult | Mapping[str, Any],
    out_dir: str | os.PathLike[str],
    formats: Sequence[str] = ("html", "md", "json"),
    *,
    force: bool = False,
    claim: OutputClaim | None = None,
) -> dict[str, Path]:
    """Write the report files into ``out_dir`` (``index.html``, ``report.md``, ``report.json``).

    Every path is checked before anything is written, and the files are published together (all or none).

    Args:
        result_or_dict: The result, or its ``to_dict()`` form.
        out_dir: Folder to write into (created if missing).
        formats: Any of ``html``, ``md``, ``json``.
        force: Overwrite existing report files.
        claim: The files' claim when the caller took it before its work (``compare --report``); None: claimed
            here.

    Returns:
        Format → written path.

    Raises:
        InvalidInputError: For an unknown format, or existing files without ``force``.
        OutputBusyError: Another run is writing these files.
    """
    result = _as_result(result_or_dict)
    unknown = [f for f in formats if f not in FILE_NAMES]
    if unknown:
        raise InvalidInputError(format_message("Report formats", unknown, "any of " + ", ".join(FILE_NAMES)))
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise InvalidInputError(format_message(f"Report folder '{out_dir}'", "an existing file", "a folder"))
    paths = {f: check_output_path(folder / FILE_NAMES[f], force=force) for f in formats}
    texts = {f: render(result, f) for f in formats}  # render all before writing any
    with contextlib.ExitStack() as stack:
        if claim is None:
            claim = stack.enter_context(claim_outputs(list(paths.values()), force=force))
        for f, p in paths.items():
            claim.stage(p).write_text(texts[f], encoding="utf-8")
        claim.publish()  # every format or none
    for p in paths.values():
        logger.info("wrote %s", p)
    return paths


def load_report(path: str | os.PathLike[str]) -> ComparisonResult:
    """Read a ``report.json``.

    Raises:
        InvalidInputError: Missing or malformed file, or a newer schema version.
    """
    data = read_json(path, "Report", "a report.json written by mpinfer compare")
    return ComparisonResult.from_dict(data, origin=str(path))


__all__ = ["FILE_NAMES", "FORMATS", "load_report", "render", "write_report"]
