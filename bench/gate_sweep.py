"""Issue 28's generated sweep of the validity gate: counts of cases, ok, refused cleanly, invalid, crashes.

ONNX's operator test cases (one float node each) declared at seeded opsets from 11 to the newest the installed
ONNX Runtime loads, wrapped in one of six graph shapes (the node alone; Identity and Cast chains at the graph's
inputs and outputs, in order and with the node list reversed; initializers shared between inputs and a Constant
node; FP16 graph inputs and outputs made by Casts, converted with ``--force``; the node inside an If body),
converted in-process by ``convert_precision`` under one of five plans (rules, all low, all FP32, alternating nodes
low, the op forced low; 20% without ``--keep-io-types``; 30% calibrated on the case's own inputs). Each written
file is loaded back and checked (full checker, strict type inference, ONNX Runtime load); a refusal must be an
``MpinferError`` with nothing written. The cases live in tests/precision/gatesweep.py (the CI suite runs a sample
of them).

    PYTHONPATH=$PWD .venv/bin/python bench/gate_sweep.py [--cases 3000] [--seed 2028] [-v]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and print its counts (exit 1 when a case is invalid or crashed)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=3000, help="cases drawn (those with an invalid FP32 input skip)")
    parser.add_argument("--seed", type=int, default=2028)
    parser.add_argument("-v", "--verbose", action="store_true", help="print each refusal too")
    args = parser.parse_args(argv)

    from tests.precision import gatesweep

    tally = gatesweep.sweep(args.cases, args.seed)
    counts = tally.counts()
    print(f"gate sweep (seed {args.seed}, {args.cases} drawn, {tally.seconds:.0f}s on a shared machine):")
    print("  " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    opsets = Counter(r.case.opset for r in tally.results)
    print("  opsets: " + ", ".join(f"{k}: {v}" for k, v in sorted(opsets.items())))
    for what in ("shape", "plan"):
        c = Counter(getattr(r.case, what) for r in tally.results)
        print(f"  {what}s: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    print(f"  ops: {len({r.case.op for r in tally.results})} distinct")
    for line in gatesweep.iter_failures(tally):
        print("  " + line[:400])
    if args.verbose:
        for r in tally.results:
            if r.status == "refused":
                print(f"  refused {r.case.name}: {r.detail[:300]}")
    return 1 if tally.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
