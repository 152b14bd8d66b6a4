"""Conformance through the CLI: ``mpinfer convert`` over ONNX's own operator test cases, as a user runs it.

Every float case (``onnx.backend.test.case.node.collect_testcases()``: models with FP32 tensors and none in
FP16/BF16, that ONNX Runtime runs in FP32 and the checker accepts) is converted twice, in-process through the
CLI's ``main`` (click's ``CliRunner``), one case after another (no worker processes):

* ``none``: ``mpinfer convert model.onnx -o out.onnx`` with no data (mpinfer's own seeded random data, the
  default floor verified on it; random data the case rejects, or that gives no output a value, is ``refused``
  with what to pass: issue 35);
* ``own``: ``--calibration case.npz`` holding the case's own inputs, one array per input, as the case feeds them.

Each run is one of:

* ``ok``: exit 0, and the written model passes ``onnx.checker`` and loads in ONNX Runtime, and its outputs on
  the case's inputs match the FP32 model's within FP16's tolerance (``tests/precision/conformance._close``);
* ``refused``: exit 1 with one ``Error:`` line (a user error: :class:`mpinfer.errors.MpinferError`);
* ``crash``: any other exception (a traceback);
* ``invalid``: exit 0, but the written model fails the checker or ONNX Runtime's load (or does not run);
* ``wrong``: exit 0, a valid model, but outputs beyond the tolerance.

Cases whose inputs an ``.npz`` cannot hold (sequences, optionals) have no ``own`` run.

    PYTHONPATH=$PWD .venv/bin/python bench/conformance.py [--sample N] [--mode none,own] [-v]
"""

from __future__ import annotations

import argparse
import io
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MODES = ("none", "own")
STATUSES = ("ok", "refused", "crash", "invalid", "wrong")


@dataclass
class CaseResult:
    """One conversion of one case."""

    name: str
    mode: str
    status: str
    detail: str = ""
    warnings: str = ""


@dataclass
class Tally:
    """Results of one mode over the cases."""

    mode: str
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        """Runs per status (every status listed, zero included)."""
        c = Counter(r.status for r in self.results)
        return {s: c.get(s, 0) for s in STATUSES}

    def ok_share(self) -> float:
        """ok runs over all runs."""
        return self.counts()["ok"] / max(1, len(self.results))


def runnable_cases(sample: int | None = None) -> list[Any]:
    """The float cases that ONNX Runtime runs in FP32 and the ONNX checker accepts (sorted by name).

    ``sample``: those among a deterministic spread of this many float cases (:func:`sample_cases`).
    """
    import onnx

    from tests.precision.conformance import _feeds, _ort, float_cases

    out = []
    cases = float_cases()
    for case in sample_cases(cases, sample) if sample else cases:
        try:
            onnx.checker.check_model(case.model, full_check=True)
            with np.errstate(all="ignore"):
                _ort(case.model, _feeds(case))
        except Exception:  # noqa: BLE001 - ORT lacks this op/variant, or the checker refuses it
            continue
        out.append(case)
    return out


def sample_cases(cases: Sequence[Any], n: int) -> list[Any]:
    """A deterministic spread of ``n`` cases: every k-th by name."""
    if n >= len(cases):
        return list(cases)
    step = len(cases) / n
    return [cases[int(i * step)] for i in range(n)]


def _npz_inputs(case: Any) -> dict[str, np.ndarray] | None:
    """The case's inputs as .npz arrays, or None when one of them is not a tensor (sequence, optional)."""
    from tests.precision.conformance import _feeds

    feeds = _feeds(case)
    if not all(isinstance(v, np.ndarray) and v.dtype != object for v in feeds.values()):
        return None
    return feeds


class _LogCapture:
    """mpinfer's log records of one run (the CLI's own handler is marked so that it is not added again)."""

    def __init__(self) -> None:
        self.stream = io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
        self.handler._mpinfer = True  # type: ignore[attr-defined]
        logging.getLogger("mpinfer").addHandler(self.handler)

    def take(self) -> str:
        """The records since the last call."""
        text = self.stream.getvalue()
        self.stream.seek(0)
        self.stream.truncate()
        return text

    def close(self) -> None:
        """Detach the handler."""
        logging.getLogger("mpinfer").removeHandler(self.handler)


