"""A generated sweep of the validity gate: graphs from ONNX's operator schemas crossed with plans.

Each case is one operator (ONNX's own node test models: inputs and attributes that satisfy the schema) declared at
one opset from 11 to the newest ONNX Runtime loads, wrapped in one of the graph shapes below, and converted
in-process by ``convert_precision`` under one plan. The file written must pass the full ONNX checker, strict type
inference and an ONNX Runtime load; otherwise convert must have refused it with an ``MpinferError`` and written
nothing. Cases whose FP32 input model (its node list sorted) fails one of those checks at that opset (the op changed
signature; ONNX's function body of MeanVarianceNormalization fails strict inference at some opsets) are skipped.

Graph shapes (``SHAPES``): the node alone; Identity and Cast chains at the graph inputs and outputs (in order, and
with the node list reversed: ONNX Runtime loads such a graph, the checker refuses it); float inputs
made initializers (shared between inputs of one shape) and a Constant node; FP16 graph inputs and outputs made by
Casts (converted with ``--force``); the node inside an If body reading outer-scope values.
Plans (``PLANS``): the rules alone, all low (``--low-op`` of every op), all FP32 (``--keep-op``), alternating nodes
low (``--low-node``), the operator forced low, each with or without ``--keep-io-types``.

Shared by tests/precision/test_gate_sweep.py (a seeded sample in CI, thousands under ``slow``) and
bench/gate_sweep.py (prints the counts).
"""

from __future__ import annotations

import random
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SHAPES = ("plain", "io-chains", "unsorted", "constants", "low-io", "if-body")
PLANS = ("rules", "all-low", "all-fp32", "alternating", "forced")
FIRST_OPSET = 11
STATUSES = ("ok", "refused", "invalid", "crash")


@dataclass(frozen=True)
class Case:
    """One sweep case: the ONNX test case, the opset, the graph shape, the plan, keep_io_types."""

    test: str
    op: str
    opset: int
    shape: str
    plan: str
    keep_io_types: bool
    data: bool = False  # calibrate on the test's own inputs (an .npz): the range rules, the search, the emulator

    @property
    def name(self) -> str:
        """A readable id."""
        io = "" if self.keep_io_types else ",no-keep-io"
        data = ",data" if self.data else ""
        return f"{self.test}@{self.opset}[{self.shape},{self.plan}{io}{data}]"


@dataclass
class Result:
    """What a case came to: ok, refused (MpinferError, nothing written), invalid (a file that fails), crash."""

    case: Case
    status: str
    detail: str = ""


@dataclass
class Tally:
    """Counts of a sweep."""

    results: list[Result] = field(default_factory=list)
    skipped: int = 0  # cases whose FP32 input model is invalid at that opset
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        """cases, ok, refused, invalid, crash (and skipped)."""
        c = Counter(r.status for r in self.results)
        return {"cases": len(self.results), **{s: c.get(s, 0) for s in STATUSES}, "skipped": self.skipped}

    def failures(self) -> list[Result]:
        """The invalid files and the crashes."""
        return [r for r in self.results if r.status in ("invalid", "crash")]


def max_opset() -> int:
    """The newest default-domain opset both ONNX and the installed ONNX Runtime know."""
    from onnx import defs

    from mpinfer.backends.ort import runtime_limits

    return min(defs.onnx_opset_version(), runtime_limits()[1])


def float_tests() -> list[Any]:
    """ONNX's node test cases with FP32 tensors and a single default-domain node (the conformance set)."""
    from tests.precision.conformance import float_cases

    single = [c for c in float_cases() if len(c.model.graph.node) == 1]
    return [c for c in single if c.model.graph.node[0].domain in ("", "ai.onnx")]


def cases(tests: list[Any], count: int, seed: int) -> list[Case]:
    """``count`` seeded cases over ``tests`` (each test at a random opset, shape and plan)."""
    from onnx import defs

    rng = random.Random(seed)
    top = max_opset()
    out = []
    for _ in range(count * 4):
        if len(out) == count:
            break
        test = rng.choice(tests)
        op = test.model.graph.node[0].op_type
        opset = rng.randint(FIRST_OPSET, top)
        try:
            defs.get_schema(op, opset, "")
        except Exception:  # noqa: BLE001 - SchemaError: the op is newer than this opset
            continue
        shape, plan, keep_io = rng.choice(SHAPES), rng.choice(PLANS), rng.random() < 0.8
        out.append(Case(test.name, op, opset, shape, plan, keep_io, rng.random() < 0.3))
    return out


