"""``build_engine``: validate, pick the backend, build, and write the sidecar.

Every check that can fail on user input (model, shapes, output path, flags, GPU, TensorRT) runs before any
file is written; the engine is written atomically and removed again if its sidecar cannot be written.
"""

from __future__ import annotations

import logging
import platform as host_platform
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mpinfer import __version__
from mpinfer.backends.ort import cuda_usable, resolve_providers
from mpinfer.claim import claim_outputs
from mpinfer.engine.config import (
    Backend,
    BuildConfig,
    BuildResult,
    ShapeProfile,
    check_profiles,
    complete_profiles,
)
from mpinfer.engine.expand import EXPANDABLE_OPS, expand_ops
from mpinfer.engine.machine import check_capability, tensorrt_ops_to_expand
from mpinfer.engine.ort_engine import ENGINE_SUFFIXES, build_ort_engine
from mpinfer.engine.sidecar import (
    SCHEMA_VERSION,
    SIDECAR_KIND,
    graph_precisions,
    plan_path_for,
    read_plan_summary,
    sidecar_path,
)
from mpinfer.engine.trt_builder import build_trt_engine, plan_network_mode
from mpinfer.errors import BackendUnavailableError, InvalidInputError, format_message
from mpinfer.fileio import check_output_path, sha256_file, write_json_atomic
from mpinfer.gpu import (
    TENSORRT_INSTALL_HINT,
    GpuInfo,
    TensorRTProbe,
    cuda_device_count,
    probe_tensorrt,
    require_gpu,
)
from mpinfer.modelio import data_file, external_data_files, iter_graphs, load_onnx, require_file
from mpinfer.specs import Precision, specs_from_onnx

logger = logging.getLogger(__name__)


def select_backend(
    requested: Backend, device: str, *, tensorrt: TensorRTProbe, gpu_count: int
) -> tuple[Backend, str]:
    """Pick the backend for ``auto`` and say why (explicit choices are returned as they are).

    Args:
        requested: The ``--backend`` value.
        device: The ``--device`` value.
        tensorrt: Result of :func:`probe_tensorrt`.
        gpu_count: CUDA devices visible.

    Returns:
        The backend and a one-line reason.
    """
    if requested is not Backend.AUTO:
        return requested, f"--backend {requested.value}"
    if device == "cpu":
        return Backend.ONNXRUNTIME, "--device cpu: TensorRT needs a GPU, so an ONNX Runtime CPU engine"
    if tensorrt.version is None:
        return Backend.ONNXRUNTIME, (
            "TensorRT is not installed here, so an ONNX Runtime engine; for TensorRT: "
            "`pip install tensorrt`, NVIDIA's package index added as an extra index (NVIDIA's TensorRT "
            "install guide gives it)"
        )
    if gpu_count == 0:
        return Backend.ONNXRUNTIME, (
            f"TensorRT {tensorrt.version} is installed but no CUDA GPU is visible, "
            "so an ONNX Runtime CPU engine"
        )
    return Backend.TENSORRT, f"TensorRT {tensorrt.version} and a CUDA GPU are available"


def default_output(model: Path, backend: Backend, *, external_data: bool = False) -> Path:
    """``m.fp16.onnx`` -> ``m.fp16.engine`` (TensorRT) or ``m.fp16.ort`` (ONNX Runtime).

    A model with external data, which the ORT format cannot hold, gets ``m.fp16.ort.onnx`` (optimised ONNX).
    """
    stem = model.name[: -len(".onnx")] if model.name.endswith(".onnx") else model.stem
    if backend is Backend.TENSORRT:
        return model.with_name(stem + ".engine")
    return model.with_name(stem + (".ort.onnx" if external_data else ".ort"))


def _resolve_ort_device(device: str) -> str:

    if device == "auto":
        return "cuda:0" if cuda_usable() else "cpu"
    if device == "cpu":
        return "cpu"
    resolve_providers("cuda")  # raises BackendUnavailableError with a hint when CUDA is not usable
    return device if device.startswith("cuda:") else "cuda:0"


def _check_trt_only_options(cfg: BuildConfig, reason: str) -> list[str]:
    if cfg.weak_precisions:
        flags = ", ".join(f"--{p.value}" for p in cfg.weak_precisions)
        raise InvalidInputError(
            format_message(
                flags,
                "an ONNX Runtime engine build",
                "a TensorRT 10.x build",
                f"backend: {reason}. These are TensorRT's weak-typing builder flags; ONNX Runtime runs the "
                "precisions written in the graph, so convert first (mpinfer convert --precision fp16) "
                "and build the converted model",
            )
        )
    notes = []
    if cfg.timing_cache is not None or cfg.workspace is not None:
        notes.append("--timing-cache/--workspace apply to TensorRT only; ignored for the ONNX Runtime engine")
    if cfg.shapes:
        notes.append(
            "--shapes are checked against the model and recorded in the sidecar, but ONNX Runtime does not "
            "enforce them: the engine runs any shape the model allows (TensorRT builds for these ranges only)"
        )
    return notes


