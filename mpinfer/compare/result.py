"""The result of a comparison: per-candidate metrics, checks, divergence, hints and latency.

``bool(result)`` is pass/fail. :meth:`ComparisonResult.to_dict` gives the report JSON (``schema_version`` 1;
NaN/Inf written as the strings ``"nan"``, ``"inf"``, ``"-inf"`` so the file stays strict JSON) and
:meth:`ComparisonResult.from_dict` reads it back, refusing newer schema versions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mpinfer.checks import DEFAULT_CHECKS, Checks, not_applicable_reason, parse_checks
from mpinfer.errors import InvalidInputError, format_message
from mpinfer.metrics import USER_OUTPUT, with_generation, with_user

# Version of the report JSON layout; bump when a field changes meaning or is removed.
SCHEMA_VERSION = 1


def json_float(x: Any) -> Any:
    """A float for JSON: non-finite values become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def read_float(x: Any) -> Any:
    """Inverse of :func:`json_float`."""
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    return x


@dataclass
class OutputMetrics:
    """Metrics of one output of one candidate (values keyed as in :data:`mpinfer.metrics.METRIC_DOCS`).

    ``classifier``: the output was treated as class scores (top-k and label accuracy apply to it).
    """

    name: str
    shape: list[int]
    baseline_dtype: str
    candidate_dtype: str
    classifier: bool
    values: dict[str, float | None]
    hist_abs: dict[str, Any] = field(default_factory=dict)
    hist_rel: dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckOutcome:
    """One check on one output: passed True/False, or None when not applicable.

    A check that applies to none of the outputs it selects is one failed outcome (for the output it names, or
    :data:`ALL_OUTPUTS`), with ``value`` None and ``note`` saying why it is not applicable.
    """

    check: str
    output: str
    value: float | None
    passed: bool | None
    note: str | None = None


# Output name of the outcome of a check that no output could compute.
ALL_OUTPUTS = "(all outputs)"


@dataclass
class NodeError:
    """Error of one node's output along the graph, and how much of it the node added."""

    address: str
    op_type: str
    precision: str
    output: str
    error: float
    input_error: float
    added: float
    max_abs: float
    nonfinite: int
    reason: str | None = None
    detail: str | None = None
    numerics: str = ""  # "strict" for If/Loop/Scan body nodes (the emulator); "" = the Divergence's numerics


@dataclass
class Divergence:
    """Where the candidate went wrong: per-node error along the graph (graph order)."""

    numerics: str
    batches: int
    tensors_compared: int
    nodes: list[NodeError]
    first_jump: NodeError | None
    ranking: list[str]
    skipped: dict[str, int] = field(default_factory=dict)
    note: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass
class SpeedHint:
    """A place where the candidate leaves speed on the table, and the fix."""

    kind: str
    node: str
    op_type: str
    message: str
    fix: str


@dataclass
class CandidateResult:
    """Everything measured for one candidate."""

    name: str
    path: str
    runner: dict[str, Any]
    outputs: list[OutputMetrics]
    checks: list[CheckOutcome] = field(default_factory=list)
    divergence: Divergence | None = None
    precision: dict[str, Any] | None = None
    hints: list[SpeedHint] = field(default_factory=list)
    size_bytes: int | None = None
    generation: dict[str, float] | None = None  # compare --generate: the model-level generation figures
    metrics: dict[str, float | None] | None = None  # compare --metric: the user metrics' figures (model-level)

    def per_output(self) -> dict[str, Any]:
        """Output → metric → value, with the model-level figures as checks read them.

        The generation figures are under ``generate``, the user metrics' under :data:`~mpinfer.metrics.USER_OUTPUT`.
        """
        return with_user(with_generation({o.name: o.values for o in self.outputs}, self.generation), self.metrics)

    @property
    def passed(self) -> bool:
        """True when no applicable check failed."""
        return not any(c.passed is False for c in self.checks)

    def evaluate(self, checks: Checks) -> None:
        """(Re)compute :attr:`checks` for the given thresholds; a check applicable to no output it selects fails."""
        per_output = self.per_output()
        self.checks = []
        for c in checks:
            values = c.selected(per_output)
            outcomes = [CheckOutcome(str(c), n, v, c.evaluate({c.metric: v})) for n, v in values.items()]
            if all(o.passed is None for o in outcomes):
                why = "not applicable: " + not_applicable_reason(c, per_output)
                outcomes = [CheckOutcome(str(c), c.output or ALL_OUTPUTS, None, False, note=why)]
            self.checks += outcomes


