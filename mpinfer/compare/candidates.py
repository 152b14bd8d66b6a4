"""What compare checks about its candidates before running them: a valid model, not the baseline itself."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from mpinfer.errors import ModelLoadError, format_message
from mpinfer.fileio import sha256_file
from mpinfer.precision.graph import validity_failures

logger = logging.getLogger(__name__)


def check_valid_candidate(spec: str, baseline: str) -> None:
    """Refuse an ONNX candidate that is not a valid, loadable model, whatever the numerics that will run it.

    The strict emulator would run an invalid file (a float16 tensor where its consumer takes float32) and pass
    it; ONNX Runtime refuses to load it. So an ONNX candidate run outside ONNX Runtime goes through the validity
    gate convert applies to what it writes (full checker, strict type inference, an ONNX Runtime load; a kernel
    the CPU provider lacks, such as BF16 Conv, is not held against it); a check the baseline fails too is not held
    against it.

    Raises:
        ModelLoadError: Naming the candidate, the failed check and its node.
    """
    base = Path(baseline)
    failures = validity_failures(None, path=Path(spec),
                                 baseline_path=base if base.suffix.lower() == ".onnx" and base.is_file() else None)
    if failures:
        f = failures[0]
        where = f" at node '{f.node}'" if f.node else ""
        raise ModelLoadError(format_message(
            f"Candidate '{spec}'", f"an invalid ONNX model (the {f.check} check fails{where}: "
            f"{' '.join(f.message.split())[:400]})", "a valid model that ONNX Runtime loads",
            "whatever --numerics runs it, an invalid file is refused; convert the baseline again (mpinfer convert) "
            "or fix the tool that wrote it"))


def baseline_copies(baseline: str, candidates: Sequence[str]) -> list[str]:
    """A note (and a warning, once) for each candidate that is the baseline's own file, or a byte-identical copy."""
    base = Path(baseline)
    if not base.is_file():
        return []
    notes = []
    for cand in candidates:
        c = Path(cand)
        if not c.is_file():
            continue
        if c.resolve() == base.resolve():
            what = "the same file"
        elif c.stat().st_size == base.stat().st_size and sha256_file(c) == sha256_file(base):
            what = "a byte-identical copy"
        else:
            continue
        note = (f"Candidate '{cand}' is the baseline itself ({what}): it measures nothing but the runners; "
                "pass the converted model (e.g. the output of mpinfer convert) as a candidate.")
        logger.warning(note)
        notes.append(note)
    return notes