# -- graph shapes ------------------------------------------------------------------------------------------------
def build(test: Any, case: Case) -> tuple[Any, dict[str, np.ndarray]] | None:
    """The input model of ``case`` and feeds for it (None when the shape does not apply to this test)."""
    import onnx
    from onnx import helper

    model = onnx.ModelProto()
    model.CopyFrom(test.model)
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("", case.opset))
    for imp in test.model.opset_import:
        if imp.domain not in ("", "ai.onnx"):
            model.opset_import.append(imp)
    model.ir_version = 8
    g = model.graph
    g.node[0].name = "core"
    inits = {t.name for t in g.initializer}
    names = [vi.name for vi in g.input if vi.name not in inits]
    feeds = dict(zip(names, test.data_sets[0][0], strict=False))
    if len(feeds) != len(names) or not all(isinstance(v, np.ndarray) for v in feeds.values()):
        return None
    if case.shape in ("io-chains", "unsorted"):
        _io_chains(g)
        if case.shape == "unsorted":  # keras2onnx writes such node lists: ONNX Runtime loads them, the checker not
            nodes = list(g.node)[::-1]
            del g.node[:]
            g.node.extend(nodes)
    elif case.shape == "constants":
        feeds = _constants(g, feeds)
    elif case.shape == "low-io":
        feeds = _low_io(g, feeds)
    elif case.shape == "if-body":
        _if_body(g)
    for i, node in enumerate(g.node):
        if not node.name:
            node.name = f"n{i}"
    return model, feeds


def _float_inputs(g: Any) -> list[Any]:
    inits = {t.name for t in g.initializer}
    return [vi for vi in g.input if vi.name not in inits and vi.type.tensor_type.elem_type == 1]


def _float_outputs(g: Any) -> list[Any]:
    return [vi for vi in g.output if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type == 1]


def _rename_input(g: Any, old: str, new: str) -> None:
    for node in g.node:
        for i, n in enumerate(node.input):
            if n == old:
                node.input[i] = new


def _rename_output(g: Any, old: str, new: str) -> None:
    for node in g.node:
        for i, n in enumerate(node.output):
            if n == old:
                node.output[i] = new


def _io_chains(g: Any) -> None:
    """x -> Identity -> Cast(FLOAT) -> node -> Identity -> Identity -> y."""
    from onnx import helper

    front = []
    for vi in _float_inputs(g):
        _rename_input(g, vi.name, f"{vi.name}__c")
        front += [
            helper.make_node("Identity", [vi.name], [f"{vi.name}__i"], name=f"{vi.name}_id"),
            helper.make_node("Cast", [f"{vi.name}__i"], [f"{vi.name}__c"], name=f"{vi.name}_cast", to=1),
        ]
    back = []
    for vi in _float_outputs(g):
        _rename_output(g, vi.name, f"{vi.name}__o")
        back += [
            helper.make_node("Identity", [f"{vi.name}__o"], [f"{vi.name}__p"], name=f"{vi.name}_id1"),
            helper.make_node("Identity", [f"{vi.name}__p"], [vi.name], name=f"{vi.name}_id2"),
        ]
    nodes = front + list(g.node) + back
    del g.node[:]
    g.node.extend(nodes)


