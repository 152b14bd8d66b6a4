"""One check grammar for ``convert --budget``, ``compare --check``, ``report --check`` and ``pipeline.toml``.

A check list is comma-separated checks, each ``[OUTPUT:]METRIC OP NUMBER``::

    cosine>=0.9999,top1>=0.999,max_abs<=1e-2
    logits:top1>=0.99,boxes:max_abs<=0.5,nonfinite<=0

* ``METRIC``: a name of :data:`mpinfer.metrics.METRIC_DOCS`, any ``topK`` (K <= 100), or an alias
  (:data:`ALIASES`: ``snr`` → ``snr_db``, ``rel`` → ``rel_l2``, ``acc`` → ``accuracy``, ``top-1`` → ``top1``);
  case-insensitive.
* ``OP``: ``>=``, ``<=``, ``>``, ``<`` or ``==``. ``NUMBER``: a float (``1e-3``, ``inf``).
* ``OUTPUT:``: the check applies to that output only (the last ``:`` splits, so ``output:0:max_abs<=1`` names
  output ``output:0``). Without it the check applies to every output the metric applies to, and the worst
  output decides (each must pass).

* Generation figures (``token_agreement``, ``first_divergence``, ``ppl_ratio``, ... of
  :data:`mpinfer.metrics.GENERATION_METRICS`) belong to the model, not to an output: write them plain
  (``token_agreement>=0.95``) or with the selector ``generate:`` (``generate:ppl_ratio<=1.02``); either way
  they read the figures of greedy generation (``compare --generate N``; ``convert --budget`` on a decoder with
  a KV cache and prompt calibration) and print as ``generate:METRIC``.

* The user's own metrics (``--metric NAME=FILE.py:FUNCTION``, :mod:`mpinfer.usermetric`) are model-level too:
  their figures ``NAME``, ``NAME_min`` and ``NAME_max`` are checked plain (``iou_min>=0.9``), once the caller
  passes the names to :func:`parse_checks` (``user``). Their direction is the check's operator.

A metric that does not apply to an output (``top1`` on an output that is not class scores, ``match`` on a float
output) is not applicable there. A check applicable to no output it selects fails, saying why (never a silent
pass); NaN fails every check.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.metrics import (
    GENERATION_METRICS,
    GENERATION_OUTPUT,
    LABEL_METRICS,
    METRIC_DOCS,
    USER_OUTPUT,
    is_class_metric,
    is_generation_metric,
    is_metric,
    model_level,
    topk_of,
)

# compare's checks when none are given: a healthy FP16 model keeps cosine above ~0.9999; below 0.999 an output
# has lost real information, and a NaN/Inf where FP32 was finite is always a defect.
DEFAULT_CHECKS = "cosine>=0.999,nonfinite<=0"
# Other spellings accepted for a metric (compare's and convert's earlier names among them).
ALIASES = {
    "snr": "snr_db",
    "rel": "rel_l2",
    "top-1": "top1",
    "top-5": "top5",
    "acc": "accuracy",
    "acc_drop": "accuracy_drop",
}
_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    ">": operator.gt,
    "<": operator.lt,
}
_TERM = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_\-]*)\s*(>=|<=|==|>|<)\s*(\S+)\s*$")
_EXAMPLE = "cosine>=0.9999,top1>=0.999,max_abs<=1e-2 or logits:top1>=0.99,boxes:max_abs<=0.5"
# The smallest threshold scale of a slack (a threshold of 0, as in nonfinite<=0, is then an absolute margin).
SLACK_FLOOR = 1e-12


@dataclass(frozen=True)
class Check:
    """One threshold: ``[output:]metric op value``; ``output`` None applies it to every output."""

    output: str | None
    metric: str
    op: str
    value: float

    def __str__(self) -> str:
        where = f"{self.output}:" if self.output is not None and self.output != USER_OUTPUT else ""
        return f"{where}{self.metric}{self.op}{self.value:.10g}"  # every digit a user writes (0.99999999)

    def evaluate(self, values: Mapping[str, float | None]) -> bool | None:
        """True/False on one output's values, or None when the metric does not apply there. NaN fails."""
        got = values.get(self.metric)
        if got is None:
            return None
        v = float(got)
        return False if math.isnan(v) else bool(_OPS[self.op](v, self.value))

    def slack(self, value: float) -> float:
        """How far ``value`` is inside (>0) or outside (<0) the threshold, relative to it; NaN: -inf."""
        if math.isnan(value):
            return -math.inf
        scale = max(abs(self.value), SLACK_FLOOR)
        if self.op in (">=", ">"):
            margin = value - self.value
        elif self.op in ("<=", "<"):
            margin = self.value - value
        else:
            margin = -abs(value - self.value)
        return margin / scale if math.isfinite(margin) else math.copysign(math.inf, margin)

    def selected(self, per_output: Mapping[str, Mapping[str, float | None]]) -> dict[str, float | None]:
        """Output → this check's metric value, over the outputs the check selects (generation: model-level)."""
        names = [n for n in per_output if not model_level(n)] if self.output is None else [self.output]
        return {n: per_output.get(n, {}).get(self.metric) for n in names}


