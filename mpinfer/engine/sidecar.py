"""The ``<engine>.json`` sidecar: what an engine was built from, with what, for which machine.

Written beside every engine by :func:`mpinfer.engine.build_engine`; read back by
:func:`mpinfer.engine.load_engine_runner`, which refuses an engine built for another TensorRT version or
GPU (TensorRT plans are specific to both) before TensorRT fails with a less helpful message.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpinfer.errors import BackendUnavailableError, ModelLoadError, format_message
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
# Marks a JSON file as an mpinfer engine sidecar (other tools write .json files next to models too).
SIDECAR_KIND = "mpinfer-engine"


def sidecar_path(engine: str | Path) -> Path:
    """``out/model.engine`` -> ``out/model.engine.json``."""
    p = Path(engine)
    return p.with_name(p.name + ".json")


def plan_path_for(model: str | Path) -> Path:
    """The precision plan ``convert`` writes beside a model: ``m.fp16.onnx`` -> ``m.fp16.plan.json``."""
    p = Path(model)
    stem = p.name[: -len(".onnx")] if p.name.endswith(".onnx") else p.stem
    return p.with_name(stem + ".plan.json")


def read_plan_summary(plan: Path | None, model: Path) -> dict[str, Any] | None:
    """The part of a precision plan worth keeping beside the engine, or None when there is no plan.

    Args:
        plan: Explicit plan path, or None to look for ``<model stem>.plan.json``.
        model: The ONNX model the engine is built from.

    Raises:
        ModelLoadError: An explicit plan that is missing or is not a plan JSON.
    """
    explicit = plan is not None
    path = Path(plan) if plan is not None else plan_path_for(model)
    if not path.is_file():
        if explicit:
            raise ModelLoadError(
                format_message(
                    f"Precision plan '{path}'", "no such file", "the .plan.json written by mpinfer convert"
                )
            )
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as err:
        if explicit:
            raise ModelLoadError(
                format_message(
                    f"Precision plan '{path}'",
                    f"invalid JSON ({err})",
                    "the .plan.json written by mpinfer convert",
                )
            ) from err
        logger.warning("Ignoring unreadable precision plan %s: %s", path, err)
        return None
    return {
        "path": str(path),
        "precision": data.get("precision"),
        "numerics": data.get("numerics"),
        "budget": data.get("budget"),
        "source_sha256": (data.get("source") or {}).get("sha256"),
        "summary": data.get("summary"),
    }


def graph_precisions(model: object) -> set[Precision]:
    """Float precisions that tensors of an ONNX model use (inputs, initializers, value_info, Casts).

    A strongly typed TensorRT network computes in exactly these types, so this is what the GPU must
    support and what the sidecar reports.
    """
    import onnx

    assert isinstance(model, onnx.ModelProto)
    found: set[int] = set()

    def types_of(vis: Any) -> None:
        for vi in vis:
            if vi.type.HasField("tensor_type"):
                found.add(vi.type.tensor_type.elem_type)

    def walk(graph: onnx.GraphProto) -> None:
        types_of(graph.input)
        types_of(graph.output)
        types_of(graph.value_info)
        found.update(t.data_type for t in graph.initializer)
        for node in graph.node:
            for attr in node.attribute:
                if node.op_type in (
                    "Cast",
                    "CastLike",
                    "EyeLike",
                    "RandomNormal",
                    "RandomUniform",
                ) and attr.name in ("to", "dtype"):
                    found.add(attr.i)
                elif attr.type == onnx.AttributeProto.TENSOR:
                    found.add(attr.t.data_type)
                elif attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        walk(g)

    walk(model.graph)
    by_type = {p.onnx_dtype: p for p in Precision}
    return {by_type[t] for t in found if t in by_type}


@dataclass(frozen=True)
class MachineFacts:
    """The facts an engine depends on, for this machine or as recorded in a sidecar.

    Attributes:
        backend: ``tensorrt`` or ``onnxruntime``.
        runtime_version: TensorRT or onnxruntime version.
        gpu_name: None on CPU.
        compute_capability: ``"9.0"``, or None on CPU.
        providers: onnxruntime providers (empty for TensorRT).
    """

    backend: str
    runtime_version: str
    gpu_name: str | None = None
    compute_capability: str | None = None
    providers: tuple[str, ...] = ()

    @classmethod
    def from_sidecar(cls, data: Mapping[str, Any]) -> MachineFacts:
        """The facts recorded in a sidecar."""
        backend = data.get("backend", "")
        runtime = data.get(backend) or {}
        device = data.get("device") or {}
        return cls(
            backend=backend,
            runtime_version=str(runtime.get("version", "")),
            gpu_name=device.get("gpu_name"),
            compute_capability=device.get("compute_capability"),
            providers=tuple(runtime.get("providers", ())),
        )


def _rebuild_hint(recorded: MachineFacts, engine: Path) -> str:
    return (
        f"rebuild it on this machine: mpinfer build-engine <model.onnx> --backend {recorded.backend} "
        f"-o {engine} --force"
    )


def _check_runtime(recorded: MachineFacts, here: MachineFacts, engine: Path) -> None:
    name = "TensorRT" if recorded.backend == "tensorrt" else "onnxruntime"
    if recorded.backend == "tensorrt":
        same = recorded.runtime_version == here.runtime_version
    else:  # onnxruntime: optimised graphs and the ORT format are stable within a minor release
        same = recorded.runtime_version.split(".")[:2] == here.runtime_version.split(".")[:2]
    if not same:
        raise ModelLoadError(
            format_message(
                f"Engine '{engine}'",
                f"built with {name} {recorded.runtime_version}",
                f"{name} {here.runtime_version} (installed here)",
                _rebuild_hint(recorded, engine),
            )
        )
    cuda = "CUDAExecutionProvider"
    if recorded.backend == "onnxruntime" and cuda in recorded.providers and cuda not in here.providers:
        raise BackendUnavailableError(
            format_message(
                f"Engine '{engine}'",
                "an ONNX Runtime engine optimised for the CUDA provider",
                "a machine with an NVIDIA GPU and onnxruntime-gpu",
                "rebuild a CPU engine here: mpinfer build-engine <model.onnx> --backend onnxruntime "
                f"--device cpu -o {engine} --force",
            )
        )


def check_compatible(recorded: MachineFacts, here: MachineFacts, engine: Path) -> list[str]:
    """Refuse an engine whose recorded facts make it unusable here; return softer warnings.

    TensorRT plans only deserialize with the TensorRT version that built them and only run on GPUs of the
    same compute capability; a different GPU model of the same capability runs but with tactics tuned for
    another chip. ONNX Runtime engines are graphs optimised by one onnxruntime version for one provider.

    Raises:
        ModelLoadError: Built with another TensorRT/onnxruntime version or for another compute capability.
        BackendUnavailableError: Built for CUDA where this machine has no usable CUDA provider.
    """
    _check_runtime(recorded, here, engine)
    warnings: list[str] = []
    if recorded.compute_capability and here.compute_capability != recorded.compute_capability:
        where = (
            f"a GPU of compute capability {here.compute_capability}" if here.compute_capability else "no GPU"
        )
        msg = format_message(
            f"Engine '{engine}'",
            f"built for {recorded.gpu_name} (compute capability {recorded.compute_capability})",
            f"the same GPU generation; this machine has {where}",
            _rebuild_hint(recorded, engine),
        )
        if recorded.backend == "tensorrt":
            raise ModelLoadError(msg)
        if here.compute_capability is None:
            raise BackendUnavailableError(msg)
        warnings.append(msg)
    elif recorded.gpu_name and here.gpu_name and recorded.gpu_name != here.gpu_name:
        warnings.append(
            f"Engine '{engine}' was built on {recorded.gpu_name} and runs on {here.gpu_name} "
            "(same compute capability): it works, but its tactics were timed on the other GPU"
        )
    return warnings


def read_sidecar(engine: str | Path) -> dict[str, Any] | None:
    """The sidecar of ``engine``, or None when it has none.

    Raises:
        ModelLoadError: A sidecar that is not valid JSON or not an mpinfer engine sidecar.
    """
    path = sidecar_path(engine)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ModelLoadError(
            format_message(
                f"Engine sidecar '{path}'",
                f"invalid JSON ({err})",
                "the JSON written by mpinfer build-engine",
                "rebuild the engine, or delete the broken sidecar",
            )
        ) from err
    if not isinstance(data, dict) or data.get("kind") != SIDECAR_KIND:
        raise ModelLoadError(
            format_message(
                f"Engine sidecar '{path}'",
                "a JSON file of another kind",
                f'"kind": "{SIDECAR_KIND}"',
                "rebuild the engine with mpinfer",
            )
        )
    if int(data.get("schema_version", 0)) > SCHEMA_VERSION:
        raise ModelLoadError(
            format_message(
                f"Engine sidecar '{path}'",
                f"schema_version {data.get('schema_version')}",
                f"{SCHEMA_VERSION} or older",
                "upgrade mpinfer",
            )
        )
    return data