def _check_ort_output(output: Path, reason: str, suggested: Path) -> None:
    """An ONNX Runtime engine is a ``.ort`` or ``.onnx`` file: refuse another suffix, saying why ONNX Runtime.

    Raises:
        BackendUnavailableError: A TensorRT suffix (``.engine``/``.plan``) where TensorRT is not installed.
        InvalidInputError: Any other suffix, or a TensorRT one where ONNX Runtime was chosen otherwise.
    """
    if output.suffix.lower() in ENGINE_SUFFIXES:
        return
    trt_suffix = output.suffix.lower() in (".engine", ".plan")
    if trt_suffix and reason.startswith("TensorRT is not installed"):
        raise BackendUnavailableError(format_message(
            f"Engine path '{output}'", f"the name of a TensorRT engine ('{output.suffix}'), but TensorRT is not "
            "installed here", "an ONNX Runtime engine: '.ort' or '.onnx'",
            f"use `--backend onnxruntime -o {suggested}` (an ONNX Runtime engine: .ort, or .onnx for a model with "
            f"external data); for TensorRT, {TENSORRT_INSTALL_HINT.split('; or ')[0]}"))
    raise InvalidInputError(format_message(
        f"Engine path '{output}'", f"suffix '{output.suffix}' for an ONNX Runtime engine ({reason})",
        "'.ort' or '.onnx'",
        f"use -o {suggested}" + ("; .engine/.plan are TensorRT engines (--backend tensorrt)" if trt_suffix else "")))


@dataclass(frozen=True)
class _Checked:
    """Everything ``build_engine`` validated before writing anything."""

    model_path: Path
    model: Any
    specs: list[Any]
    backend: Backend
    reason: str
    output: Path
    precisions: frozenset[Precision]
    plan_summary: dict[str, Any] | None
    shapes: tuple[ShapeProfile, ...]  # cfg.shapes, completed with defaults for TensorRT
    shapes_note: str | None  # which profiles were defaulted


def _check_inputs(cfg: BuildConfig) -> _Checked:
    from onnx.external_data_helper import uses_external_data

    cfg.validate()
    model_path = require_file(cfg.model, "ONNX model")
    model = load_onnx(model_path, load_external_data=False)
    specs = specs_from_onnx(model)
    probe = (
        probe_tensorrt()
        if cfg.backend in (Backend.AUTO, Backend.TENSORRT)
        else TensorRTProbe(None, "not probed")
    )
    backend, reason = select_backend(cfg.backend, cfg.device, tensorrt=probe, gpu_count=cuda_device_count())
    logger.info("Backend: %s (%s)", backend.value, reason)
    if backend is Backend.TENSORRT and probe.version is None:  # before asking for --shapes TensorRT can't use
        raise BackendUnavailableError(probe.reason or TENSORRT_INSTALL_HINT)
    external = any(uses_external_data(t) for t in model.graph.initializer)
    output = Path(cfg.output) if cfg.output is not None else default_output(model_path, backend, external_data=external)
    if backend is Backend.ONNXRUNTIME:
        _check_ort_output(output, reason, default_output(model_path, backend, external_data=external))
    plan = cfg.plan if cfg.plan is not None else plan_path_for(model_path)
    inputs = [model_path, cfg.timing_cache, plan, *external_data_files(model_path)]
    check_output_path(output, inputs, force=cfg.force)
    check_output_path(sidecar_path(output), inputs, force=cfg.force)
    # the engine's external data file: never the model's own, and replaced only with --force
    check_output_path(data_file(output), inputs, force=cfg.force)
    check_profiles(cfg.shapes, specs)
    shapes, shapes_note = cfg.shapes, None
    if backend is Backend.TENSORRT:  # ONNX Runtime handles dynamic shapes itself
        shapes, shapes_note = complete_profiles(cfg.shapes, specs)
    plan_summary = read_plan_summary(cfg.plan, model_path)
    precisions = frozenset(graph_precisions(model) | set(cfg.weak_precisions))
    return _Checked(model_path, model, specs, backend, reason, output, precisions, plan_summary, shapes,
                    shapes_note)


def _build_tensorrt(
    cfg: BuildConfig, c: _Checked, low: set[Precision]
) -> tuple[dict[str, Any], GpuInfo, list[str]]:
    probe = probe_tensorrt()
    if probe.version is None:
        raise BackendUnavailableError(probe.reason or TENSORRT_INSTALL_HINT)
    gpu = require_gpu(cfg.device, "TensorRT build")
    notes = check_capability(low, gpu.compute_capability, gpu.name)

    plan_network_mode(probe.version, cfg.weak_precisions)  # refuse --fp16 on TensorRT 11 before building
    ops = {n.op_type for g in iter_graphs(c.model.graph) for n in g.node}
    expand = tensorrt_ops_to_expand(probe.version, ops, EXPANDABLE_OPS)
    graph = None
    if expand:  # a parser older than the op: the op's own float32 chain, in the copy the parser reads
        expanded, count = expand_ops(c.model, expand)
        notes.append(f"TensorRT {probe.version} predates {', '.join(sorted(expand))} (10.15+): {count} node(s) "
                     "expanded into the float32 chain the op computes (stash_type=1), for this engine only")
        graph = expanded.SerializeToString()
    facts = build_trt_engine(cfg, c.model_path, c.output, gpu, graph=graph)
    notes += facts.pop("notes", [])
    return {"tensorrt": facts["tensorrt"], "io": facts["io"]}, gpu, notes


