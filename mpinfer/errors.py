"""Exceptions: user mistakes (``MpinferError``) versus bugs (anything else).

The CLI turns an ``MpinferError`` into a single ``Error: <message>`` line and exit code 1; any other
exception is a bug in mpinfer and keeps its traceback. Messages follow the form
*what → received → expected → hint*; :func:`format_message` builds them.
"""

from __future__ import annotations


class MpinferError(Exception):
    """A problem the user can fix (bad input, missing optional dependency, failed check)."""

    def __init__(self, message: str) -> None:
        if not message:
            raise ValueError("MpinferError needs a message")
        super().__init__(message)


class InvalidInputError(MpinferError):
    """A file, argument, spec or data set does not have the form mpinfer expects."""


class ModelLoadError(MpinferError):
    """A model (torch, ONNX or engine) could not be loaded."""


class BackendUnavailableError(MpinferError):
    """An optional backend (TensorRT, CUDA, a provider) is not available on this machine."""


class AccuracyMismatchError(MpinferError):
    """Outputs differ from the reference by more than the tolerance or budget allows."""


class ExportError(MpinferError):
    """The torch model could not be exported to ONNX."""


class InternalError(Exception):
    """An mpinfer bug caught at a known place (e.g. the validity gate); always shows its traceback."""


def format_message(what: str, received: object = None, expected: object = None, hint: str | None = None) -> str:
    """Build a message of the form ``what: received X, expected Y. Hint: Z``.

    Args:
        what: The thing that is wrong, e.g. ``"Input 'x'"``.
        received: What was received (omitted when None).
        expected: What was expected (omitted when None).
        hint: How to fix it (omitted when None).

    Returns:
        The message.
    """
    details = []
    if received is not None:
        details.append(f"received {received}")
    if expected is not None:
        details.append(f"expected {expected}")
    msg = what + (": " + ", ".join(details) if details else "")
    if not msg.endswith("."):
        msg += "."
    if hint:
        msg += f" Hint: {hint}"
    return msg
