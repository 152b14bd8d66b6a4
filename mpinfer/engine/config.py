"""Build settings for ``build-engine``: the config object, shape profiles and size parsing.

Everything here is pure Python (no TensorRT, no onnxruntime), so it is unit-tested on any machine.

A shape profile is written ``name:min,opt,max`` with each shape as ``AxBxC``:
``x:1x3x64x64,8x3x64x64,32x3x64x64``. Several inputs are separated by ``;`` (or given as repeated
options). A single shape (``x:8x3x64x64``) fixes the input: min = opt = max.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpinfer.data.feeds import DEFAULT_BATCH_SIZE
from mpinfer.errors import InvalidInputError, format_message
from mpinfer.memory import parse_size
from mpinfer.specs import Precision, TensorSpec, batch_symbols, parse_enum

# TensorRT's own default builder optimization level (IBuilderConfig.builder_optimization_level): a good
# trade between build time and engine speed; 4-5 search longer, 0-2 build faster.
DEFAULT_OPT_LEVEL = 3
# Highest builder optimization level TensorRT accepts.
MAX_OPT_LEVEL = 5

_SHAPES_HINT = (
    "write name:min,opt,max with shapes like 1x3x64x64, e.g. "
    "\"x:1x3x64x64,8x3x64x64,32x3x64x64\"; separate inputs with ';'"
)
class Backend(str, enum.Enum):
    """Which engine ``build-engine`` produces."""

    AUTO = "auto"
    TENSORRT = "tensorrt"
    ONNXRUNTIME = "onnxruntime"

    @classmethod
    def parse(cls, value: str | Backend) -> Backend:
        """Return the Backend for ``value``.

        Raises:
            InvalidInputError: For an unknown name.
        """
        return parse_enum(cls, value, "Backend", {"trt": "tensorrt", "ort": "onnxruntime"})


@dataclass(frozen=True)
class ShapeProfile:
    """Min, opt and max shape of one input for a TensorRT optimization profile.

    Attributes:
        name: Input name.
        min: Smallest shape the engine accepts.
        opt: Shape the kernels are tuned for.
        max: Largest shape the engine accepts.
    """

    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def to_dict(self) -> dict[str, list[int]]:
        """JSON form ``{"min": [...], "opt": [...], "max": [...]}``."""
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}

    def contains(self, shape: Sequence[int]) -> bool:
        """True when ``shape`` lies between min and max in every dim."""
        return len(shape) == len(self.min) and all(
            lo <= s <= hi for lo, s, hi in zip(self.min, shape, self.max, strict=False)
        )

    def __str__(self) -> str:
        return f"{self.name}:" + ",".join("x".join(map(str, s)) for s in (self.min, self.opt, self.max))


def _parse_shape(text: str, where: str) -> tuple[int, ...]:
    dims = text.strip().lower().split("x")
    if not text.strip() or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise InvalidInputError(
            format_message(
                f"{where}: shape '{text}'",
                None,
                "positive integers joined by 'x', e.g. 8x3x64x64",
                _SHAPES_HINT,
            )
        )
    return tuple(int(d) for d in dims)


def parse_shape_profile(text: str) -> ShapeProfile:
    """Parse one ``name:min,opt,max`` (or ``name:shape``) entry.

    Raises:
        InvalidInputError: If malformed, ranks differ, or min <= opt <= max does not hold.
    """
    where = f"Shape profile '{text.strip()}'"
    name, sep, shapes_text = text.strip().rpartition(":")
    if not sep or not name:
        raise InvalidInputError(format_message(where, "no input name", "name:min,opt,max", _SHAPES_HINT))
    parts = [p for p in shapes_text.split(",")]
    if len(parts) not in (1, 3):
        raise InvalidInputError(
            format_message(where, f"{len(parts)} shapes", "3 (min,opt,max) or 1 (fixed)", _SHAPES_HINT)
        )
    shapes = [_parse_shape(p, where) for p in parts]
    if len(shapes) == 1:
        shapes = shapes * 3
    lo, opt, hi = shapes
    if not len(lo) == len(opt) == len(hi):
        raise InvalidInputError(
            format_message(
                where,
                f"ranks {len(lo)}, {len(opt)}, {len(hi)}",
                "the same rank for min, opt and max",
                _SHAPES_HINT,
            )
        )
    if not all(a <= b <= c for a, b, c in zip(lo, opt, hi, strict=False)):
        raise InvalidInputError(
            format_message(
                where,
                f"min {lo}, opt {opt}, max {hi}",
                "min <= opt <= max in every dim",
                "order the shapes as min,opt,max",
            )
        )
    return ShapeProfile(name.strip(), lo, opt, hi)


def parse_shapes(values: str | Iterable[str] | None) -> tuple[ShapeProfile, ...]:
    """Parse ``--shapes`` values (each may hold several ``;``-separated inputs).

    Raises:
        InvalidInputError: On a malformed entry or an input given twice.
    """
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    out: list[ShapeProfile] = []
    for value in values:
        for entry in value.split(";"):
            if entry.strip():
                out.append(parse_shape_profile(entry))
    names = [p.name for p in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InvalidInputError(
            format_message(
                "--shapes", f"input(s) {', '.join(dupes)} given twice", "one min,opt,max per input"
            )
        )
    return tuple(out)


def check_profiles(profiles: Sequence[ShapeProfile], specs: Sequence[TensorSpec]) -> None:
    """Check profiles against the model inputs: known names, ranks, fixed dims.

    Args:
        profiles: Parsed ``--shapes``.
        specs: The model's inputs.

    Raises:
        InvalidInputError: Naming the first mismatch.
    """
    by_name = {s.name: s for s in specs}
    for prof in profiles:
        spec = by_name.get(prof.name)
        if spec is None:
            raise InvalidInputError(
                format_message(
                    f"--shapes input '{prof.name}'", "a name the model lacks", f"one of {sorted(by_name)}"
                )
            )
        if len(spec.shape) != len(prof.min):
            raise InvalidInputError(
                format_message(
                    f"--shapes input '{prof.name}'",
                    f"rank {len(prof.min)}",
                    f"rank {len(spec.shape)} ({_fmt_spec_shape(spec)})",
                )
            )
        for i, d in enumerate(spec.shape):
            if isinstance(d, int) and not prof.min[i] == prof.opt[i] == prof.max[i] == d:
                raise InvalidInputError(
                    format_message(
                        f"--shapes input '{prof.name}' dim {i}",
                        f"{prof.min[i]},{prof.opt[i]},{prof.max[i]}",
                        f"{d} (fixed in the model: {_fmt_spec_shape(spec)})",
                    )
                )


def complete_profiles(
    profiles: Sequence[ShapeProfile], specs: Sequence[TensorSpec]
) -> tuple[tuple[ShapeProfile, ...], str | None]:
    """Give every dynamic input a profile, as TensorRT needs: ``--shapes`` first, then sizes the model records.

    A dynamic input without ``--shapes`` gets a default profile when every one of its symbolic dims has a
    size to go by. Its leading dim is the batch: 1 to ``DEFAULT_BATCH_SIZE`` (16, the batch ``compare``
    feeds), or to the recorded example size when that is larger, tuned at the top. Any other symbolic dim is
    fixed at the example size ``mpinfer export`` recorded (``mpinfer.dim_sizes``). trtexec and Polygraphy fix
    such dims at 1; a model's own sizes are a better guess, and a dim with no size is refused, not guessed.

    Args:
        profiles: Parsed (and checked) ``--shapes``.
        specs: The model's inputs.

    Returns:
        The profiles for every dynamic input, and a note saying which were defaulted (None when none were).

    Raises:
        InvalidInputError: For a dynamic input without ``--shapes`` whose non-batch dims have no known size.
    """
    covered = {p.name for p in profiles}
    missing = [s for s in specs if s.symbols and s.name not in covered]
    if not missing:
        return tuple(profiles), None
    batch = batch_symbols(missing)
    sizes = {d: n for s in missing for d, n in s.dim_sizes.items()}
    _refuse_unknown_dims(missing, batch, sizes)
    added, top = _default_profiles(missing, batch, sizes)
    note = (
        f"no --shapes for dynamic input(s) {', '.join(s.name for s in missing)}: built for "
        f"{'; '.join(str(p) for p in added)} ({f'batch 1-{top}, ' if top else ''}other dims at the sizes the "
        "model records); pass --shapes for other sizes"
    )
    return (*profiles, *added), note


def _refuse_unknown_dims(missing: Sequence[TensorSpec], batch: set[str], sizes: Mapping[str, int]) -> None:
    """Refuse inputs without ``--shapes`` that have a non-batch symbolic dim of no recorded size."""
    unknown = sorted({d for s in missing for d in s.symbols if d not in batch and d not in sizes})
    if unknown:
        example = ";".join(_example_profile(s) for s in missing)
        raise InvalidInputError(
            format_message(
                "TensorRT build",
                f"dynamic input(s) {', '.join(s.name for s in missing)} without a shape profile, and no "
                f"recorded size for dim(s) {', '.join(unknown)}",
                "--shapes name:min,opt,max for every dynamic input",
                f'e.g. --shapes "{example}"',
            )
        )


def _default_profiles(
    missing: Sequence[TensorSpec], batch: set[str], sizes: Mapping[str, int]
) -> tuple[list[ShapeProfile], int | None]:
    """A profile per input (batch dims 1 to the default or recorded size, others fixed); the batch's top."""
    # one range per symbol, so that inputs sharing a dim get the same sizes
    ranges = {d: (1, max(DEFAULT_BATCH_SIZE, sizes.get(d, 1))) if d in batch else (sizes[d], sizes[d])
              for s in missing for d in s.symbols}
    added = []
    for s in missing:
        lo = tuple(d if isinstance(d, int) else ranges[d][0] for d in s.shape)
        hi = tuple(d if isinstance(d, int) else ranges[d][1] for d in s.shape)
        added.append(ShapeProfile(s.name, lo, hi, hi))
    top = max((ranges[d][1] for d in batch), default=None)
    return added, top


