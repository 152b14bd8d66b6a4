"""The ONNX Runtime engine: a graph optimised offline for one execution provider, plus its session settings.

``build-engine --backend onnxruntime`` (and ``auto`` where TensorRT is absent) runs onnxruntime's graph
optimiser once for the chosen provider (CUDA when usable, else CPU) and saves the result through
``SessionOptions.optimized_model_filepath``: an ORT-format file for ``.ort`` outputs, an optimised ONNX
file for ``.onnx`` outputs (needed for models with external data). The provider list and session settings
go into the sidecar; :class:`OrtEngineRunner` reloads the engine with them and with optimisation switched
off, since the graph is already optimised.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.backends.base import Runner
from mpinfer.engine.config import BuildConfig
from mpinfer.errors import BackendUnavailableError, InvalidInputError, ModelLoadError, format_message
from mpinfer.fileio import make_temp_dir
from mpinfer.modelio import data_file, ort_log_level
from mpinfer.specs import TensorSpec

logger = logging.getLogger(__name__)

# --opt-level -> onnxruntime GraphOptimizationLevel: 0 none, 1 constant folding and redundant-node removal,
# 2 + op fusions, 3..5 + layout (NCHWc) and provider-specific optimisations.
ORT_OPT_LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")
# Initializers at least this large go to the external data file of an optimised .onnx engine.
EXTERNAL_INITIALIZER_MIN_BYTES = 1024
ENGINE_SUFFIXES = (".ort", ".onnx")


def ort_opt_level_name(opt_level: int) -> str:
    """The GraphOptimizationLevel name for a 0-5 ``--opt-level``."""
    return ORT_OPT_LEVELS[min(opt_level, len(ORT_OPT_LEVELS) - 1)]


def engine_format(output: Path) -> str:
    """``ort`` or ``onnx`` from the output suffix.

    Raises:
        InvalidInputError: Any other suffix.
    """
    suffix = output.suffix.lower()
    if suffix not in ENGINE_SUFFIXES:
        raise InvalidInputError(
            format_message(
                f"ONNX Runtime engine path '{output}'",
                f"suffix '{output.suffix}'",
                "'.ort' or '.onnx'",
                "use .ort (ORT format) or .onnx (optimised ONNX, needed for models with external data); "
                ".engine/.plan are TensorRT engines",
            )
        )
    return suffix[1:]


def provider_entries(device: str) -> tuple[list[str], list[dict[str, str]]]:
    """Provider names and options for ``cpu``, ``cuda`` or ``cuda:N``."""
    if device.startswith("cuda"):
        idx = device.split(":", 1)[1] if ":" in device else "0"
        return ["CUDAExecutionProvider", "CPUExecutionProvider"], [{"device_id": idx}, {}]
    return ["CPUExecutionProvider"], [{}]


def _uses_external_data(model: Any) -> bool:
    from onnx.external_data_helper import uses_external_data

    return any(uses_external_data(t) for t in model.graph.initializer)


def _session_entries(fmt: str, external: bool, data_name: str) -> dict[str, str]:
    entries: dict[str, str] = {}
    if fmt == "ort":
        entries["session.save_model_format"] = "ORT"
    if fmt == "onnx" and external:
        entries["session.optimized_model_external_initializers_file_name"] = data_name
        entries["session.optimized_model_external_initializers_min_size_in_bytes"] = str(
            EXTERNAL_INITIALIZER_MIN_BYTES
        )
    return entries


def _optimise(model_path: Path, tmp: Path, level: str, entries: dict[str, str], device: str) -> float:
    """Run onnxruntime's optimiser once, saving the optimised graph to ``tmp``; returns the seconds."""
    import onnxruntime as ort

    providers, options = provider_entries(device)
    so = ort.SessionOptions()
    so.log_severity_level = ort_log_level()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.optimized_model_filepath = str(tmp)
    # The saved graph is what this session is for: no packed copies of the weights for kernels it never runs
    # (they doubled the peak memory of a build; a session loading the engine packs them itself).
    so.add_session_config_entry("session.disable_prepacking", "1")
    for key, value in entries.items():
        so.add_session_config_entry(key, value)
    logger.info("Optimising %s for %s (%s) ...", model_path, providers[0], level)
    start = time.perf_counter()
    try:
        ort.InferenceSession(str(model_path), so, providers=providers, provider_options=options)
    except Exception as err:  # onnxruntime raises Fail/InvalidGraph/NotImplemented...
        raise ModelLoadError(
            format_message(
                f"ONNX Runtime could not optimise '{model_path}'", str(err), "a model onnxruntime can load"
            )
        ) from err
    if not tmp.is_file():
        raise ModelLoadError(
            format_message(
                f"ONNX Runtime engine for '{model_path}'",
                "no optimised file",
                f"{tmp.name} written by onnxruntime {ort.__version__}",
            )
        )
    return time.perf_counter() - start