def _build_onnxruntime(
    cfg: BuildConfig, c: _Checked, low: set[Precision]
) -> tuple[dict[str, Any], GpuInfo | None, list[str]]:
    notes = _check_trt_only_options(cfg, c.reason)
    device = _resolve_ort_device(cfg.device)
    gpu = None
    if device.startswith("cuda"):
        gpu = require_gpu(device, "ONNX Runtime CUDA engine")
        notes += check_capability(low, gpu.compute_capability, gpu.name)

    section = build_ort_engine(cfg, c.model_path, c.model, c.output, device)
    io = {"inputs": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype.name} for s in c.specs]}
    return {"onnxruntime": section, "io": io}, gpu, notes


def build_engine(cfg: BuildConfig) -> BuildResult:
    """Build a TensorRT or ONNX Runtime engine from an ONNX model and write ``<engine>.json`` beside it.

    Args:
        cfg: The build settings.

    Returns:
        The engine path, its sidecar, the backend used and why.

    Raises:
        MpinferError: For bad input, a missing backend, a GPU too old for the model's precisions, or a
            failed build (no file is written in any of these cases).
    """
    c = _check_inputs(cfg)
    cfg = replace(cfg, shapes=c.shapes)
    low = {p for p in c.precisions if p.is_low}
    notes: list[str] = [c.shapes_note] if c.shapes_note else []
    if not low:
        notes.append(
            "the model has no fp16/bf16 tensors: the engine computes in fp32 "
            "(run mpinfer convert first for a mixed-precision engine)"
        )
    build = _build_tensorrt if c.backend is Backend.TENSORRT else _build_onnxruntime
    side = sidecar_path(c.output)
    # engine, its data and its sidecar: claimed before the build, published together (both or neither)
    with claim_outputs([c.output, data_file(c.output), side], force=cfg.force) as claim:
        staged = replace(c, output=claim.stage(c.output))
        sections, gpu, more = build(cfg, staged, low)
        notes += more
        for note in notes:
            logger.warning(note)
        write_json_atomic(claim.stage(side), _sidecar(cfg, staged, sections, gpu, notes))
        claim.publish()
    return BuildResult(path=c.output, sidecar=side, backend=c.backend, reason=c.reason, notes=tuple(notes))


def _engine_files(output: Path) -> dict[str, Any]:
    """The engine file's name, sha256 and size, and its external data file's (ONNX Runtime, over 2 GB)."""
    entry: dict[str, Any] = {"path": output.name, "sha256": sha256_file(output), "bytes": output.stat().st_size}
    data = data_file(output)
    if data.is_file():
        entry["data"] = {"path": data.name, "sha256": sha256_file(data), "bytes": data.stat().st_size}
    return entry


def _sidecar(
    cfg: BuildConfig, c: _Checked, sections: dict[str, Any], gpu: GpuInfo | None, notes: list[str]
) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": SIDECAR_KIND,
        "backend": c.backend.value,
        "backend_reason": c.reason,
        "engine": _engine_files(c.output),
        "source": {"path": str(c.model_path), "sha256": sha256_file(c.model_path)},
        **sections,
        "device": _device_section(gpu),
        "profiles": [{p.name: p.to_dict() for p in cfg.shapes}] if cfg.shapes else [],
        "precision": {
            "graph": sorted(p.value for p in c.precisions - set(cfg.weak_precisions)),
            "weak_flags": [p.value for p in cfg.weak_precisions],
            "plan": c.plan_summary,
        },
        "build": {
            "opt_level": cfg.opt_level,
            "workspace_bytes": cfg.workspace,
            "timing_cache": str(cfg.timing_cache) if cfg.timing_cache else None,
            "device": cfg.device,
        },
        "notes": notes,
        "mpinfer_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": host_platform.node(),
    }


def _device_section(gpu: GpuInfo | None) -> dict[str, Any]:
    if gpu is None:
        return {
            "kind": "cpu",
            "gpu_name": None,
            "compute_capability": None,
            "cpu": host_platform.machine() or None,
        }
    cuda = None
    try:
        import torch

        cuda = torch.version.cuda
    except ImportError:
        pass
    return {
        "kind": "cuda",
        "index": gpu.index,
        "gpu_name": gpu.name,
        "compute_capability": gpu.capability_text,
        "total_memory": gpu.total_memory,
        "cuda": cuda,
    }