def _constants(g: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Float inputs after the first become initializers (one shared per shape); the last of them a Constant."""
    from onnx import helper, numpy_helper

    floats = _float_inputs(g)[1:]
    shared: dict[tuple[int, ...], str] = {}
    for vi in floats:
        arr = feeds.pop(vi.name)
        key = tuple(arr.shape)
        g.input.remove(vi)
        if key in shared:
            _rename_input(g, vi.name, shared[key])
            continue
        shared[key] = vi.name
        g.initializer.append(numpy_helper.from_array(arr, vi.name))
    if shared:
        last = list(shared.values())[-1]
        t = next(t for t in g.initializer if t.name == last)
        g.initializer.remove(t)
        g.node.insert(0, helper.make_node("Constant", [], [last], name="const", value=t))
    return feeds


def _low_io(g: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """FP16 graph inputs (Cast to FLOAT after them) and FP16 outputs made by two Casts (issue 28, hole 1)."""
    from onnx import helper

    front = []
    for vi in _float_inputs(g):
        _rename_input(g, vi.name, f"{vi.name}__f")
        vi.type.tensor_type.elem_type = 10
        front.append(helper.make_node("Cast", [vi.name], [f"{vi.name}__f"], name=f"{vi.name}_up", to=1))
        feeds[vi.name] = feeds[vi.name].astype(np.float16)
    back = []
    for vi in _float_outputs(g):
        _rename_output(g, vi.name, f"{vi.name}__o")
        vi.type.tensor_type.elem_type = 10
        back += [
            helper.make_node("Cast", [f"{vi.name}__o"], [f"{vi.name}__h"], name=f"{vi.name}_down", to=10),
            helper.make_node("Cast", [f"{vi.name}__h"], [vi.name], name=f"{vi.name}_again", to=10),
        ]
    nodes = front + list(g.node) + back
    del g.node[:]
    g.node.extend(nodes)
    return feeds


def _if_body(g: Any) -> None:
    """The node inside both branches of an If (a constant true condition) reading outer-scope values."""
    import onnx
    from onnx import helper, numpy_helper

    core = g.node[0]
    branches = []
    for tag in ("then", "else"):
        body_node = onnx.NodeProto()
        body_node.CopyFrom(core)
        body_node.name = f"core_{tag}"
        outs = []
        for i, o in enumerate(body_node.output):
            if o:
                body_node.output[i] = f"{o}__{tag}"
                vi = next((v for v in g.output if v.name == o), None)
                outs.append(helper.make_value_info(body_node.output[i], vi.type) if vi else None)
        if any(v is None for v in outs):
            return
        branches.append(helper.make_graph([body_node], f"{tag}_body", [], outs))
    g.initializer.append(numpy_helper.from_array(np.array(True), "cond"))
    outputs = [o for o in core.output if o]
    node = helper.make_node("If", ["cond"], outputs, name="if", then_branch=branches[0], else_branch=branches[1])
    del g.node[:]
    g.node.append(node)


# -- plans and checks ---------------------------------------------------------------------------------------------
def plan_options(model: Any, case: Case) -> dict[str, Any]:
    """The ConvertConfig overrides of ``case.plan``."""
    from mpinfer.modelio import iter_nodes

    ops = tuple(sorted({ref.node.op_type for ref in iter_nodes(model.graph) if ref.node.domain in ("", "ai.onnx")}))
    addresses = [ref.address for ref in iter_nodes(model.graph)]
    if case.plan == "all-low":
        return {"low_ops": tuple(o for o in ops if o not in ("If",))}
    if case.plan == "all-fp32":
        return {"keep_ops": ops}
    if case.plan == "alternating":
        return {"low_nodes": tuple(f"^{a}$" for a in addresses[::2])}
    if case.plan == "forced":
        return {"low_nodes": ("core",)}
    return {}


def failed_checks(model: Any) -> dict[str, str]:
    """The checks ``model`` fails (check -> message): full checker, strict type inference, ONNX Runtime load."""
    import onnx
    import onnxruntime as ort

    def ort_load(m: Any) -> None:
        so = ort.SessionOptions()
        so.log_severity_level = 4
        try:
            ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception as err:
            if not any(k in str(err) for k in ("Could not find an implementation", "Failed to find kernel")):
                raise  # (valid ONNX the CPU provider has no kernel for passes: the gate's own rule)

    checks = {
        "checker": lambda m: onnx.checker.check_model(m, full_check=True),
        "inference": lambda m: onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True),
        "onnxruntime": ort_load,
    }
    failed = {}
    for name, check in checks.items():
        try:
            check(model)
        except Exception as err:  # noqa: BLE001 - whatever fails, that check fails
            failed[name] = f"{type(err).__name__}: {err}"[:400]
    return failed


def check_file(path: Path) -> str | None:
    """None when the model at ``path`` passes every check of :func:`failed_checks`, else why."""
    import onnx

    return next(iter(failed_checks(onnx.load(str(path))).values()), None)


def run_case(test: Any, case: Case, folder: Path) -> Result | None:
    """Convert ``case`` in-process and classify the outcome (None: the FP32 input is itself invalid)."""
    import onnx

    from mpinfer.errors import MpinferError
    from mpinfer.precision.convert import ConvertConfig, convert_precision

    built = build(test, case)
    if built is None:
        return None
    model, feeds = built
    src = folder / f"{case.test}.onnx"
    onnx.save(model, str(src))
    from mpinfer.precision.graph.normalize import sort_nodes

    # the input as mpinfer plans it (its node list sorted) must pass every check (ONNX's function body of
    # MeanVarianceNormalization fails strict inference at some opsets, an op's older signature the checker)
    if failed_checks(sort_nodes(model)):
        return None
    calibration = "none"
    if case.data:
        calibration = str(folder / "data.npz")
        np.savez(calibration, **feeds)
    out = folder / "out.onnx"
    for stale in folder.glob("out*"):
        stale.unlink()
    cfg = ConvertConfig(
        model=src, output=out, calibration=calibration, force=case.shape == "low-io", progress=False,
        keep_io_types=case.keep_io_types, **plan_options(model, case),
    )
    try:
        with np.errstate(all="ignore"):
            convert_precision(cfg)
    except MpinferError as err:
        written = out.exists()
        return Result(case, "invalid" if written else "refused", f"{type(err).__name__}: {err}"[:400])
    except Exception as err:  # noqa: BLE001 - a crash (InternalError: the gate caught a bad rewrite) is a finding
        tb = traceback.format_exc(limit=-3)
        return Result(case, "crash", f"{type(err).__name__}: {err} | {tb}"[:1200])
    why = check_file(out)
    return Result(case, "ok" if why is None else "invalid", why or "")


def sweep(count: int, seed: int) -> Tally:
    """Run ``count`` seeded cases."""
    import logging

    tests = {t.name: t for t in float_tests()}
    tally = Tally()
    start = time.perf_counter()
    logging.getLogger("mpinfer").setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="mpinfer-gate-sweep-") as td:
            for case in cases(list(tests.values()), count, seed):
                result = run_case(tests[case.test], case, Path(td))
                if result is None:
                    tally.skipped += 1
                else:
                    tally.results.append(result)
    finally:
        logging.getLogger("mpinfer").setLevel(logging.NOTSET)
    tally.seconds = time.perf_counter() - start
    return tally


def iter_failures(tally: Tally) -> Iterator[str]:
    """One line per invalid file or crash."""
    for r in tally.failures():
        yield f"{r.status} {r.case.name}: {r.detail}"