@dataclass(frozen=True)
class Checks:
    """A parsed check list: every check must hold."""

    items: tuple[Check, ...]
    text: str

    def __iter__(self) -> Iterator[Check]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __str__(self) -> str:
        return ",".join(str(c) for c in self.items)

    @property
    def needs_labels(self) -> bool:
        """True if a check is measured against the data's ``_labels``."""
        return any(c.metric in LABEL_METRICS for c in self.items)

    @property
    def topk(self) -> tuple[int, ...]:
        """The K of every topK metric the checks name."""
        return tuple(sorted({k for c in self.items if (k := topk_of(c.metric)) is not None}))

    @property
    def generation(self) -> tuple[Check, ...]:
        """The checks on generation figures (model-level; they need greedy generation to be measured)."""
        return tuple(c for c in self.items if c.output == GENERATION_OUTPUT)

    @property
    def user(self) -> tuple[Check, ...]:
        """The checks on the user metrics' figures (model-level)."""
        return tuple(c for c in self.items if c.output == USER_OUTPUT)

    def targets(self) -> dict[str, float]:
        """User figure → the value its checks like best (the direction comes from the operator).

        +inf for ``>=``/``>``, -inf for ``<=``/``<``, the threshold for ``==``. A figure checked both ways has none.
        """
        out: dict[str, float] = {}
        for c in self.user:
            best = math.inf if c.op in (">=", ">") else -math.inf if c.op in ("<=", "<") else c.value
            out[c.metric] = best if out.get(c.metric, best) == best else math.nan
        return {k: v for k, v in out.items() if not math.isnan(v)}

    def without_generation(self) -> Checks | None:
        """The checks on the outputs alone (None when every check is a generation check)."""
        rest = tuple(c for c in self.items if c.output != GENERATION_OUTPUT)
        return Checks(rest, ",".join(str(c) for c in rest)) if rest else None

    @property
    def metrics(self) -> frozenset[str]:
        """The metrics the checks read."""
        return frozenset(c.metric for c in self.items)

    def failures(self, per_output: Mapping[str, Mapping[str, float | None]]) -> list[str]:
        """Readable failures: ``check on 'output' (got v)``, or ``check (not applicable: why)``."""
        out = []
        for c in self.items:
            values = c.selected(per_output)
            applicable = {n: v for n, v in values.items() if v is not None}
            if not applicable:
                out.append(f"{c} (not applicable: {not_applicable_reason(c, per_output)})")
                continue
            out += [
                f"{c} {'' if n == USER_OUTPUT else f'on {n!r} '}(got {v:.6g})"
                for n, v in applicable.items()
                if not c.evaluate({c.metric: v})
            ]
        return out

    def met(self, per_output: Mapping[str, Mapping[str, float | None]]) -> bool:
        """True when every check holds on every output it selects (and applies to at least one)."""
        return not self.failures(per_output)

    def slack(self, per_output: Mapping[str, Mapping[str, float | None]]) -> float:
        """The worst check's margin relative to its threshold: >0 inside, <0 outside, -inf not applicable."""
        worst = math.inf
        for c in self.items:
            values = [v for v in c.selected(per_output).values() if v is not None]
            if not values:
                return -math.inf
            worst = min(worst, *(c.slack(float(v)) for v in values))
        return worst

    def check_outputs(self, names: Sequence[str]) -> None:
        """Refuse an output selector the model does not have.

        Raises:
            InvalidInputError: Naming the check and listing the model's outputs.
        """
        for c in self.items:
            if c.output is not None and not model_level(c.output) and c.output not in names:
                raise InvalidInputError(
                    format_message(
                        f"Check '{c}'",
                        f"unknown output '{c.output}'",
                        "one of " + ", ".join(f"'{n}'" for n in names),
                        "output names are case-sensitive; leave the selector out to check every output",
                    )
                )

    def inapplicable(self, per_output: Mapping[str, Mapping[str, float | None]]) -> list[str]:
        """The checks that apply to no output they select, with why (convert refuses them before searching)."""
        return [
            f"{c} ({not_applicable_reason(c, per_output)})"
            for c in self.items
            if all(v is None for v in c.selected(per_output).values())
        ]


