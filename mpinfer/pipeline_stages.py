"""The default stages of ``mpinfer run``: each calls one public API function with one config object.

``train`` (mpinfer.train.train_model) → ``export`` (mpinfer.export.export_onnx) → ``convert``
(mpinfer.precision.convert_precision) → ``build_engine`` (mpinfer.engine.build_engine) → ``compare``
(mpinfer.compare.compare_models) → ``report`` (mpinfer.report.write_report).

A stage's TOML table holds the fields of its config dataclass; the stage fills in what earlier stages
produced (the checkpoint feeds export's ``weights``, the ONNX model feeds convert's ``model``, ...) unless
the table sets it. A stage whose API is missing from this installation fails with a message saying so.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import logging
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mpinfer.backends.ort import cuda_usable
from mpinfer.checks import parse_checks
from mpinfer.data.decode import PROMPTS_PREFIX
from mpinfer.engine import BuildConfig, build_engine
from mpinfer.engine.build import select_backend
from mpinfer.engine.config import Backend
from mpinfer.errors import BackendUnavailableError, InvalidInputError, MpinferError, format_message
from mpinfer.fileio import write_json_atomic, write_text_atomic
from mpinfer.gpu import cuda_device_count, gpu_info, probe_tensorrt
from mpinfer.specs import Precision
from mpinfer.stage import (
    ARTEFACT_DIR,
    STATE_FILE,
    Stage,
    StageContext,
    StageOutput,
    StagePlan,
    unknown_key_error,
)
from mpinfer.usermetric import check_name

logger = logging.getLogger(__name__)

# Fields of AmpConfig that may name the training output folder (the first one present is used).
TRAIN_OUTPUT_FIELDS = ("output", "out_dir", "output_dir", "run_dir", "workdir")
DEFAULT_REPORT_FORMATS = ("html", "md", "json")


def import_api(stage: str, module: str, *names: str) -> list[Any]:
    """Import ``names`` from ``module``, or say that this installation lacks the stage.

    Raises:
        MpinferError: The module or a name is missing.
    """
    try:
        mod = importlib.import_module(module)
        return [getattr(mod, n) for n in names]
    except (ModuleNotFoundError, AttributeError) as err:
        missing = getattr(err, "name", None) or str(err)
        if isinstance(err, ModuleNotFoundError) and missing and not module.startswith(missing.split(".")[0]):
            raise  # a third-party dependency of the stage is missing: keep the real error
        raise MpinferError(
            format_message(
                f"Pipeline stage [{stage}]",
                f"no {module}.{'/'.join(names)} in this mpinfer installation",
                "the stage's API",
                f"remove the [{stage}] table, or install an mpinfer that has it",
            )
        ) from err


def _coerce(value: Any, annotation: str) -> Any:
    if value is None:
        return None
    if "Precision" in annotation and isinstance(value, str):
        return Precision.parse(value)
    if "Path" in annotation and isinstance(value, str):
        return Path(value)
    if "tuple" in annotation and isinstance(value, list):
        return tuple(value)
    return value


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether a TOML value can stand for a field annotated ``hint`` (unknown types are left to the config)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint in (str, Path) or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return isinstance(value, str)
    if origin in (tuple, list, Sequence):
        items = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return isinstance(value, list) and all(_type_ok(v, items[0]) for v in value if items)
    if origin is Callable:
        return False
    return True


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        arms = [_describe(a) for a in typing.get_args(hint) if a is not type(None) and _describe(a)]
        return " or ".join(dict.fromkeys(arms))
    if origin in (tuple, list, Sequence):
        items = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return f"a list of {_describe(items[0]).removeprefix('a ').removeprefix('an ')}s" if items else "a list"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in hint)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path string"}
    return names.get(hint, "") if isinstance(hint, type) else ""


def _toml_type(value: Any) -> str:
    if isinstance(value, list) and value:
        return "a list holding " + " and ".join(sorted({_toml_type(v) for v in value}))
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "a list", dict: "a table"}
    return names.get(type(value), f"a {type(value).__name__}")


def check_table(
    cls: type, values: Mapping[str, Any], where: str, *, loose: Mapping[str, Any] | None = None
) -> None:
    """Refuse keys that are not fields of the config dataclass ``cls`` and values of the wrong TOML type.

    Args:
        cls: The stage's config dataclass.
        values: The TOML table.
        where: The table's name, for messages.
        loose: Annotations replacing the dataclass's for fields the stage parses from strings.

    Raises:
        InvalidInputError: Naming the table, the key, the value, its type and the type expected.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise unknown_key_error(where, unknown, fields)
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        hint = (loose or {}).get(key, hints[key])
        if not _type_ok(value, hint):
            raise InvalidInputError(
                format_message(f"Pipeline table [{where}] {key} = {value!r}", _toml_type(value), _describe(hint))
            )


