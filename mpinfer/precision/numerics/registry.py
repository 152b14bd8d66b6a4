"""The one place a ``--numerics`` name becomes an evaluator class."""

from __future__ import annotations

from typing import Any

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.precision.numerics.ort import OrtCudaEvaluator, OrtEvaluator
from mpinfer.precision.numerics.strict import StrictEvaluator
from mpinfer.precision.numerics.tensorrt import TensorRtEvaluator

EVALUATORS: dict[str, type[Any]] = {
    StrictEvaluator.name: StrictEvaluator,
    OrtEvaluator.name: OrtEvaluator,
    OrtCudaEvaluator.name: OrtCudaEvaluator,
    TensorRtEvaluator.name: TensorRtEvaluator,
}


def evaluator_class(numerics: str) -> type[Any]:
    """The evaluator class of a ``--numerics`` value (``strict``, ``ort``, ``ort-cuda``, ``tensorrt``).

    Raises:
        InvalidInputError: An unknown name.
    """
    try:
        return EVALUATORS[numerics]
    except KeyError:
        raise InvalidInputError(format_message("--numerics", repr(numerics), " or ".join(EVALUATORS))) from None


def check_numerics(numerics: str) -> None:
    """Refuse an unknown ``--numerics`` name, or numerics this machine cannot run; before any work.

    Raises:
        InvalidInputError: An unknown name.
        BackendUnavailableError: The numerics' runtime or GPU is missing here (``ort-cuda``, ``tensorrt``).
    """
    evaluator_class(numerics).check_available()
