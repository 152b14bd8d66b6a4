"""The Runner template every backend follows (activate / infer / deactivate, context manager).

Public methods check state and validate inputs, then call the subclass hooks ``_activate``, ``_infer`` and
``_deactivate``. Input validation gives messages of the form what → received → expected → hint.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mpinfer.errors import InternalError, InvalidInputError, format_message
from mpinfer.specs import TensorSpec

logger = logging.getLogger(__name__)


class Runner(abc.ABC):
    """Runs a model on feeds ``{input name: array}`` and returns ``{output name: array}``.

    Use as a context manager::

        with OrtRunner("model.onnx") as runner:
            outputs = runner.infer({"x": x})
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.is_active = False
        self.last_inference_time: float | None = None

    # -- public API -------------------------------------------------------------------------------
    def activate(self) -> None:
        """Load the model and allocate resources. Calling it twice is an error."""
        if self.is_active:
            raise InternalError(f"Runner '{self.name}' is already active: activate() was called twice. This is a bug "
                                "in the code driving the runner; deactivate() it first, or use one `with` block.")
        self._activate()
        self.is_active = True

    def deactivate(self) -> None:
        """Release resources. Calling it on an inactive runner is an error."""
        if not self.is_active:
            raise InternalError(f"Runner '{self.name}' is not active: deactivate() without activate(). This is a bug "
                                "in the code driving the runner.")
        try:
            self._deactivate()
        finally:
            self.is_active = False

    def infer(self, feeds: Mapping[str, np.ndarray], *, check_inputs: bool = True) -> dict[str, np.ndarray]:
        """Run one inference.

        Args:
            feeds: Input name → array.
            check_inputs: Validate names, dtypes and shapes against :meth:`input_specs` first.

        Returns:
            Output name → array, in the model's output order.
        """
        if not self.is_active:
            raise InternalError(f"Runner '{self.name}' is not active: infer() before activate(). This is a bug in the "
                                "code driving the runner; use it in a `with` block or activate() it first.")
        if check_inputs:
            check_feeds(feeds, self.input_specs(), where=f"runner '{self.name}'")
        start = time.perf_counter()
        out = self._infer(feeds)
        self.last_inference_time = time.perf_counter() - start
        return out

    @abc.abstractmethod
    def input_specs(self) -> list[TensorSpec]:
        """The model's inputs (only valid while active)."""

    def output_names(self) -> list[str]:
        """The model's output names, in order (only valid while active)."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """Backend, device and numerics facts for reports (override to add more)."""
        return {"runner": type(self).__name__, "name": self.name}

    # -- hooks --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _activate(self) -> None: ...

    @abc.abstractmethod
    def _infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def _deactivate(self) -> None:
        return None

    def __enter__(self) -> Runner:
        self.activate()
        return self

    def __exit__(self, *exc: object) -> None:
        self.deactivate()


def check_feeds(feeds: Mapping[str, Any], specs: Sequence[TensorSpec], *, where: str = "model") -> None:
    """Validate feed names, dtypes and shapes against specs.

    Raises:
        InvalidInputError: Naming the first input that is missing, unexpected or mismatched.
    """
    names = [s.name for s in specs]
    missing = [n for n in names if n not in feeds]
    extra = [n for n in feeds if n not in names]
    if missing or extra:
        raise InvalidInputError(
            format_message(
                f"Inputs for {where}",
                f"names {sorted(feeds)}",
                f"names {names}",
                ("missing: " + ", ".join(missing) + ". " if missing else "")
                + ("unexpected: " + ", ".join(extra) + ". " if extra else "")
                + "Rename the arrays in your data (.npz keys) to the model's input names.",
            )
        )
    for spec in specs:
        arr = np.asarray(feeds[spec.name])
        if arr.dtype != spec.dtype:
            raise InvalidInputError(
                format_message(f"Input '{spec.name}' for {where}", f"dtype {arr.dtype}", f"{spec.dtype}",
                               "cast your data (e.g. in the .npz) to the model's input dtype")
            )
        if not spec.matches(arr.shape):
            raise InvalidInputError(
                format_message(f"Input '{spec.name}' for {where}", f"shape {tuple(arr.shape)}",
                               f"{tuple(spec.shape)} (str dims are dynamic)",
                               "check the data's layout and batch dimension")
            )
