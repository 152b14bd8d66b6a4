"""A digest of the plans convert makes on a fixed set of small models: refactors must leave every line unchanged.

Each case converts one model (onnx.helper-built chains, the MLP of the tests, the digits CNN exported by torch)
with fixed calibration data and options, and prints one line: the case name and a SHA-256 over every node's
name, precision and reason, plus the plan's precision and numerics. Covered: strict and ort numerics, fp16 and
bf16, budget searches that move nodes, rule-only plans (random data), and ``--plan`` re-application.

    PYTHONPATH=$PWD python bench/plan_digest.py            # print the digests
    PYTHONPATH=$PWD python bench/plan_digest.py --check F  # compare with digests saved in F (exit 1 on change)
    PYTHONPATH=$PWD python bench/plan_digest.py --published orientation,ocr_rec,vad,pitch,dnsmos \
        --check bench/plan_digests_published.txt

``--published orientation,ocr_rec,vad,pitch,dnsmos,layout`` adds bench/published.py's models (downloaded once into
its cache) on their task calibration data under the default floor with strict numerics, and with ``--budget
cosine>=0.9999`` under ONNX Runtime numerics: real networks (Conv stacks, an LSTM-free recognizer, If/state
streaming, an in-graph CQT, STFT+log) whose searches move many groups. Minutes per model on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.errors import AccuracyMismatchError
from mpinfer.precision import ConvertConfig, convert_precision
from tests.precision.graphs import chain, export_digits, mlp, save

ROOT = Path(__file__).resolve().parents[1]


def _digits(tmp: Path) -> Path:
    import torch

    torch.manual_seed(0)
    return export_digits(tmp / "digits.onnx")


def _digest(plan: Any) -> str:
    h = hashlib.sha256()
    h.update(f"{plan.precision.value}|{plan.numerics}\n".encode())
    for n in plan.nodes:
        h.update(f"{n.name}|{n.precision.value}|{n.reason}\n".encode())
    return h.hexdigest()[:16]


def _cases(tmp: Path) -> list[tuple[str, dict[str, Any]]]:
    chain8 = save(chain(8), tmp / "chain8.onnx")
    chain4 = save(chain(4), tmp / "chain4.onnx")
    mlp_path = save(mlp(), tmp / "mlp.onnx")
    cal16 = tmp / "cal16.npz"
    np.savez(cal16, x=np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32))
    digits = _digits(tmp)
    digits_cal = str(ROOT / "calibration" / "digits.npz")
    return [
        ("chain8-strict-fp16-search", dict(model=chain8, calibration=str(cal16), budget="max_abs<=1e-3")),
        ("chain8-ort-fp16-search", dict(model=chain8, calibration=str(cal16), budget="max_abs<=1e-3", numerics="ort")),
        ("chain4-ort-fp16-loose", dict(model=chain4, calibration=str(cal16), budget="cosine>=0.999", numerics="ort")),
        (
            "chain8-strict-bf16-search",
            dict(model=chain8, calibration=str(cal16), budget="max_abs<=2e-2", precision="bf16"),
        ),
        ("chain8-strict-fp16-nobudget", dict(model=chain8, calibration=str(cal16), budget="none")),
        ("mlp-random-rules", dict(model=mlp_path)),
        ("mlp-random-bf16", dict(model=mlp_path, precision="bf16")),
        ("mlp-keep-ops", dict(model=mlp_path, keep_ops=("Relu",), calibration="random:8")),
        ("digits-strict-fp16", dict(model=digits, calibration=digits_cal, budget="cosine>=0.9999,top1>=0.99")),
        ("digits-strict-fp16-tight", dict(model=digits, calibration=digits_cal, budget="max_abs<=2e-4")),
        ("digits-ort-fp16", dict(model=digits, calibration=digits_cal, budget="cosine>=0.99999", numerics="ort")),
        ("digits-strict-bf16", dict(model=digits, calibration=digits_cal, budget="cosine>=0.999", precision="bf16")),
    ]


def _published(names: str, tmp: Path) -> list[tuple[str, dict[str, Any]]]:
    """bench/published.py's models on their task calibration data (default floor strict; a budget with ort)."""
    if not names:
        return []
    sys.path.insert(0, str(ROOT / "bench"))
    import published

    cases = []
    for name, model, npz, batch_size in published.task_cases(names, tmp):
        common = dict(model=model, calibration=str(npz), batch_size=batch_size)
        cases.append((f"{name}-strict-floor", common))
        cases.append((f"{name}-ort-budget", dict(common, budget="cosine>=0.9999", numerics="ort")))
        cases.append((f"{name}-strict-tight", dict(common, budget="cosine_min>=0.99999")))  # searches move groups
    return cases


def run(published: str = "") -> dict[str, str]:
    from mpinfer.specs import Precision

    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, kw in _cases(tmp) + _published(published, tmp):
            print(name, file=sys.stderr, flush=True)
            if "precision" in kw:
                kw["precision"] = Precision(kw["precision"])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    res = convert_precision(ConvertConfig(output=tmp / f"{name}.onnx", progress=False, **kw))
                except AccuracyMismatchError as err:  # refused: the words (nodes, figures) are the digest
                    out[name] = "refused:" + hashlib.sha256(str(err).encode()).hexdigest()[:16]
                    continue
                out[name] = _digest(res.plan) + (
                    "/searched" if res.plan.summary.get("search", {}).get("searched") else ""
                )
                again = convert_precision(
                    ConvertConfig(model=kw["model"], output=tmp / f"{name}.re.onnx", plan=res.plan_path, progress=False)
                )
                out[name + "+plan"] = _digest(again.plan)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", type=Path, help="file of saved digests to compare with")
    ap.add_argument("--published", default="", help="also bench/published.py's models, e.g. orientation,vad")
    args = ap.parse_args()
    got = run(args.published)
    lines = [f"{k} {v}" for k, v in got.items()]
    print("\n".join(lines))
    if args.check:
        want = dict(line.split() for line in args.check.read_text().splitlines() if line.strip())
        diff = [k for k in set(want) | set(got) if want.get(k) != got.get(k)]
        print("identical" if not diff else f"CHANGED: {sorted(diff)}")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
