"""Torch runner: runs the unexported ``nn.Module`` (the true FP32 reference) on numpy feeds.

A model comes from a ``"file.py:factory"`` spec, optionally with weights (``"file.py:factory@weights.pt"``,
loaded with ``torch.load(weights_only=True)``; a training checkpoint's ``"model"`` entry is used), or from an
already loaded ``nn.Module``. Inputs are passed positionally in the order of :meth:`TorchRunner.input_specs`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.backends.base import Runner
from mpinfer.errors import BackendUnavailableError, InvalidInputError, ModelLoadError, format_message
from mpinfer.export.loader import load_model
from mpinfer.specs import TensorSpec, parse_tensor_spec

logger = logging.getLogger(__name__)

_SPEC_HINT = "write path/to/file.py:factory or path/to/file.py:factory@weights.pt"


def parse_torch_spec(spec: str) -> tuple[Path, str, Path | None]:
    """Split ``file.py:factory[@weights]`` into its parts.

    Raises:
        InvalidInputError: When the spec is malformed or a file is missing.
    """
    text, _, weights = spec.partition("@")
    path, sep, factory = text.rpartition(":")
    if not sep or not path.endswith(".py") or not factory.isidentifier():
        raise InvalidInputError(
            format_message(f"Torch model spec '{spec}'", None, "file.py:factory", _SPEC_HINT)
        )
    file = Path(path)
    if not file.is_file():
        raise ModelLoadError(
            format_message(f"Torch model file '{path}'", "no such file", "an existing .py file")
        )
    wpath = Path(weights) if weights else None
    if wpath is not None and not wpath.is_file():
        raise ModelLoadError(format_message(f"Weights '{weights}'", "no such file", "an existing checkpoint"))
    return file, factory, wpath


def load_torch_module(spec: str) -> tuple[Any, list[TensorSpec]]:
    """Build the module of a ``file.py:factory[@weights]`` spec.

    Returns:
        The module in eval mode, and the file's ``INPUT_SPECS`` (empty when it has none).

    Raises:
        ModelLoadError: When the file, factory or weights cannot be loaded.
    """
    try:
        import torch  # noqa: F401 - fail early with an install hint
    except ImportError as err:
        raise BackendUnavailableError("The torch runner needs torch. Hint: pip install torch") from err

    file, factory, weights = parse_torch_spec(spec)
    loaded = load_model(f"{file}:{factory}", weights)
    specs = [parse_tensor_spec(s) for s in loaded.input_specs]
    return loaded.module.eval(), specs


class TorchRunner(Runner):
    """Runs a torch ``nn.Module`` (given, or built from a ``file.py:factory[@weights]`` spec).

    Args:
        model: An ``nn.Module`` or a spec string.
        input_specs: Input specs; default: the model file's ``INPUT_SPECS``.
        output_names: Names for the outputs (in order); default ``output_0``, ``output_1``, ...
        device: ``cpu``, ``cuda`` or ``auto``.
        name: Display name.
    """

    def __init__(
        self,
        model: Any,
        *,
        input_specs: Sequence[TensorSpec] | None = None,
        output_names: Sequence[str] | None = None,
        device: str = "cpu",
        name: str | None = None,
    ) -> None:
        super().__init__(name or (model if isinstance(model, str) else type(model).__name__))
        self._source = model
        self._given_specs = list(input_specs) if input_specs else None
        self._output_names = list(output_names) if output_names else None
        self.device = device
        self._module: Any = None
        self._specs: list[TensorSpec] = []
        self._torch_device = "cpu"

    def _activate(self) -> None:
        import torch

        if isinstance(self._source, str):
            module, file_specs = load_torch_module(self._source)
        else:
            module, file_specs = self._source, []
        self._specs = self._given_specs or file_specs
        if not self._specs:
            raise InvalidInputError(
                format_message(
                    f"Torch model '{self.name}'",
                    "no input specs",
                    "INPUT_SPECS in the model file, or input_specs=",
                    "add INPUT_SPECS = ['x:batchx3x64x64:float32'] to the file",
                )
            )
        if self.device == "auto":
            self._torch_device = "cuda" if torch.cuda.is_available() else "cpu"
        elif self.device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError(
                format_message("Torch CUDA device", "no visible GPU", "a CUDA GPU", "use --device cpu")
            )
        else:
            self._torch_device = self.device
        self._module = module.to(self._torch_device).eval()

    def input_specs(self) -> list[TensorSpec]:
        """The model's inputs (from the model file or the constructor)."""
        return list(self._specs if self.is_active else (self._given_specs or []))

    def output_names(self) -> list[str]:
        """Output names; known once given or after the first inference."""
        return list(self._output_names or [])

    def set_output_names(self, names: Sequence[str]) -> None:
        """Name the outputs (e.g. after the ONNX model the module was exported to)."""
        self._output_names = list(names)

    def _infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        args = [
            torch.from_numpy(np.ascontiguousarray(feeds[s.name])).to(self._torch_device) for s in self._specs
        ]
        with torch.inference_mode():
            out = self._module(*args)
        flat = _flatten_outputs(out)
        if self._output_names is None or len(self._output_names) != len(flat):
            if self._output_names is not None:
                logger.warning(
                    "Torch model '%s' returned %d outputs for %d names; using positional names",
                    self.name,
                    len(flat),
                    len(self._output_names),
                )
            self._output_names = [f"output_{i}" for i in range(len(flat))]
        return {
            n: t.detach().float().cpu().numpy() if t.is_floating_point() else t.detach().cpu().numpy()
            for n, t in zip(self._output_names, flat, strict=True)
        }

    def _deactivate(self) -> None:
        self._module = None

    def describe(self) -> dict[str, Any]:
        """Backend facts for reports."""
        import torch

        info = super().describe()
        info.update(
            {
                "backend": "torch",
                "torch": torch.__version__,
                "device": self._torch_device,
                "numerics": f"torch-{self._torch_device}-fp32",
            }
        )
        return info


def _flatten_outputs(out: Any) -> list[Any]:
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _flatten_outputs(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _flatten_outputs(v)]
    raise ModelLoadError(
        f"Torch model returned a {type(out).__name__}; expected tensors (or tuples/dicts of them)."
    )