@dataclass
class LatencyStats:
    """Latency of one runner at one batch size (milliseconds).

    ``throughput`` (samples/s) and ``speedup`` (baseline time / this runner's time) both use the mean
    latency, so speedup is the ratio of throughputs; p50/p90/p99 show the spread.
    """

    runner: str
    batch_size: int
    iterations: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    min_ms: float
    throughput: float
    speedup: float | None = None


@dataclass
class LatencyResult:
    """Latencies measured in one run for the baseline and every candidate.

    ``device`` is the device the runners used (``cpu``, ``cuda``, ``cuda:0``; several joined by ``+``), not
    the ``--device`` asked for (``auto``).
    """

    device: str
    warmup: int
    iterations: int
    time_budget_s: float | None
    runners: dict[str, dict[str, Any]]
    stats: list[LatencyStats]


@dataclass
class ComparisonResult:
    """The comparison of one baseline with one or more candidates. ``bool()`` is pass/fail."""

    baseline: dict[str, Any]
    candidates: list[CandidateResult]
    checks: list[str]
    data: dict[str, Any]
    environment: dict[str, Any]
    latency: LatencyResult | None = None
    notes: list[str] = field(default_factory=list)
    created: str = ""
    # compare --metric: name → {"file", "function", "sha256"} of each user metric (figures: CandidateResult.metrics)
    user_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __bool__(self) -> bool:
        return all(c.passed for c in self.candidates)

    def failed_checks(self) -> list[tuple[str, CheckOutcome]]:
        """(candidate name, outcome) for every failed check."""
        return [(c.name, o) for c in self.candidates for o in c.checks if o.passed is False]

    def with_checks(self, text: str | None) -> ComparisonResult:
        """A copy re-evaluated against new thresholds (``mpinfer report --check``; None: the default checks).

        Raises:
            InvalidInputError: For a malformed check, or an output selector the report does not have.
        """
        checks = parse_checks(text if text and text.strip() else DEFAULT_CHECKS, list(self.user_metrics))
        names = list(dict.fromkeys(o.name for c in self.candidates for o in c.outputs))
        checks.check_outputs(names)
        if checks.generation and not any(c.generation for c in self.candidates):
            raise InvalidInputError(format_message(
                "--check", ", ".join(str(c) for c in checks.generation),
                "generation checks on a report without generation figures",
                "the comparison ran without --generate N; run mpinfer compare --generate N --data prompts.npz"))
        new = ComparisonResult.from_dict(self.to_dict())
        new.checks = [str(c) for c in checks]
        for cand in new.candidates:
            cand.evaluate(checks)
        return new

    def summary(self) -> str:
        """One line per failed check, or a pass line (for messages and logs)."""
        failed = self.failed_checks()
        if not failed:
            return f"PASS: {len(self.candidates)} candidate(s), checks {', '.join(self.checks)}"
        lines = [f"FAIL: {len(failed)} check(s) failed"]
        lines += [
            f"  {cand}: {check_scope(o.output)}: {o.check} ({o.note or 'got ' + _fmt(o.value)})" for cand, o in failed
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The report JSON object (strict-JSON safe)."""
        return _jsonable(dataclasses.asdict(self))  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, origin: str = "report") -> ComparisonResult:
        """Read a report JSON object back.

        Raises:
            InvalidInputError: For a newer schema version or a malformed object.
        """
        version = d.get("schema_version")
        if not isinstance(version, int):
            raise InvalidInputError(
                format_message(
                    f"Report '{origin}'",
                    "no integer schema_version",
                    "a report.json written by mpinfer compare",
                )
            )
        if version > SCHEMA_VERSION:
            raise InvalidInputError(
                format_message(
                    f"Report '{origin}'",
                    f"schema_version {version}",
                    f"{SCHEMA_VERSION} or older",
                    "it was written by a newer mpinfer; upgrade mpinfer to read it",
                )
            )
        missing = [k for k in ("baseline", "candidates", "checks", "data") if k not in d]
        if missing:
            raise InvalidInputError(
                format_message(
                    f"Report '{origin}'",
                    f"a JSON file that is not a compare result ({_json_kind(d)}; no {', '.join(missing)})",
                    "a report.json written by mpinfer compare --report (or compare --json)",
                    "pass the report.json of a comparison, or its folder",
                )
            )
        try:
            return _from_dict(_unjson(d))
        except (KeyError, TypeError, ValueError) as err:
            raise InvalidInputError(
                format_message(
                    f"Report '{origin}'",
                    f"a malformed report ({err!r})",
                    "a report.json written by mpinfer compare",
                )
            ) from err


def _json_kind(d: Mapping[str, Any]) -> str:
    """What another mpinfer JSON file is, for the message that refuses it as a report."""
    if d.get("kind") == "mpinfer-engine":
        return "an engine sidecar"
    if "nodes" in d and "precision" in d:
        return "a precision plan"
    if d.get("kind"):
        return f"kind {d['kind']!r}"
    return "keys " + ", ".join(list(d)[:6])


def _from_dict(d: dict[str, Any]) -> ComparisonResult:
    def node(x: dict[str, Any] | None) -> NodeError | None:
        return NodeError(**x) if x else None

    cands = []
    for c in d["candidates"]:
        div = c.get("divergence")
        divergence = None
        if div:
            divergence = Divergence(
                **{
                    **div,
                    "nodes": [NodeError(**n) for n in div["nodes"]],
                    "first_jump": node(div.get("first_jump")),
                }
            )
        cands.append(
            CandidateResult(
                name=c["name"],
                path=c["path"],
                runner=c["runner"],
                outputs=[OutputMetrics(**o) for o in c["outputs"]],
                checks=[CheckOutcome(**o) for o in c.get("checks", [])],
                divergence=divergence,
                precision=c.get("precision"),
                size_bytes=c.get("size_bytes"),
                hints=[SpeedHint(**h) for h in c.get("hints", [])],
                generation=c.get("generation"),
                metrics=c.get("metrics"),
            )
        )
    lat = d.get("latency")
    latency = LatencyResult(**{**lat, "stats": [LatencyStats(**s) for s in lat["stats"]]}) if lat else None
    return ComparisonResult(
        baseline=d["baseline"],
        candidates=cands,
        checks=list(d["checks"]),
        data=d["data"],
        environment=d.get("environment", {}),
        latency=latency,
        notes=list(d.get("notes", [])),
        created=d.get("created", ""),
        user_metrics=dict(d.get("user_metrics") or {}),
        schema_version=SCHEMA_VERSION,
    )


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    return json_float(x)


def _unjson(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _unjson(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unjson(v) for v in x]
    return read_float(x)


def check_scope(output: str) -> str:
    """What a failed check was measured on, as the console and the HTML report name it."""
    return output if output in (ALL_OUTPUTS, USER_OUTPUT) else f"output '{output}'"


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    if not isinstance(v, float):
        return str(v)
    if not math.isfinite(v) or abs(v) >= 1e4 or 0 < abs(v) < 1e-3:
        return f"{v:.3g}"
    if 0.999 <= abs(v) < 1:  # cosine / top-k near 1: the digits that checks like cosine>=0.9999 read
        return f"{v:.7g}"
    return f"{v:.4g}"


format_value = _fmt