def _fmt_spec_shape(spec: TensorSpec) -> str:
    return "x".join(str(d) for d in spec.shape)


def _example_profile(spec: TensorSpec) -> str:
    def shape(n: int) -> str:
        return "x".join(str(d) if isinstance(d, int) else str(n) for d in spec.shape)

    return f"{spec.name}:{shape(1)},{shape(8)},{shape(32)}"


@dataclass(frozen=True)
class BuildConfig:
    """Settings of one ``build-engine`` run.

    Attributes:
        model: The (mixed-precision) ONNX model.
        output: Engine path; None: ``<model stem>.engine`` (TensorRT) or ``.ort`` (ONNX Runtime) beside it.
        backend: ``auto`` picks TensorRT when it is importable and a GPU is visible, else ONNX Runtime.
        shapes: One optimization profile: min/opt/max per dynamic input.
        timing_cache: TensorRT timing cache file, loaded when present and saved after the build.
        workspace: TensorRT workspace pool limit in bytes (None: TensorRT's default, the GPU's memory).
        opt_level: Builder optimization level 0-5 (ONNX Runtime: 0 none, 1 basic, 2 extended, 3+ all).
        weak_precisions: TensorRT < 11 weak-typing builder flags (``--fp16``/``--bf16``).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        force: Overwrite an existing output.
        plan: Precision plan to summarise in the sidecar (default: ``<model stem>.plan.json`` if present).
    """

    model: Path
    output: Path | None = None
    backend: Backend = Backend.AUTO
    shapes: tuple[ShapeProfile, ...] = ()
    timing_cache: Path | None = None
    workspace: int | None = None
    opt_level: int = DEFAULT_OPT_LEVEL
    weak_precisions: tuple[Precision, ...] = ()
    device: str = "auto"
    force: bool = False
    plan: Path | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> BuildConfig:
        """Build a config from loose values (a TOML table, CLI options): parses strings into types.

        Raises:
            InvalidInputError: On an unknown key or a bad value.
        """
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            hint = (
                "build-engine holds no memory mpinfer sizes; TensorRT's builder takes workspace (--workspace, "
                "GPU memory)" if "memory_limit" in unknown else None
            )
            raise InvalidInputError(
                format_message(
                    "build-engine settings", f"unknown key(s) {unknown}", f"keys among {sorted(known)}", hint
                )
            )
        kw: dict[str, Any] = dict(values)
        for key in ("model", "output", "timing_cache", "plan"):
            if kw.get(key) is not None:
                kw[key] = Path(kw[key])
        if "backend" in kw:
            kw["backend"] = Backend.parse(kw["backend"])
        if "shapes" in kw:
            shapes = kw["shapes"]
            if not (isinstance(shapes, tuple) and all(isinstance(s, ShapeProfile) for s in shapes)):
                kw["shapes"] = parse_shapes(shapes)
        if kw.get("workspace") is not None:
            kw["workspace"] = parse_size(kw["workspace"], "--workspace")
        if "weak_precisions" in kw:
            wp = kw["weak_precisions"]
            kw["weak_precisions"] = tuple(Precision.parse(p) for p in ([wp] if isinstance(wp, str) else wp))
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Check value ranges that the types alone do not express.

        Raises:
            InvalidInputError: For an out-of-range optimization level or a weak FP32 flag.
        """
        if not isinstance(self.opt_level, int) or not 0 <= self.opt_level <= MAX_OPT_LEVEL:
            raise InvalidInputError(
                format_message("--opt-level", repr(self.opt_level), f"an integer from 0 to {MAX_OPT_LEVEL}")
            )
        for p in self.weak_precisions:
            if not p.is_low:
                raise InvalidInputError(format_message("Weak precision flag", p.value, "fp16 or bf16"))
        if not _DEVICE_RE.match(self.device):
            raise InvalidInputError(
                format_message("--device", repr(self.device), "auto, cpu, cuda or cuda:N")
            )


_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+|gpu)$")


@dataclass(frozen=True)
class BuildResult:
    """What ``build_engine`` produced.

    Attributes:
        path: The engine file.
        sidecar: The ``<engine>.json`` metadata file beside it.
        backend: ``tensorrt`` or ``onnxruntime``.
        reason: Why this backend was chosen (for ``auto``).
        notes: Warnings worth showing the user (weak typing, FP32-only model, ...).
    """

    path: Path
    sidecar: Path
    backend: Backend
    reason: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