def build_ort_engine(
    cfg: BuildConfig, model_path: Path, model: Any, output: Path, device: str
) -> dict[str, Any]:
    """Optimise ``model_path`` for ``device``'s provider and save it to ``output`` (atomically).

    Returns:
        The ``onnxruntime`` section of the sidecar (version, providers, session settings).

    Raises:
        InvalidInputError: An ``.ort`` output for a model with external data.
        ModelLoadError: onnxruntime refuses the model.
    """
    import onnxruntime as ort

    fmt = engine_format(output)
    external = _uses_external_data(model)
    if fmt == "ort" and external:
        raise InvalidInputError(
            format_message(
                f"ONNX Runtime engine path '{output}'",
                "an .ort output for a model with external data",
                "an .onnx output",
                f"use -o {output.with_name(output.name + '.onnx')} (the ORT format holds at most 2 GB)",
            )
        )
    providers, options = provider_entries(device)
    level = ort_opt_level_name(cfg.opt_level)
    data_name = data_file(output).name
    entries = _session_entries(fmt, external, data_name)
    tmpdir = make_temp_dir(output)
    try:
        seconds = _optimise(model_path, tmpdir / output.name, level, entries, device)
        if (tmpdir / data_name).exists():
            os.replace(tmpdir / data_name, output.parent / data_name)
        os.replace(tmpdir / output.name, output)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    logger.info("Optimised %s in %.1f s -> %s", model_path, seconds, output)
    return {
        "version": ort.__version__,
        "format": fmt,
        "providers": providers,
        "provider_options": options,
        "graph_optimization_level": level,
        "session_config": entries,
        # The saved graph is already optimised: reload it without optimisation (faster, same graph).
        "load_graph_optimization_level": "ORT_DISABLE_ALL",
        "external_data": data_name if external and (output.parent / data_name).exists() else None,
        "build_seconds": round(seconds, 3),
    }


_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


class OrtEngineRunner(Runner):
    """Runs an ONNX Runtime engine with the providers and settings recorded in its sidecar.

    Args:
        path: The ``.ort`` or optimised ``.onnx`` engine.
        settings: The sidecar's ``onnxruntime`` section (None: CPU, defaults).
        name: Display name (defaults to the file name).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        settings: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
    ) -> None:
        super().__init__(name or os.path.basename(str(path)))
        self.path = Path(path)
        self.settings = dict(settings or {})
        self._session: Any = None
        self._specs: list[TensorSpec] = []

    def _activate(self) -> None:
        import onnxruntime as ort

        providers = list(self.settings.get("providers") or ["CPUExecutionProvider"])
        options = list(self.settings.get("provider_options") or [{} for _ in providers])
        missing = [p for p in providers if p not in ort.get_available_providers()]
        if missing:
            raise BackendUnavailableError(
                format_message(
                    f"ONNX Runtime engine '{self.path}'",
                    f"providers {providers}",
                    f"providers available here ({ort.get_available_providers()})",
                    "rebuild the engine on this machine with mpinfer build-engine --backend onnxruntime",
                )
            )
        so = ort.SessionOptions()
        so.log_severity_level = ort_log_level()
        so.graph_optimization_level = getattr(
            ort.GraphOptimizationLevel, self.settings.get("load_graph_optimization_level", "ORT_DISABLE_ALL")
        )
        if self.settings.get("format", self.path.suffix.lstrip(".")) == "ort":
            so.add_session_config_entry("session.load_model_format", "ORT")
        try:
            self._session = ort.InferenceSession(
                str(self.path), so, providers=providers, provider_options=options
            )
        except Exception as err:
            raise ModelLoadError(
                format_message(
                    f"ONNX Runtime engine '{self.path}'",
                    f"a load failure ({err})",
                    "an engine written by mpinfer build-engine",
                    "rebuild it with mpinfer build-engine --force",
                )
            ) from err
        self._specs = []
        for i in self._session.get_inputs():
            shape = tuple(
                d if isinstance(d, int) and d > 0 else (d if isinstance(d, str) else f"dim{k}")
                for k, d in enumerate(i.shape)
            )
            self._specs.append(TensorSpec(i.name, shape, np.dtype(_ORT_TYPES.get(i.type, np.float32))))

    def input_specs(self) -> list[TensorSpec]:
        """The engine's inputs."""
        return list(self._specs)

    def output_names(self) -> list[str]:
        """The engine's outputs, in order."""
        return [o.name for o in self._session.get_outputs()]

    def _infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = self.output_names()
        return dict(
            zip(names, self._session.run(names, {k: np.asarray(v) for k, v in feeds.items()}), strict=False)
        )

    def _deactivate(self) -> None:
        self._session = None

    def describe(self) -> dict[str, Any]:
        """Backend facts: providers actually used and the numerics they imply."""
        info = super().describe()
        providers = (
            self._session.get_providers() if self._session is not None else self.settings.get("providers", [])
        )
        info.update(
            {
                "backend": "onnxruntime-engine",
                "engine": str(self.path),
                "providers": providers,
                "graph_optimization_level": self.settings.get("graph_optimization_level"),
                "numerics": "ort-cuda"
                if providers and providers[0] == "CUDAExecutionProvider"
                else "ort-cpu",
            }
        )
        return info
