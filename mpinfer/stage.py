"""The contract between the pipeline runner (:mod:`mpinfer.pipeline`) and its stages (:mod:`mpinfer.pipeline_stages`).

A stage *plans* (its TOML table and earlier artefacts → :class:`StagePlan`) and then *runs* (plan, folder →
:class:`StageOutput`). Both sides import this module; neither imports the other's internals.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpinfer.errors import InvalidInputError, format_message

STATE_FILE = "pipeline-state.json"
# Folder (under work_dir) that holds one sub-folder per stage key.
ARTEFACT_DIR = "artefacts"


@dataclass(frozen=True)
class StageContext:
    """What a stage sees when it plans.

    Attributes:
        root: Base folder for relative paths in the TOML (the TOML's folder, or ``[pipeline] root``).
        work_dir: The pipeline's work folder.
        section: The stage's TOML table.
        artefacts: Artefacts produced by earlier stages, by kind (``onnx``, ``onnx_low``, ``engine``, ...).
    """

    root: Path
    work_dir: Path
    section: Mapping[str, Any]
    artefacts: Mapping[str, Path]

    def path(self, value: str | Path) -> Path:
        """``value`` resolved against :attr:`root`."""
        p = Path(value).expanduser()
        return p if p.is_absolute() else (self.root / p).resolve()


@dataclass(frozen=True)
class StagePlan:
    """A stage's resolved settings and the files its output depends on.

    Attributes:
        settings: JSON-serialisable settings (paths as absolute strings); hashed into the key.
        inputs: Files (or folders) whose content is hashed into the key.
        output_dir: A fixed output folder instead of the content-addressed one (the final report).
    """

    settings: dict[str, Any]
    inputs: tuple[Path, ...] = ()
    output_dir: Path | None = None


@dataclass(frozen=True)
class StageOutput:
    """What a stage produced.

    Attributes:
        artefacts: Files or folders by kind; later stages find them under these names.
        summary: Small JSON facts for the console and the report (e.g. ``{"passed": true}``).
    """

    artefacts: dict[str, Path]
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    Attributes:
        name: Stage name, also its TOML table name.
        plan: Context -> settings and inputs (no side effects).
        run: (plan, output folder) -> artefacts; calls the stage's public API function.
        check: Validates the stage's raw TOML table (keys, value types) before any stage runs, so a
            mistake in a late table fails at once instead of after the earlier stages; None: no check.
        resumable: A failed or interrupted run leaves its (key-named) folder, and the next run with the same
            key gets it back to continue from (train: its last.pt), instead of starting over.
        data_keys: Keys whose value names a data file or folder when it looks like a path (``random:16`` and
            ``none`` do not); a missing one is refused, naming the table and key, before any stage runs.
    """

    name: str
    plan: Callable[[StageContext], StagePlan]
    run: Callable[[StagePlan, Path], StageOutput]
    check: Callable[[Mapping[str, Any]], None] | None = None
    resumable: bool = False
    data_keys: tuple[str, ...] = ()


def unknown_key_error(table: str, unknown: Sequence[str], valid: Iterable[str]) -> InvalidInputError:
    """The error for keys a TOML table does not have: names the table and key, lists its keys, suggests one."""
    keys = sorted(valid)
    close = difflib.get_close_matches(unknown[0], keys, n=1, cutoff=0.6)
    which = f"key '{unknown[0]}'" if len(unknown) == 1 else f"keys {', '.join(repr(k) for k in unknown)}"
    hint = f"did you mean '{close[0]}'?" if close else f"remove it, or use one of the keys of [{table}]"
    return InvalidInputError(
        format_message(f"Pipeline table [{table}]", f"unknown {which}", f"one of {', '.join(keys)}", hint)
    )
