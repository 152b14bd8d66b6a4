"""``mpinfer run pipeline.toml``: one config file drives every stage, resumably.

Stages (train → export → convert → build_engine → compare → report) come from a registry of
:class:`Stage` objects; each TOML table configures one stage. A stage first *plans*: it turns its table and
the artefacts of earlier stages into JSON settings and a list of input files. The stage key is the sha256
of the stage name, the mpinfer version, the settings and the sha256 of every input file, so it changes
exactly when something the stage depends on changes. Outputs go to ``<work_dir>/artefacts/<stage>-<key>``
(content-addressed); the state file ``<work_dir>/pipeline-state.json`` records each key with the sha256 of
its outputs. A re-run skips a stage whose key is recorded and whose outputs are intact, and says so; a
failed run resumes after the last finished stage; ``force`` re-runs everything.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpinfer import __version__
from mpinfer.claim import claim_outputs
from mpinfer.data.decode import PROMPTS_PREFIX
from mpinfer.errors import InvalidInputError, MpinferError, format_message
from mpinfer.fileio import discard, make_dirs, sha256_file, sweep_temps, write_json_atomic
from mpinfer.pipeline_stages import default_stages
from mpinfer.stage import (
    ARTEFACT_DIR,
    STATE_FILE,
    Stage,
    StageContext,
    StageOutput,
    StagePlan,
    unknown_key_error,
)

logger = logging.getLogger(__name__)

STATE_SCHEMA_VERSION = 1
# Characters of the key used in folder names: 48 bits, no collisions among a pipeline's few hundred runs.
KEY_PREFIX_CHARS = 12
# Keys of the [pipeline] table, both folder paths: a typo must not silently send the outputs elsewhere.
PIPELINE_KEYS = ("root", "work_dir")


@dataclass(frozen=True)
class StageRun:
    """How one stage went in this run.

    Attributes:
        name: Stage name.
        status: ``ran`` or ``skipped``.
        key: The stage key (sha256 hex).
        artefacts: Its artefacts by kind.
        seconds: Run time (0 when skipped).
        summary: The stage's summary facts.
    """

    name: str
    status: str
    key: str
    artefacts: dict[str, Path]
    seconds: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PipelineResult:
    """The outcome of :func:`run_pipeline`.

    Attributes:
        stages: One entry per stage, in order.
        work_dir: The work folder.
        state_path: The state file.
    """

    stages: tuple[StageRun, ...]
    work_dir: Path
    state_path: Path

    @property
    def artefacts(self) -> dict[str, Path]:
        """All artefacts by kind (later stages win)."""
        out: dict[str, Path] = {}
        for s in self.stages:
            out.update(s.artefacts)
        return out

    @property
    def passed(self) -> bool:
        """False when a stage reported ``passed: false`` (the comparison)."""
        return all(s.summary.get("passed", True) for s in self.stages)


def load_toml(path: Path) -> dict[str, Any]:
    """Read a TOML file with tomllib (Python 3.11+) or tomli.

    Raises:
        InvalidInputError: Missing file or invalid TOML (with the parser's line and column).
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on Python 3.10 only
        try:
            import tomli as tomllib
        except ImportError as err:
            raise MpinferError("Reading pipeline.toml on Python 3.10 needs tomli: pip install tomli") from err
    if not path.is_file():
        raise InvalidInputError(format_message(f"Pipeline file '{path}'", "no such file", "a .toml file"))
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise InvalidInputError(
            format_message(
                f"Pipeline file '{path}'",
                f"invalid TOML ({err})",
                "valid TOML",
                "check quotes and brackets on the line named",
            )
        ) from err


def hash_path(path: Path) -> str:
    """sha256 of a file, or of a folder's files (relative names and contents, sorted)."""
    if path.is_file():
        return sha256_file(path)
    if path.is_dir():
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(str(f.relative_to(path)).encode())
            h.update(sha256_file(f).encode())
        return h.hexdigest()
    raise InvalidInputError(
        format_message(f"Pipeline input '{path}'", "no such file or folder", "an existing path")
    )


def stage_key(name: str, plan: StagePlan) -> str:
    """The content address of a stage run: sha256 over name, mpinfer version, settings and input hashes."""
    payload = {
        "stage": name,
        "mpinfer_version": __version__,
        "settings": plan.settings,
        "inputs": {str(p): hash_path(p) for p in sorted(set(plan.inputs), key=str)},
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def _load_state(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"schema_version": STATE_SCHEMA_VERSION, "stages": {}}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(state, dict) or not isinstance(state.get("stages"), dict):
            raise ValueError("no 'stages' table")
    except ValueError as err:
        logger.warning("Ignoring unreadable pipeline state %s (%s): every stage will run", path, err)
        return {"schema_version": STATE_SCHEMA_VERSION, "stages": {}}
    return state


def _intact(record: Mapping[str, Any]) -> bool:
    for entry in record.get("artefacts", {}).values():
        p = Path(entry["path"])
        if not p.exists() or hash_path(p) != entry["sha256"]:
            return False
    return True


def _run_stage(
    stage: Stage, plan: StagePlan, key: str, work_dir: Path, *, force: bool = False
) -> tuple[StageOutput, float]:
    out_dir = plan.output_dir or work_dir / ARTEFACT_DIR / f"{stage.name}-{key[:KEY_PREFIX_CHARS]}"
    # Only a key-named folder is kept for resuming: its name says the settings are the same ones.
    resumable = stage.resumable and plan.output_dir is None
    sweep_temps(out_dir)  # what a killed run was deleting
    if out_dir.exists() and (force or not resumable):  # leftovers of a failed run, a fixed older folder
        discard(out_dir)  # (--force: a kept folder too, the stage starts over); all at once, even if killed
    make_dirs(out_dir)
    start = time.perf_counter()
    logger.info("Stage %s: running", stage.name)
    try:
        output = stage.run(plan, out_dir)
    except BaseException:
        if not resumable:
            discard(out_dir)
        raise
    seconds = time.perf_counter() - start
    logger.info("Stage %s: done in %.1f s", stage.name, seconds)
    return output, seconds


def _settle(
    stage: Stage, ctx: StageContext, state: dict[str, Any], state_path: Path, *, force: bool
) -> StageRun:
    """Skip ``stage`` when its key is recorded with intact outputs; else run it and record it."""
    plan = stage.plan(ctx)
    key = stage_key(stage.name, plan)
    records: MutableMapping[str, Any] = state["stages"]
    record = records.get(stage.name, {}).get(key)
    if not force and record is not None and _intact(record):
        artefacts = {k: Path(v["path"]) for k, v in record["artefacts"].items()}
        return StageRun(stage.name, "skipped", key, artefacts, 0.0, dict(record.get("summary", {})))
    output, seconds = _run_stage(stage, plan, key, ctx.work_dir, force=force)
    records.setdefault(stage.name, {})[key] = {
        "artefacts": {k: {"path": str(p), "sha256": hash_path(p)} for k, p in output.artefacts.items()},
        "summary": output.summary,
        "settings": plan.settings,
        "seconds": round(seconds, 3),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    state["latest"] = {**state.get("latest", {}), stage.name: key}
    write_json_atomic(state_path, state)  # after every stage: a later failure resumes from here
    return StageRun(stage.name, "ran", key, dict(output.artefacts), seconds, dict(output.summary))


def _check_tables(path: Path, doc: Mapping[str, Any], registry: Mapping[str, Stage]) -> None:
    """Refuse non-table entries, bad [pipeline] keys and (through each stage's check) bad stage tables."""
    for name, value in doc.items():
        if not isinstance(value, dict):
            raise InvalidInputError(
                format_message(
                    f"Pipeline file '{path}'",
                    f"{name} = {value!r}",
                    f"a [{name}] table",
                    f"write [{name}] on a line of its own, followed by its key = value lines",
                )
            )
    meta = doc.get("pipeline", {})
    unknown = sorted(set(meta) - set(PIPELINE_KEYS))
    if unknown:
        raise unknown_key_error("pipeline", unknown, PIPELINE_KEYS)
    for key, value in meta.items():
        if not isinstance(value, str):
            raise InvalidInputError(
                format_message(
                    f"Pipeline table [pipeline] {key} = {value!r}", f"a {type(value).__name__}", "a string (a folder)"
                )
            )
    for name, stage in registry.items():
        if name in doc and stage.check is not None:
            stage.check(doc[name])


def _check_data_paths(doc: Mapping[str, Any], registry: Mapping[str, Stage], root: Path) -> None:
    """Refuse a stage's data path (``[convert] calibration``, ``[compare] data``) that names no file or folder."""
    for name, stage in registry.items():
        for key in stage.data_keys:
            value = doc.get(name, {}).get(key)
            if isinstance(value, str) and value.startswith(PROMPTS_PREFIX):  # prompts:FILE[:steps=N]: the FILE
                value = value[len(PROMPTS_PREFIX):].split(":", 1)[0]
            if not isinstance(value, str) or not ("/" in value or "." in Path(value).name):
                continue  # random:16, none, a data set's name
            if not (root / Path(value).expanduser()).exists():
                raise InvalidInputError(
                    format_message(
                        f"Pipeline table [{name}] {key} = {value!r}",
                        f"no such file or folder ('{root / Path(value).expanduser()}')",
                        "an existing data file or folder",
                        "relative paths start from the TOML's folder, or from [pipeline] root when it is set",
                    )
                )


def run_pipeline(
    path: str | Path,
    *,
    force: bool = False,
    registry: Mapping[str, Stage] | None = None,
    on_stage: Callable[[StageRun], None] | None = None,
) -> PipelineResult:
    """Run every configured stage of a pipeline TOML, skipping those whose key and outputs are unchanged.

    Args:
        path: The pipeline TOML. ``[pipeline]`` holds ``work_dir`` (default ``out/pipeline``) and ``root``
            (base of relative paths, default the TOML's folder); every other table configures the stage of
            that name.
        force: Re-run every stage.
        registry: Stages by name, in run order (default: :func:`mpinfer.pipeline_stages.default_stages`).
        on_stage: Called after each stage (the CLI prints progress with it).

    Returns:
        What ran, what was skipped, and every artefact.

    Raises:
        InvalidInputError: Bad TOML, unknown table, or bad stage settings.
        MpinferError: A stage failed (earlier stages stay recorded, so a re-run resumes there).
    """
    path = Path(path)
    doc = load_toml(path)
    if registry is None:
        registry = default_stages()
    root = _check_pipeline(path, doc, registry)
    meta = doc.get("pipeline", {})
    work_dir = (root / str(meta.get("work_dir", "out/pipeline"))).resolve()
    make_dirs(work_dir, f"[pipeline] work_dir {work_dir}")
    with claim_outputs([work_dir]):  # a second run on this work_dir fails at once, naming this one
        runs = _run_stages(path, doc, registry, root, work_dir, force=force, on_stage=on_stage)
    return PipelineResult(tuple(runs), work_dir, work_dir / STATE_FILE)


def _check_pipeline(path: Path, doc: Mapping[str, Any], registry: Mapping[str, Stage]) -> Path:
    """Refuse unknown tables, a TOML without stages, bad stage settings, a bad root or missing data; the root.

    Raises:
        InvalidInputError: Naming the table and key.
    """
    unknown = sorted(set(doc) - set(registry) - {"pipeline"})
    if unknown:
        close = difflib.get_close_matches(unknown[0], ["pipeline", *registry], n=1, cutoff=0.6)
        raise InvalidInputError(
            format_message(
                f"Pipeline file '{path}'",
                f"table(s) {', '.join(f'[{t}]' for t in unknown)}",
                f"tables among {', '.join(f'[{t}]' for t in ['pipeline', *registry])}",
                f"did you mean [{close[0]}]?" if close else None,
            )
        )
    if not set(doc) & set(registry):
        raise InvalidInputError(
            format_message(f"Pipeline file '{path}'", "no stage tables", f"at least one of {list(registry)}")
        )
    _check_tables(path, doc, registry)
    meta = doc.get("pipeline", {})
    root = (path.parent / str(meta.get("root", "."))).resolve()
    if not root.is_dir():
        raise InvalidInputError(
            format_message(
                f"Pipeline table [pipeline] root = {meta.get('root')!r}",
                f"'{root}', which is not a folder",
                "the folder relative paths start from",
                "it is relative to the TOML's folder; omit it to use that folder",
            )
        )
    _check_data_paths(doc, registry, root)
    return root


def _run_stages(
    path: Path,
    doc: Mapping[str, Any],
    registry: Mapping[str, Stage],
    root: Path,
    work_dir: Path,
    *,
    force: bool,
    on_stage: Callable[[StageRun], None] | None,
) -> list[StageRun]:
    """Settle every configured stage in order; Ctrl-C becomes PipelineInterrupted saying what was kept."""
    state_path = work_dir / STATE_FILE
    state = _load_state(state_path)
    artefacts: dict[str, Path] = {}
    runs: list[StageRun] = []
    for name, stage in registry.items():
        if name not in doc:
            continue
        ctx = StageContext(root=root, work_dir=work_dir, section=dict(doc[name]), artefacts=dict(artefacts))
        try:
            run = _settle(stage, ctx, state, state_path, force=force)
        except KeyboardInterrupt as err:
            raise PipelineInterrupted(_interrupted(path, runs, stage, state_path)) from err
        artefacts.update(run.artefacts)
        runs.append(run)
        if on_stage is not None:
            on_stage(run)
    return runs


class PipelineInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``mpinfer run``; the message says which stages were kept and how to resume."""


def _interrupted(path: Path, runs: list[StageRun], stage: Stage, state_path: Path) -> str:
    kept = ", ".join(r.name for r in runs)
    done = f"Kept the finished stage(s) {kept} (recorded in {state_path})" if runs else "No stage had finished"
    current = (
        f"the interrupted stage '{stage.name}' keeps its folder and continues where it stopped"
        if stage.resumable
        else f"the interrupted stage '{stage.name}' wrote nothing"
    )
    return f"{done}; {current}. Resume with: mpinfer run {path}"