def _check_written(case: Any, out: Path) -> CaseResult | None:
    """``invalid`` or ``wrong`` for the written model, or None when it is valid and right."""
    import onnx

    from tests.precision.conformance import _close, _feeds, _ort, _run_converted

    try:
        model = onnx.load(str(out))
        onnx.checker.check_model(model, full_check=True)
    except Exception as err:  # noqa: BLE001 - what the checker says is the finding
        return CaseResult(case.name, "", "invalid", f"checker: {err}"[:300])
    feeds = _feeds(case)
    try:
        with np.errstate(all="ignore"):
            want = _ort(case.model, feeds)
            got = _run_converted(model, feeds)
    except Exception as err:  # noqa: BLE001 - the written model must load and run where the original does
        return CaseResult(case.name, "", "invalid", f"does not run: {type(err).__name__}: {err}"[:300])
    expected = case.data_sets[0][1]
    reference = expected if all(_close(r, e) for r, e in zip(want, expected, strict=False)) else want
    if len(got) != len(reference) or not all(_close(g, r) for g, r in zip(got, reference, strict=False)):
        return CaseResult(case.name, "", "wrong", "outputs beyond FP16 tolerance")
    return None


def convert_case(case: Any, mode: str, folder: Path, logs: _LogCapture | None = None) -> CaseResult | None:
    """Convert one case through the CLI in ``mode``; None when the mode does not apply (no .npz form)."""
    import onnx
    from click.testing import CliRunner

    from mpinfer.cli import main

    args = ["convert", str(folder / "model.onnx"), "-o", str(folder / f"{mode}.fp16.onnx")]
    if mode == "own":
        arrays = _npz_inputs(case)
        if arrays is None:
            return None
        np.savez(folder / "own.npz", **arrays)
        args += ["--calibration", str(folder / "own.npz")]
    onnx.save(case.model, str(folder / "model.onnx"))
    with np.errstate(all="ignore"):
        res = CliRunner().invoke(main, args, catch_exceptions=True)  # not -q: its warnings are counted
    warned = logs.take() if logs is not None else ""
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        err = res.exception
        return CaseResult(case.name, mode, "crash", f"{type(err).__name__}: {err}"[:300], warned)
    if res.exit_code != 0:
        text = res.output.strip()
        status = "refused" if text.startswith("Error:") or "\nError:" in text else "crash"
        return CaseResult(case.name, mode, status, text[-300:], warned)
    bad = _check_written(case, folder / f"{mode}.fp16.onnx")
    if bad is not None:
        bad.mode, bad.warnings = mode, warned
        return bad
    return CaseResult(case.name, mode, "ok", "", warned)


def run_conformance(cases: Iterable[Any], modes: Sequence[str] = MODES) -> dict[str, Tally]:
    """Every case in every mode, one at a time, each in a fresh temporary folder."""
    import onnxruntime as ort

    ort.set_default_logger_severity(4)
    tallies = {m: Tally(m) for m in modes}
    logs = _LogCapture()
    try:
        for case in cases:
            for mode in modes:
                start = time.perf_counter()
                with tempfile.TemporaryDirectory(prefix="mpinfer-conf-") as tmp:
                    result = convert_case(case, mode, Path(tmp), logs)
                tallies[mode].seconds += time.perf_counter() - start
                if result is not None:
                    tallies[mode].results.append(result)
    finally:
        logs.close()
    return tallies


def format_tally(t: Tally) -> str:
    """One line: mode, runs, counts per status, ok share, ok runs planned by rules only, seconds."""
    counts = ", ".join(f"{k} {v}" for k, v in t.counts().items())
    rules = sum(r.status == "ok" and "Calibration skipped" in r.warnings for r in t.results)
    return (f"{t.mode:5s} {len(t.results):5d} runs: {counts} ({t.ok_share():.1%} ok; {rules} of the ok by rules "
            f"only: the data was rejected) in {t.seconds:.0f}s")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its counts (and, with -v, every run that is not ok)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sample", type=int, help="a deterministic spread of this many cases (default: all)")
    p.add_argument("--mode", default=",".join(MODES), help="none, own or both (comma-separated)")
    p.add_argument("--only", help="cases whose name contains this text")
    p.add_argument("-v", "--verbose", action="store_true", help="list every run that is not ok")
    args = p.parse_args(argv)
    cases = runnable_cases(args.sample)
    print(f"{len(cases)} float cases that ONNX Runtime runs in FP32 and the checker accepts"
          + (f" (among a spread of {args.sample})" if args.sample else ""))
    if args.only:
        cases = [c for c in cases if args.only in c.name]
    tallies = run_conformance(cases, [m for m in args.mode.split(",") if m])
    for t in tallies.values():
        print(format_tally(t))
        if args.verbose:
            for r in t.results:
                if r.status != "ok":
                    print(f"  {r.status:8s} {r.name}: {r.detail.splitlines()[-1] if r.detail else ''}"[:400])
    bad = sum(t.counts()[s] for t in tallies.values() for s in ("crash", "invalid", "wrong"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