def not_applicable_reason(check: Check, per_output: Mapping[str, Mapping[str, float | None]]) -> str:
    """Why ``check`` has no value on the outputs it selects."""
    if check.output == GENERATION_OUTPUT and check.output not in per_output:
        return "no generation figures: they come from greedy generation (compare --generate N)"
    if check.output == USER_OUTPUT:
        if check.output not in per_output:
            return f"the user metric '{check.metric}' was not measured (give it with --metric NAME=FILE.py:FUNCTION)"
        return (f"the user metric gave no '{check.metric}': NAME_min/NAME_max need one value per sample (a 1-D "
                "array), and every figure needs samples")
    if check.output is not None and check.output not in per_output:
        return f"output '{check.output}' was not compared"
    one = check.output is not None
    who = f"output '{check.output}'" if one else "no output"
    metric = check.metric
    if metric in LABEL_METRICS:
        return (f"{who} {'was not' if one else 'was'} scored against _labels: that needs class scores with one "
                "row per sample, and data with _labels")
    if is_class_metric(metric):
        need = (topk_of(metric) or 1) + 1
        return (
            f"{who} {'does not hold' if one else 'holds'} class scores with at least {need} classes on its last "
            "axis; say which outputs are class scores with --class-outputs (class_outputs in pipeline.toml)"
        )
    if metric in ("match", "mismatch"):
        return f"{who} {'is not' if one else 'is'} an integer or boolean output"
    return f"{who} {'has no' if one else 'has'} values to compute it on"


def _selector(raw: str, selector: str | None, metric: str, user: frozenset[str] = frozenset()) -> str | None:
    """A check's output selector: ``generate`` (generation), :data:`USER_OUTPUT` (a user metric) or the output.

    A generation figure's selector is ``generate``, a user metric's :data:`USER_OUTPUT`; anything else keeps the
    selector given.

    Raises:
        InvalidInputError: A generation or user figure with an output selector, or ``generate:`` with a
            per-output metric.
    """
    if metric in user:
        if selector is not None:
            raise InvalidInputError(format_message(
                f"Check '{raw}'", f"the output selector '{selector}:' on the user metric '{metric}'",
                f"{metric} plain", "a user metric reads every output itself (its function gets them all)"))
        return USER_OUTPUT
    if is_generation_metric(metric):
        if selector not in (None, GENERATION_OUTPUT):
            raise InvalidInputError(format_message(
                f"Check '{raw}'", f"the output selector '{selector}:' on a generation figure",
                f"{metric} plain or {GENERATION_OUTPUT}:{metric}",
                "generation figures belong to the whole model (greedy decoding), not to one output"))
        return GENERATION_OUTPUT
    if selector == GENERATION_OUTPUT:
        raise InvalidInputError(format_message(
            f"Check '{raw}'", f"'{GENERATION_OUTPUT}:' with the per-output metric '{metric}'",
            "a generation figure after generate: (" + ", ".join(sorted(GENERATION_METRICS)) + ")",
            "leave the selector out to check every output"))
    return selector


