"""Build a TensorRT engine from a (mixed-precision) ONNX model, on TensorRT 10.x and 11.x.

TensorRT 11 removed weak typing: ``BuilderFlag.FP16``/``BF16`` are gone and every network is strongly
typed, taking its precisions from the ONNX dtypes (the Casts and typed initializers ``convert`` wrote).
TensorRT 10 has both modes: strong typing through ``NetworkDefinitionCreationFlag.STRONGLY_TYPED`` (what
mpinfer uses by default) and the weak builder flags (deprecated since 10.12), offered as ``--fp16/--bf16``.
:func:`plan_network_mode` makes that decision from the version string alone, so it is tested without
TensorRT; :func:`build_trt_engine` applies it with the real API (imported lazily).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpinfer.engine.config import BuildConfig
from mpinfer.engine.machine import STRONG_ONLY_TENSORRT_MAJOR, check_tensorrt_version
from mpinfer.errors import InvalidInputError, MpinferError, format_message
from mpinfer.fileio import write_bytes_atomic
from mpinfer.gpu import GpuInfo, import_tensorrt
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

# Parser errors listed in the message; the rest are counted (a broken graph can yield hundreds).
MAX_LISTED_PARSER_ERRORS = 5


class EngineBuildError(MpinferError):
    """TensorRT (or onnxruntime) refused to build an engine from a model the user supplied."""


@dataclass(frozen=True)
class TrtNetworkMode:
    """How to create the network and configure the builder for one TensorRT version.

    Attributes:
        major: TensorRT major version.
        strongly_typed: Precisions come from the ONNX graph (always on TensorRT 11+).
        network_flags: ``NetworkDefinitionCreationFlag`` member names to set.
        builder_flags: ``BuilderFlag`` member names to set.
        notes: Warnings for the user (weak typing is deprecated).
    """

    major: int
    strongly_typed: bool
    network_flags: tuple[str, ...]
    builder_flags: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """``strongly-typed`` or ``weak (fp16)``-style description for the sidecar."""
        if self.strongly_typed:
            return "strongly-typed"
        return "weak (" + ", ".join(f.lower() for f in self.builder_flags) + ")"


def plan_network_mode(version: str, weak_precisions: Sequence[Precision] = ()) -> TrtNetworkMode:
    """Decide network flags and builder flags for a TensorRT version.

    Args:
        version: ``tensorrt.__version__``.
        weak_precisions: ``--fp16``/``--bf16`` requests.

    Returns:
        The mode.

    Raises:
        BackendUnavailableError: TensorRT older than 10.
        InvalidInputError: Weak flags asked for on TensorRT 11 or newer.
    """
    major = check_tensorrt_version(version)
    weak = tuple(dict.fromkeys(p for p in weak_precisions if p.is_low))
    flags = ", ".join(f"--{p.value}" for p in weak)
    if major >= STRONG_ONLY_TENSORRT_MAJOR:
        if weak:
            raise InvalidInputError(
                format_message(
                    f"{flags} (weak typing)",
                    f"TensorRT {version}",
                    "TensorRT 10.x, the last version with BuilderFlag.FP16/BF16",
                    "TensorRT 11 removed weak typing: every network is strongly typed and takes its "
                    "precisions "
                    "from the ONNX graph. Convert first (mpinfer convert model.onnx --precision fp16 -o "
                    "model.fp16.onnx) and build the converted model without the flag",
                )
            )
        # STRONGLY_TYPED is deprecated and ignored on 11: strong typing is the only mode, so pass no flag.
        return TrtNetworkMode(major, True, (), ())
    if weak:
        note = (
            f"{flags}: weak typing lets TensorRT pick any layer's precision (deprecated since TensorRT "
            "10.12, removed in 11); the precision plan in the ONNX graph is not enforced"
        )
        return TrtNetworkMode(major, False, (), tuple(p.name for p in weak), (note,))
    return TrtNetworkMode(major, True, ("STRONGLY_TYPED",), ())


@dataclass(frozen=True)
class ParserIssue:
    """One error of TensorRT's ONNX parser, with the ONNX node it names.

    Attributes:
        node_index: Index of the node in the graph (-1 when the error is not about a node).
        node_name: The node's name (mpinfer names every node, so this matches the plan and reports).
        op_type: The node's operator.
        code: TensorRT ``ErrorCode`` name.
        desc: TensorRT's description.
    """

    node_index: int
    node_name: str
    op_type: str
    code: str
    desc: str

    @classmethod
    def from_trt(cls, err: Any) -> ParserIssue:
        """Read a ``tensorrt.ParserError`` (``node_name``/``node_operator`` exist since TensorRT 8.6)."""

        def call(attr: str, default: Any) -> Any:
            fn = getattr(err, attr, None)
            try:
                return fn() if callable(fn) else default
            except Exception:  # a binding that raises for errors without a node
                return default

        code = call("code", "")
        return cls(
            node_index=int(call("node", -1)),
            node_name=str(call("node_name", "") or ""),
            op_type=str(call("node_operator", "") or ""),
            code=getattr(code, "name", str(code)),
            desc=str(call("desc", str(err))),
        )

    def __str__(self) -> str:
        where = (
            f"node '{self.node_name or f'#{self.node_index}'}'"
            if self.node_index >= 0 or self.node_name
            else "graph"
        )
        op = f" ({self.op_type})" if self.op_type else ""
        return f"{where}{op}: {self.desc}" + (f" [{self.code}]" if self.code else "")


def format_parser_errors(model: Path, issues: Sequence[ParserIssue]) -> str:
    """One message naming the ONNX nodes TensorRT's parser rejected."""
    listed = "; ".join(str(i) for i in issues[:MAX_LISTED_PARSER_ERRORS])
    more = (
        f" (and {len(issues) - MAX_LISTED_PARSER_ERRORS} more)"
        if len(issues) > MAX_LISTED_PARSER_ERRORS
        else ""
    )
    return format_message(
        f"TensorRT's ONNX parser rejected '{model}'",
        f"{len(issues)} error(s): {listed}{more}",
        "a graph TensorRT supports",
        "keep the named node(s) out of the engine (e.g. replace the op before export), or build an ONNX "
        "Runtime engine with --backend onnxruntime",
    )