def make_config(cls: type, values: Mapping[str, Any], where: str) -> Any:
    """Build a config dataclass from TOML values: unknown keys are refused, strings become Paths/Precisions.

    Raises:
        InvalidInputError: Unknown or missing keys, a value of the wrong type, or one the dataclass refuses.
    """
    check_table(cls, values, where)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {k: _coerce(v, str(fields[k].type)) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required key is missing: name it as the table's key, not the class's argument
        missing = [f.name for f in fields.values() if f.name not in kwargs and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if not missing:
            raise InvalidInputError(
                format_message(f"Pipeline table [{where}]", str(err), "values its keys take")
            ) from err
        raise InvalidInputError(
            format_message(f"Pipeline table [{where}]", f"no {', '.join(repr(k) for k in missing)}",
                           " and ".join(f"{k} = ... in [{where}]" for k in missing))
        ) from err


def _resolve_value(ctx: StageContext, value: Any, inputs: list[Path]) -> Any:
    if isinstance(value, list):
        return [_resolve_value(ctx, v, inputs) for v in value]
    if isinstance(value, Mapping):  # metrics = { NAME = "PATH.py:FUNCTION" }: each file resolved and hashed
        return {k: _resolve_value(ctx, v, inputs) for k, v in value.items()}
    if not isinstance(value, str) or not value or "\n" in value:
        return value
    prefix = PROMPTS_PREFIX if value.startswith(PROMPTS_PREFIX) else ""  # prompts:FILE[:steps=N]: the FILE part
    rest = value[len(prefix):]
    head, sep, tail = rest.partition(":") if ".py:" in rest or prefix else (rest, "", "")
    path = ctx.path(head)
    if path.exists() and ("/" in head or "." in Path(head).name):
        inputs.append(path)
        return prefix + str(path) + sep + tail
    return value


# Calibration from prompts (mpinfer.data.decode): ``prompts:FILE[:steps=N][:tokenizer=DIR]``.


def resolve_section(
    ctx: StageContext, section: Mapping[str, Any], *, exclude: Iterable[str] = ()
) -> tuple[dict[str, Any], list[Path]]:
    """Resolve path-like values of a table against the pipeline root and collect them as inputs.

    A string (or list of strings) naming an existing file or folder becomes an absolute path and its
    content goes into the stage key; ``file.py:factory`` sources are resolved on the file part.
    Keys in ``exclude`` are resolved but not hashed (a timing cache changes every build).
    """
    settings: dict[str, Any] = {}
    inputs: list[Path] = []
    for key, value in section.items():
        sink: list[Path] = [] if key in exclude else inputs
        settings[key] = _resolve_value(ctx, value, sink)
    return settings, inputs


def _require(ctx: StageContext, stage: str, key: str, kinds: Iterable[str]) -> str:
    if key in ctx.section:
        return str(ctx.section[key])
    for kind in kinds:
        if kind in ctx.artefacts:
            return str(ctx.artefacts[kind])
    raise InvalidInputError(
        format_message(
            f"Pipeline table [{stage}]",
            f"no '{key}' and no earlier stage producing it",
            f'{key} = "path" in [{stage}]',
        )
    )


# -- train --
def _plan_train(ctx: StageContext) -> StagePlan:
    settings, inputs = resolve_section(ctx, ctx.section)
    return StagePlan(settings, tuple(inputs))


def _resume_unfinished(values: dict[str, Any], out: Path, epochs: Any) -> None:
    """Continue an interrupted train stage from the last.pt its key-named folder kept (see Stage.resumable).

    A folder whose run had finished (its record lost) or holds no checkpoint is emptied: the run starts over.
    """
    import shutil

    last = out / "last.pt"
    if "resume" in values or not last.is_file():
        return
    (load_checkpoint,) = import_api("train", "mpinfer.train.checkpoint", "load_checkpoint")
    try:
        done = int(load_checkpoint(last)["epoch"])
    except (MpinferError, TypeError, ValueError):  # an unreadable leftover is not worth resuming from
        done = None
    if done is None or (isinstance(epochs, int) and done >= epochs):
        for p in out.iterdir():
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
        return
    logger.warning("Stage train: continuing the interrupted run from %s (after epoch %d)", last, done)
    values["resume"] = str(last)


def _run_train(plan: StagePlan, out: Path) -> StageOutput:
    amp_config, train_model = import_api("train", "mpinfer.train", "AmpConfig", "train_model")
    names = {f.name for f in dataclasses.fields(amp_config)}
    values = dict(plan.settings)
    out_field = next((f for f in TRAIN_OUTPUT_FIELDS if f in names), None)
    if out_field is not None and out_field not in values:
        values[out_field] = str(out)
        default = next((f.default for f in dataclasses.fields(amp_config) if f.name == "epochs"), None)
        _resume_unfinished(values, out, values.get("epochs", default))
    result = train_model(make_config(amp_config, values, "train"))
    artefacts = {
        "checkpoint": Path(result.best),
        "train_last": Path(result.last),
        "train_metrics": Path(result.metrics),
    }
    if getattr(result, "overflow", None):
        artefacts["overflow"] = Path(result.overflow)
    summary = {k: v for k, v in dict(result.summary or {}).items() if isinstance(v, (int, float, str, bool))}
    return StageOutput(artefacts, summary)


# -- export --
def _plan_export(ctx: StageContext) -> StagePlan:
    if "source" not in ctx.section:
        raise InvalidInputError(
            format_message("Pipeline table [export]", "no 'source'", 'source = "models/file.py:factory"')
        )
    settings, inputs = resolve_section(ctx, ctx.section)
    if "weights" not in settings and "checkpoint" in ctx.artefacts:
        settings["weights"] = str(ctx.artefacts["checkpoint"])
        inputs.append(ctx.artefacts["checkpoint"])
    return StagePlan(settings, tuple(inputs))


def _run_export(plan: StagePlan, out: Path) -> StageOutput:
    export_config, export_onnx = import_api("export", "mpinfer.export", "ExportConfig", "export_onnx")
    values = {**plan.settings, "output": str(out / "model.onnx"), "force": True}
    result = export_onnx(make_config(export_config, values, "export"))
    artefacts = {"onnx": Path(result.path)}
    if getattr(result, "sidecar", None):
        artefacts["export_sidecar"] = Path(result.sidecar)
    return StageOutput(artefacts, {"exporter": str(result.exporter), "opset": result.opset})


# -- convert --
def _plan_convert(ctx: StageContext) -> StagePlan:
    settings, inputs = resolve_section(ctx, ctx.section)
    if "model" not in settings:
        settings["model"] = _require(ctx, "convert", "model", ["onnx"])
        inputs.append(Path(settings["model"]))
    settings.setdefault("precision", "fp16")
    return StagePlan(settings, tuple(inputs))


def _run_convert(plan: StagePlan, out: Path) -> StageOutput:
    convert_config, convert_precision = import_api(
        "convert", "mpinfer.precision", "ConvertConfig", "convert_precision"
    )
    precision = Precision.parse(plan.settings["precision"])
    values = {**plan.settings, "output": str(out / f"model.{precision.value}.onnx"), "force": True}
    values.setdefault("progress", False)  # the pipeline prints one line per stage; bars would break them up
    result = convert_precision(make_config(convert_config, values, "convert"))
    summary: dict[str, Any] = {"precision": precision.value}
    plan_path = Path(result.plan_path)
    if plan_path.is_file():
        stats = json.loads(plan_path.read_text(encoding="utf-8")).get("summary") or {}
        summary.update({k: v for k, v in stats.items() if isinstance(v, (int, float))})
        verified = stats.get("verification") or {}
        if verified:  # what the guarantee covers: the search's slice and every verified sample
            summary.update(searched_samples=verified.get("searched_samples"), verified_samples=verified["samples"])
    return StageOutput({"onnx_low": Path(result.output), "plan": plan_path}, summary)


# -- build_engine --
def _machine_facts(backend: str) -> dict[str, Any]:
    import onnxruntime as ort

    gpu = gpu_info(0) if cuda_usable() or backend == "tensorrt" else None
    facts: dict[str, Any] = {
        "onnxruntime": ort.__version__,
        "gpu": gpu.name if gpu else None,
        "compute_capability": gpu.capability_text if gpu else None,
    }
    if backend == "tensorrt":

        facts["tensorrt"] = probe_tensorrt().version
    return facts


def _plan_build_engine(ctx: StageContext) -> StagePlan:

    settings, inputs = resolve_section(ctx, ctx.section, exclude=("timing_cache",))
    if "model" not in settings:
        settings["model"] = _require(ctx, "build_engine", "model", ["onnx_low", "onnx"])
        inputs.append(Path(settings["model"]))
    if "plan" not in settings and "plan" in ctx.artefacts:
        settings["plan"] = str(ctx.artefacts["plan"])
        inputs.append(ctx.artefacts["plan"])
    requested = Backend.parse(settings.get("backend", "auto"))
    backend, reason = select_backend(
        requested,
        str(settings.get("device", "auto")),
        tensorrt=probe_tensorrt(),
        gpu_count=cuda_device_count(),
    )
    settings["backend"] = backend.value
    # An engine belongs to one machine: its facts are part of the key, so another machine rebuilds.
    settings["_machine"] = _machine_facts(backend.value)
    settings["_reason"] = reason
    return StagePlan(settings, tuple(inputs))


def _run_build_engine(plan: StagePlan, out: Path) -> StageOutput:

    values = {k: v for k, v in plan.settings.items() if not k.startswith("_")}
    suffix = ".engine" if values["backend"] == "tensorrt" else ".ort"
    values.update(output=str(out / f"model{suffix}"), force=True)
    result = build_engine(BuildConfig.from_mapping(values))
    return StageOutput(
        {"engine": result.path, "engine_sidecar": result.sidecar},
        {"backend": result.backend.value, "reason": result.reason},
    )


# -- compare --
def _plan_compare(ctx: StageContext) -> StagePlan:
    settings, inputs = resolve_section(ctx, ctx.section)
    # An engine runs on the device it was built for (a CUDA engine on a GPU machine): let compare follow it.
    settings.setdefault("device", "auto")
    if "baseline" not in settings:
        settings["baseline"] = _require(ctx, "compare", "baseline", ["onnx"])
        inputs.append(Path(settings["baseline"]))
    if "candidates" not in settings:
        found = [ctx.artefacts[k] for k in ("onnx_low", "engine") if k in ctx.artefacts]
        settings["candidates"] = [str(p) for p in found]
        inputs.extend(found)
        if "engine_sidecar" in ctx.artefacts:
            inputs.append(ctx.artefacts["engine_sidecar"])
    return StagePlan(settings, tuple(inputs))


def _run_compare(plan: StagePlan, out: Path) -> StageOutput:
    compare_config, compare_models = import_api(
        "compare", "mpinfer.compare", "CompareConfig", "compare_models"
    )
    values = {"show_progress": False, **plan.settings}  # one line per stage, as for convert
    result = compare_models(make_config(compare_config, values, "compare"))
    path = write_json_atomic(out / "comparison.json", result.to_dict())
    return StageOutput({"comparison": path}, {"passed": bool(result), "verdict": result.summary()})


# -- report --
def _plan_report(ctx: StageContext) -> StagePlan:
    unknown = sorted(set(ctx.section) - {"formats", "dir"})
    if unknown:
        raise unknown_key_error("report", unknown, ("formats", "dir"))
    out_dir = (ctx.work_dir / str(ctx.section.get("dir", "report"))).resolve()
    reserved = [ctx.work_dir / ARTEFACT_DIR, ctx.work_dir / STATE_FILE]
    if (
        out_dir == ctx.work_dir
        or ctx.work_dir not in out_dir.parents
        or any(p == out_dir or p in out_dir.parents for p in reserved)
    ):
        raise InvalidInputError(
            format_message(
                "Pipeline table [report]",
                f"dir = {ctx.section.get('dir')!r}",
                f"a sub-folder of the work dir (it is replaced on every run) outside {ARTEFACT_DIR}/",
            )
        )
    settings = {
        "formats": list(ctx.section.get("formats", DEFAULT_REPORT_FORMATS)),
        "artefacts": {k: str(p) for k, p in ctx.artefacts.items()},
        "dir": str(out_dir),
    }
    inputs = [p for p in ctx.artefacts.values() if p.exists()]
    return StagePlan(settings, tuple(inputs), output_dir=out_dir)


def write_artefact_index(out: Path, artefacts: Mapping[str, str]) -> list[Path]:
    """Write ``artefacts.md`` and ``artefacts.json`` linking every artefact relative to ``out``."""
    rel = {k: os.path.relpath(v, out) for k, v in artefacts.items()}
    lines = ["# Pipeline artefacts", "", "| kind | path |", "|---|---|"]
    lines += [f"| {k} | [{v}]({v}) |" for k, v in rel.items()]
    return [
        write_text_atomic(out / "artefacts.md", "\n".join(lines) + "\n"),
        write_json_atomic(out / "artefacts.json", {"artefacts": rel}),
    ]


def _run_report(plan: StagePlan, out: Path) -> StageOutput:
    artefacts: dict[str, str] = plan.settings["artefacts"]
    comparison = artefacts.get("comparison")
    if comparison is None:
        raise InvalidInputError(
            format_message(
                "Pipeline table [report]", "no comparison to report", "a [compare] stage before [report]"
            )
        )
    (write_report,) = import_api("report", "mpinfer.report", "write_report")
    data = json.loads(Path(comparison).read_text(encoding="utf-8"))
    written = write_report(data, out, formats=tuple(plan.settings["formats"]))
    write_artefact_index(out, artefacts)
    summary = {"files": sorted(os.path.relpath(p, out) for p in dict(written).values())}
    return StageOutput({"report": out}, summary)


@dataclasses.dataclass(frozen=True)
class ReportSettings:
    """The ``[report]`` table.

    Attributes:
        formats: Report formats to write.
        dir: Folder under the work dir (replaced on every run).
    """

    formats: tuple[str, ...] = DEFAULT_REPORT_FORMATS
    dir: str = "report"


# BuildConfig fields that BuildConfig.from_mapping parses from strings (a TOML table writes them so).
# A TOML names the training data (a data set name or a file): the API's Dataset objects have no TOML form.
TRAIN_LOOSE_TYPES: dict[str, Any] = {"data": str, "eval_data": str | None}
BUILD_LOOSE_TYPES: dict[str, Any] = {
    "shapes": str | list[str],
    "workspace": str | int,
    "weak_precisions": str | list[str],
}


# Values the stages parse from strings, parsed again before any stage runs: a typo in the last stage's table
# fails at once, not after training. (stage, key) -> (module, parser)
VALUE_PARSERS = {
    ("convert", "budget"): ("mpinfer.precision.options", "check_budget"),  # the check grammar, or "none"
    ("convert", "numerics"): ("mpinfer.precision.numerics.registry", "check_numerics"),  # a name this machine can run
    ("compare", "checks"): ("mpinfer.checks", "parse_checks"),
    ("convert", "input_ranges"): ("mpinfer.data", "parse_input_ranges"),
    ("compare", "input_ranges"): ("mpinfer.data", "parse_input_ranges"),
}


def _check_metrics(stage: str, section: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of a table's ``metrics = { NAME = "PATH.py:FUNCTION" }`` (checked; the files load when it runs).

    Raises:
        InvalidInputError: ``metrics`` is not a table of strings, or a name is malformed or clashes.
    """
    metrics = section.get("metrics")
    if metrics is None:
        return ()
    where = f"Pipeline table [{stage}] metrics"
    if not isinstance(metrics, Mapping) or not all(isinstance(v, str) for v in metrics.values()):
        raise InvalidInputError(format_message(where, repr(metrics), 'a table: metrics = { NAME = "PATH.py:FUNCTION" }',
                                               "paths are relative to the pipeline.toml's folder"))
    for metric in metrics:
        check_name(str(metric), where)
    return tuple(str(k) for k in metrics)


def _checker(stage: str, module: str, name: str, loose: Mapping[str, Any] | None = None) -> Any:
    def check(section: Mapping[str, Any]) -> None:
        (cls,) = import_api(stage, module, name)
        check_table(cls, section, stage, loose=loose)
        hints = typing.get_type_hints(cls)
        user = _check_metrics(stage, section)
        for key, value in section.items():
            parser = VALUE_PARSERS.get((stage, key))
            try:
                if user and key in ("budget", "checks") and value:  # the check grammar with the user's figures
                    if str(value).strip().lower() != "none":
                        parse_checks(str(value), user)
                elif parser is not None and value:
                    (parse,) = import_api(stage, *parser)
                    parse(value)
                elif isinstance(value, str) and "Precision" in str(hints.get(key)):
                    Precision.parse(value)
            except (InvalidInputError, BackendUnavailableError) as err:
                raise type(err)(f"Pipeline table [{stage}] {key} = {value!r}: {err}") from err

    return check


def default_stages() -> dict[str, Stage]:
    """The built-in stages, in run order."""
    return {
        "train": Stage(
            "train",
            _plan_train,
            _run_train,
            _checker("train", "mpinfer.train", "AmpConfig", TRAIN_LOOSE_TYPES),
            resumable=True,
        ),
        "export": Stage("export", _plan_export, _run_export, _checker("export", "mpinfer.export", "ExportConfig")),
        "convert": Stage(
            "convert",
            _plan_convert,
            _run_convert,
            _checker("convert", "mpinfer.precision", "ConvertConfig"),
            data_keys=("calibration",),
        ),
        "build_engine": Stage(
            "build_engine",
            _plan_build_engine,
            _run_build_engine,
            _checker("build_engine", "mpinfer.engine", "BuildConfig", BUILD_LOOSE_TYPES),
        ),
        "compare": Stage(
            "compare",
            _plan_compare,
            _run_compare,
            _checker("compare", "mpinfer.compare", "CompareConfig"),
            data_keys=("data",),
        ),
        "report": Stage("report", _plan_report, _run_report, _checker("report", __name__, "ReportSettings")),
    }