def user_figures(names: Iterable[str]) -> frozenset[str]:
    """The figures the user metrics ``names`` give: ``NAME``, ``NAME_min`` and ``NAME_max`` of each."""
    return frozenset(f for n in names for f in (n, f"{n}_min", f"{n}_max"))


def _unknown_metric(raw: str, name: str, user: Collection[str] = ()) -> str:
    """The message for an unknown metric: the closest name when there is one (as ``--keep-op`` does), else all.

    ``user``: the figures of the user's own metrics (``--metric``), candidates too.
    """
    import difflib

    names = [*METRIC_DOCS, *ALIASES, *sorted(user)]
    close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.6)
    if close:
        suggestion = ALIASES.get(close[0], close[0])
        return format_message(f"Check '{raw}'", f"unknown metric '{name}'", "a metric of docs/compare.md",
                              f"did you mean '{suggestion}'? (`mpinfer compare --help` lists every metric)")
    mine = (", user metrics: " + ", ".join(sorted(user))) if user else ""
    return format_message(
        f"Check '{raw}'",
        f"unknown metric '{name}'",
        "one of " + ", ".join([*METRIC_DOCS, "topK (K <= 100)"])
        + " (aliases: " + ", ".join(f"{a}={t}" for a, t in ALIASES.items()) + ")" + mine,
        "docs/compare.md defines each metric; a metric of your own is given with --metric NAME=FILE.py:FUNCTION "
        "(metrics = {...} in pipeline.toml)",
    )


def parse_checks(text: str, user: Iterable[str] = ()) -> Checks:
    """Parse a check list (see the module docstring).

    Args:
        text: The check list.
        user: The names of the user's own metrics (``--metric``): their figures are accepted as metrics.

    Raises:
        InvalidInputError: Empty, malformed, an unknown metric (listing the valid ones) or a bad number.
    """
    figures = user_figures(user)
    items = []
    for raw in [p.strip() for p in (text or "").split(",") if p.strip()]:
        selector, colon, term = raw.rpartition(":")
        m = _TERM.match(term)
        if not m:
            raise InvalidInputError(
                format_message(f"Check '{raw}'", None, "[output:]metric<op>number, op one of >= <= > < ==",
                               f"e.g. {_EXAMPLE}")
            )
        name = m.group(1).lower()
        metric = ALIASES.get(name, name)
        if name in figures:
            metric = name
        elif not is_metric(metric):
            raise InvalidInputError(_unknown_metric(raw, m.group(1), figures))
        try:
            value = float(m.group(3))
        except ValueError as err:
            raise InvalidInputError(format_message(f"Check '{raw}'", f"value '{m.group(3)}'", "a number")) from err
        if math.isnan(value):
            raise InvalidInputError(format_message(f"Check '{raw}'", "the value nan", "a number (nan meets nothing)"))
        if colon and not selector.strip():
            raise InvalidInputError(format_message(f"Check '{raw}'", "an empty output name before ':'",
                                                   "OUTPUT:metric<op>number, or no ':' for every output"))
        where = _selector(raw, selector.strip() if colon else None, metric, figures)
        items.append(Check(where, metric, m.group(2), value))
    if not items:
        raise InvalidInputError(format_message("Checks", repr(text), "at least one check", f"e.g. {_EXAMPLE}"))
    return Checks(tuple(items), text)