def _make_logger(trt: Any) -> Any:
    class _Logger(trt.ILogger):  # type: ignore[misc, name-defined]
        """Forwards TensorRT messages to logging and keeps the errors for our own message."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
                logger.error("TensorRT: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                logger.warning("TensorRT: %s", msg)
            else:
                logger.debug("TensorRT: %s", msg)

    return _Logger()


def _parse_network(trt: Any, builder: Any, model: Path, mode: TrtNetworkMode, trt_logger: Any,
                   graph: bytes | None = None) -> Any:
    """Create the network with the mode's flags and parse the ONNX file (external data from its folder).

    ``graph``: a serialized model to parse instead of the file's (an expanded copy), its external data still
    resolved from ``model``'s folder.
    """
    flags = 0
    for name in mode.network_flags:
        flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, trt_logger)
    parsed = parser.parse_from_file(str(model)) if graph is None else parser.parse(graph, str(model))
    if not parsed:
        issues = [ParserIssue.from_trt(parser.get_error(i)) for i in range(parser.num_errors)]
        raise EngineBuildError(format_parser_errors(model, issues))
    return network, parser  # the parser must outlive the network's use (it owns parsed weights)


def _configure(trt: Any, builder: Any, cfg: BuildConfig, mode: TrtNetworkMode) -> tuple[Any, Any]:
    """Builder config: weak flags (TensorRT 10 only), workspace, optimization level, profile, timing cache."""
    config = builder.create_builder_config()
    for name in mode.builder_flags:
        config.set_flag(getattr(trt.BuilderFlag, name))
    if cfg.workspace is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, cfg.workspace)
    config.builder_optimization_level = cfg.opt_level
    if cfg.shapes:
        profile = builder.create_optimization_profile()
        for p in cfg.shapes:
            profile.set_shape(p.name, p.min, p.opt, p.max)
        config.add_optimization_profile(profile)
    cache = None
    if cfg.timing_cache is not None:
        data = cfg.timing_cache.read_bytes() if cfg.timing_cache.is_file() else b""
        cache = config.create_timing_cache(data)
        config.set_timing_cache(cache, ignore_mismatch=False)
    return config, cache


def build_trt_engine(cfg: BuildConfig, model: Path, output: Path, gpu: GpuInfo,
                     graph: bytes | None = None) -> dict[str, Any]:
    """Parse ``model`` with external data, build a serialized engine and write it to ``output``.

    Args:
        cfg: Build settings (profiles, timing cache, workspace, optimization level, weak flags).
        model: The ONNX file (external data resolved from its folder by ``parse_from_file``).
        graph: The serialized model to parse instead of ``model``'s own bytes (build-engine's expanded copy);
            its external data is resolved from ``model``'s folder.
        output: Engine path, written atomically.
        gpu: The GPU to build for (the current CUDA device is switched to it).

    Returns:
        The ``tensorrt`` and ``io`` sections of the sidecar, and ``notes``.

    Raises:
        EngineBuildError: Parser errors (with node names) or a failed build.
    """
    import torch

    trt: Any = import_tensorrt()
    mode = plan_network_mode(trt.__version__, cfg.weak_precisions)
    for note in mode.notes:
        logger.warning(note)
    trt_logger = _make_logger(trt)
    with torch.cuda.device(gpu.index):
        builder = trt.Builder(trt_logger)
        network, _parser = _parse_network(trt, builder, model, mode, trt_logger, graph)
        config, cache = _configure(trt, builder, cfg, mode)
        start = time.perf_counter()
        logger.info("Building TensorRT %s engine (%s) on %s ...", trt.__version__, mode.label, gpu.name)
        serialized = builder.build_serialized_network(network, config)
        seconds = time.perf_counter() - start
        if serialized is None:
            detail = "; ".join(trt_logger.errors[-3:]) or "see the TensorRT log above"
            raise EngineBuildError(
                format_message(
                    f"TensorRT build of '{model}'",
                    f"a failure ({detail})",
                    "a serialized engine",
                    "check the shape profile and workspace, or rerun with -v",
                )
            )
        write_bytes_atomic(output, bytes(serialized))
        logger.info("Built %s in %.1f s", output, seconds)
        if cache is not None and cfg.timing_cache is not None:
            write_bytes_atomic(cfg.timing_cache, bytes(config.get_timing_cache().serialize()))
        io = _network_io(network)
    section = {
        "version": trt.__version__,
        "mode": mode.label,
        "strongly_typed": mode.strongly_typed,
        "network_flags": list(mode.network_flags),
        "builder_flags": list(mode.builder_flags),
        "build_seconds": round(seconds, 3),
    }
    return {"tensorrt": section, "io": io, "notes": list(mode.notes)}


def _network_io(network: Any) -> dict[str, list[dict[str, Any]]]:
    def describe(t: Any) -> dict[str, Any]:
        return {
            "name": t.name,
            "shape": [int(d) for d in t.shape],
            "dtype": getattr(t.dtype, "name", str(t.dtype)),
        }

    return {
        "inputs": [describe(network.get_input(i)) for i in range(network.num_inputs)],
        "outputs": [describe(network.get_output(i)) for i in range(network.num_outputs)],
    }
