"""The steps of the GPU measurement (issue 30), one per process; bench/gpu_check.sh runs them with time limits.

    python bench/gpu_measure.py STEP --models .gpumodels --work /tmp/gpu/work --out $OUT [--dry-run]

Steps (each writes ``$OUT/<step>.json``; a failure writes ``{"error": ...}`` and exits 1):

* ``env``: GPU, driver, torch, onnxruntime and its providers;
* ``unpack``: rebuild the carried weight skeletons (bench/gpu_weights.py) into ``--work``;
* ``latency``: ONNX Runtime p50/p90 of FP32 vs mpinfer FP16 vs AutoCast FP16 per model and batch, the variants
  interleaved round by round after a warm-up (host<->device copies included: feeds are numpy arrays);
* ``accuracy``: each FP16 model's error against FP32 under ONNX Runtime CUDA on the held-out data, beside the
  strict emulator's prediction (made on the CPU by bench/gpu_prepare.py), and whether the plan's budget holds;
* ``decode``: tokens/s of the decoder with its KV cache (``compare --generate``'s code), FP32 vs FP16;
* ``convert``: ``mpinfer convert --numerics ort-cuda`` end to end on the encoder (the CLI, timed);
* ``amp``: bench/amp.py on CUDA (fp32 vs bf16 vs fp16 + GradScaler);
* ``gputests``: the tests marked ``gpu`` (pytest; they skip on a CPU), counted from pytest's JUnit XML;
* ``summarize``: ``results.json`` and ``results.md`` (the tables for bench/RESULTS.md);
* ``smoke`` (no ``--out``): ONNX Runtime's providers, and a one-node model run on CUDA (bench/gpu_check.sh install);
* ``predictions`` (no ``--out``): the manifest's strict vs ONNX Runtime CPU error table (made on the CPU).

``--dry-run``: ONNX Runtime's CPU provider instead of CUDA, a few iterations, AMP on CPU bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
CPU = ["CPUExecutionProvider"]
VARIANTS = ("fp32", "mpinfer", "autocast")
STEPS = ("env", "unpack", "latency", "accuracy", "decode", "convert", "amp", "gputests")
GPU_TEST_FILES = ("tests/precision/test_evaluators.py", "tests/engine/test_engine_ort.py", "tests/train/test_scaler.py",
                  "tests/train/test_ddp.py")
KEY_FIGURES = ("max_abs", "rel_l2", "cosine_min", "nonfinite", "top1")
RunFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def clean(value: Any) -> Any:
    """JSON-safe: NaN/inf floats become None, numpy scalars plain numbers."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def error_figures(ref: RunFn, cand: RunFn, feeds: Mapping[str, np.ndarray], batch: int) -> dict:
    """Per output, mpinfer's error figures (:class:`mpinfer.metrics.ModelAccumulator`) of ``cand`` vs ``ref``."""
    from mpinfer.metrics import ModelAccumulator

    count = len(next(iter(feeds.values())))
    acc = None
    for lo in range(0, count, batch):
        part = {k: v[lo:lo + batch] for k, v in feeds.items()}
        a, b = ref(part), cand(part)
        if acc is None:
            acc = ModelAccumulator(list(a))
        acc.update(a, b)
    if acc is None:
        raise ValueError("no held-out samples")
    return clean(acc.finalize())


class Context:
    """Paths and settings shared by the steps."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.models, self.work, self.out, self.dry = args.models, args.work, args.out, args.dry_run
        self.python = sys.executable
        self.manifest = json.loads((self.models / "manifest.json").read_text())
        self.providers = CPU if self.dry else CUDA

    def path(self, name: str, variant: str) -> Path | None:
        m = self.manifest["models"][name]
        if variant == "fp32":
            return self.work / m["fp32"]
        info = m["variants"].get(variant, {})
        return self.work / info["file"] if "file" in info else None

    def session(self, path: Path) -> Any:
        from mpinfer.modelio import ort_session

        sess = ort_session(path, providers=self.providers)
        if sess.get_providers()[0] != self.providers[0]:
            raise RuntimeError(f"{path.name}: ONNX Runtime runs it on {sess.get_providers()}, not {self.providers[0]}")
        return sess

    def feeds(self, name: str) -> dict[str, np.ndarray]:
        return dict(np.load(self.models / self.manifest["models"][name]["eval"]))


def step_env(ctx: Context) -> dict:
    import onnxruntime as ort
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "onnxruntime": ort.__version__, "onnxruntime_file": ort.__file__, "providers": ort.get_available_providers(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dry_run": ctx.dry,
           "prepared": ctx.manifest["created"]}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        out["nvidia_smi"] = f"unavailable: {err}"
    if not ctx.dry and "CUDAExecutionProvider" not in out["providers"]:
        raise RuntimeError(f"onnxruntime {ort.__version__} ({ort.__file__}) has no CUDA provider: {out['providers']}")
    return out


def smoke(dry: bool) -> int:
    """Print ONNX Runtime's version and providers, and run a one-node model on CUDA (on the CPU when ``dry``)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    print("onnxruntime", ort.__version__, ort.__file__, ort.get_available_providers(), flush=True)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "smoke",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=CPU if dry else CUDA)
    y = sess.run(None, {"x": np.array([-1, 0, 1, 2], np.float32)})[0]
    print("session providers:", sess.get_providers(), "relu:", y.tolist(), flush=True)
    return 0 if sess.get_providers()[0] == (CPU if dry else CUDA)[0] and y.tolist() == [0, 0, 1, 2] else 1


def step_unpack(ctx: Context) -> dict:
    import shutil

    import gpu_weights

    ctx.work.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, m in ctx.manifest["models"].items():
        start = time.perf_counter()
        fp32 = ctx.work / m["fp32"]
        if m["fp32_whole"]:
            shutil.copyfile(ctx.models / m["fp32"], fp32)
        else:
            gpu_weights.unpack(ctx.models / m["fp32"], fp32)
        for info in m["variants"].values():
            if "file" in info:
                gpu_weights.unpack(ctx.models / info["file"], ctx.work / info["file"], fp32=fp32)
        out[name] = {"s": round(time.perf_counter() - start, 2), "fp32_mb": round(fp32.stat().st_size / 2**20, 1)}
    return out


def _latency_feeds(m: dict, batch: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    if "vocab" in m:
        return {"input_ids": rng.integers(0, m["vocab"], (batch, m["seq"])).astype(np.int64)}
    if "image" in m:
        n = m["image"]
        return {"x": rng.standard_normal((batch, 3, n, n)).astype(np.float32)}
    return {k: v[:batch] for k, v in feeds.items()}


def time_sessions(sessions: dict[str, Any], feeds: dict[str, np.ndarray], warmup: int, rounds: int,
                  per_round: int) -> dict[str, dict]:
    """p50/p90 ms per session: a warm-up, then ``rounds`` rounds of ``per_round`` runs of each, interleaved."""
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for sess in sessions.values():
        for _ in range(warmup):
            sess.run(None, feeds)
    for _ in range(rounds):
        for key, sess in sessions.items():
            for _ in range(per_round):
                start = time.perf_counter()
                sess.run(None, feeds)
                times[key].append(time.perf_counter() - start)
    return {k: {"p50_ms": 1e3 * statistics.median(t), "p90_ms": 1e3 * float(np.percentile(t, 90)), "runs": len(t)}
            for k, t in times.items()}


def step_latency(ctx: Context) -> dict:
    warmup, rounds, per_round = (1, 1, 2) if ctx.dry else (10, 5, 12)
    out: dict[str, Any] = {"runs_per_model": rounds * per_round, "warmup": warmup, "providers": ctx.providers}
    for name, m in ctx.manifest["models"].items():
        if name == "decoder":
            continue
        paths = {v: p for v in VARIANTS if (p := ctx.path(name, v)) is not None}
        sessions = {v: ctx.session(p) for v, p in paths.items()}
        held = ctx.feeds(name)
        for batch in m["batches"]:
            row = time_sessions(sessions, _latency_feeds(m, batch, held), warmup, rounds, per_round)
            for v in row:
                row[v]["speedup"] = row["fp32"]["p50_ms"] / row[v]["p50_ms"]
            out[f"{name}/batch {batch}"] = row
            print(name, batch, {v: round(r["p50_ms"], 3) for v, r in row.items()}, flush=True)
        del sessions
    return clean(out)


def step_accuracy(ctx: Context) -> dict:
    from mpinfer.checks import parse_checks

    out: dict[str, Any] = {}
    for name, m in ctx.manifest["models"].items():
        feeds = ctx.feeds(name)
        batch = 1 if name == "detector" else 8
        s32 = ctx.session(ctx.path(name, "fp32"))  # type: ignore[arg-type]
        names = [o.name for o in s32.get_outputs()]

        from mpinfer.data.decode import ort_run_fn
        from mpinfer.modelio import ort_session

        cpu32 = ort_session(ctx.path(name, "fp32"))
        out[f"{name}/fp32"] = {"device_vs_cpu": error_figures(ort_run_fn(cpu32, names), ort_run_fn(s32, names),
                                                               feeds, batch)}
        for variant, info in m["variants"].items():
            path = ctx.path(name, variant)
            if path is None:
                continue
            measured = error_figures(ort_run_fn(s32, names), ort_run_fn(ctx.session(path), names), feeds, batch)
            row: dict[str, Any] = {"device": measured, "strict": info["strict"], "ort_cpu": info["ort_cpu"],
                                   "ratio_max_abs": {}, "ratio_rel_l2": {}}
            for o, fig in measured.items():
                for key in ("max_abs", "rel_l2"):
                    pred = info["strict"][o].get(key)
                    got = fig.get(key)
                    row[f"ratio_{key}"][o] = got / pred if pred and got is not None else None
            if "budget" in info:
                checks = parse_checks(info["budget"])
                row.update(budget=info["budget"], budget_holds=checks.met(measured),
                           budget_failures=checks.failures(measured))
            out[f"{name}/{variant}"] = row
    return clean(out)


def step_decode(ctx: Context) -> dict:
    from mpinfer.generation import GenerateConfig, generate_compare

    m = ctx.manifest["models"].get("decoder")
    if m is None:
        return {"skipped": "no decoder prepared"}
    cands = {v: str(p) for v in ("mpinfer", "autocast") if (p := ctx.path("decoder", v)) is not None}
    tokens, sizes = (3, (1,)) if ctx.dry else (64, (1, 8, 32))
    res = generate_compare(GenerateConfig(str(ctx.path("decoder", "fp32")), tuple(cands.values()),
                                          str(ctx.models / m["prompts"]), tokens, latency_batch_sizes=sizes,
                                          providers=tuple(ctx.providers)))
    out: dict[str, Any] = {"tokens": tokens, "providers": ctx.providers}
    for variant, r in zip(cands, res):
        out[variant] = {"latency": {str(b): t for b, t in r.latency.items()}, "metrics": r.metrics()}
    return clean(out)


def step_convert(ctx: Context) -> dict:
    name = "encoder" if "encoder" in ctx.manifest["models"] else next(iter(ctx.manifest["models"]))
    m = ctx.manifest["models"][name]
    numerics = "ort" if ctx.dry else "ort-cuda"
    dst = ctx.work / f"{name}.{numerics}.onnx"
    cal = m["calibration"].replace(m["cal"], str(ctx.models / m["cal"]))
    cmd = [ctx.python, "-m", "mpinfer", "convert", str(ctx.path(name, "fp32")), "-o", str(dst), "--calibration", cal,
           "--numerics", numerics, "--force"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[2:])} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    plan = json.loads(dst.with_suffix(".plan.json").read_text())
    strict_plan = json.loads((ctx.models / m["variants"]["mpinfer"]["plan"]).read_text())
    ver, s = plan["summary"]["verification"], plan["summary"]
    return clean({"model": name, "command": f"mpinfer convert {name}.fp32.onnx --calibration {m['calibration']} "
                  f"--numerics {numerics}", "wall_s": wall, "numerics": plan["numerics"], "passed": ver["passed"],
                  "budget": ver["budget"], "low_share_flops": s["low_share_flops"], "nodes_low": s["nodes_low"],
                  "nodes_total": s["nodes_total"], "strict_low_share_flops": strict_plan["summary"]["low_share_flops"],
                  "same_precisions_as_strict": s["precisions_digest"] == strict_plan["summary"]["precisions_digest"],
                  "figures": ver["figures"]})


def step_amp(ctx: Context) -> dict:
    raw = ctx.work / "amp_raw.json"
    args = ["--device", "cpu", "--size", "tiny", "--steps", "1", "--warmup", "1", "--repeats", "1"] if ctx.dry \
        else ["--device", "cuda", "--size", "large"]
    proc = subprocess.run([ctx.python, str(ROOT / "bench" / "amp.py"), *args, "--json", str(raw)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"bench/amp.py exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    data = json.loads(raw.read_text())
    for row in data["rows"]:
        row["step_ms"] = 1e3 * row["batch"] / row["samples_per_s"]
    return data


def step_gputests(ctx: Context) -> dict:
    import xml.etree.ElementTree as ET

    xml = ctx.work / "gputests.xml"
    cmd = [ctx.python, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *GPU_TEST_FILES]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {**counts, "exit": proc.returncode, "failed": failed, "tail": proc.stdout.strip().splitlines()[-1:]}


def _ms(r: dict | None) -> str:
    if not r:
        return ""
    return f"{r['p50_ms']:.3f} / {r['p90_ms']:.3f}" + (f" ({r['speedup']:.2f}x)" if "speedup" in r else "")


def _g(v: Any, fmt: str = "{:.2e}") -> str:
    return "" if v is None else fmt.format(v)


def markdown(res: dict) -> str:
    """The tables for bench/RESULTS.md."""
    from mpinfer.report.markdown import md_table

    env = res.get("env", {})
    where = env.get("gpu") or "CPU (dry run)"
    lines = [f"{where}; driver/memory: {env.get('nvidia_smi', '')}; torch {env.get('torch')} (CUDA "
             f"{env.get('torch_cuda')}), onnxruntime {env.get('onnxruntime')}; {env.get('date')}; models prepared "
             f"{env.get('prepared')}.", ""]
    lat = res.get("latency", {})
    if lat and "error" not in lat:
        lines += [f"ONNX Runtime {'/'.join(lat['providers'][:1])} latency, ms p50 / p90 of {lat['runs_per_model']} "
                  "runs (interleaved, after warm-up; host<->device copies included), speed-up vs FP32:", ""]
        rows = [[k, *(_ms(v.get(x)) for x in VARIANTS)] for k, v in lat.items() if isinstance(v, dict) and "fp32" in v]
        lines += md_table(["model / input", "FP32", "mpinfer FP16", "AutoCast FP16"], rows) + [""]
    acc = res.get("accuracy", {})
    if acc and "error" not in acc:
        lines += ["FP16 error vs FP32 on held-out data: strict emulator's prediction (CPU) vs ONNX Runtime on the "
                  "device; ratio = device / strict; budget = the plan's, checked on the device's figures:", ""]
        rows = []
        for key, row in acc.items():
            if not isinstance(row, dict) or "device" not in row:
                continue
            for o, fig in row["device"].items():
                rows.append([key, o, _g(row["strict"][o].get("max_abs")), _g(row["ort_cpu"][o].get("max_abs")),
                             _g(fig.get("max_abs")), _g(row["ratio_max_abs"].get(o), "{:.2f}"),
                             _g(row["strict"][o].get("rel_l2")), _g(fig.get("rel_l2")),
                             _g(row["ratio_rel_l2"].get(o), "{:.2f}"),
                             "" if "budget" not in row else f"{row['budget']}: "
                             f"{'holds' if row['budget_holds'] else 'FAILS'}"])
        lines += md_table(["model / FP16", "output", "strict max_abs", "ORT CPU max_abs", "device max_abs", "ratio",
                           "strict rel_l2", "device rel_l2", "ratio", "plan budget on device"], rows) + [""]
        floor = [[k.split("/")[0], o, _g(f.get("max_abs")), _g(f.get("rel_l2"))]
                 for k, row in acc.items() if isinstance(row, dict) and "device_vs_cpu" in row
                 for o, f in row["device_vs_cpu"].items()]
        lines += ["FP32 on the device vs FP32 on ONNX Runtime CPU (the noise floor, TF32 included where used):", ""]
        lines += md_table(["model", "output", "max_abs", "rel_l2"], floor) + [""]
    dec = res.get("decode", {})
    if dec and "error" not in dec and "skipped" not in dec:
        lines += [f"Decoder with KV cache, {dec['tokens']} greedy tokens per prompt, decode tokens/s (prefill ms):", ""]
        rows = []
        for variant in ("mpinfer", "autocast"):
            for b, t in dec.get(variant, {}).get("latency", {}).items():
                base, cand = t["baseline"], t["candidate"]
                rows.append([variant, b, f"{base['decode_tokens_per_s']:.0f} ({base['prefill_ms']:.2f})",
                             f"{cand['decode_tokens_per_s']:.0f} ({cand['prefill_ms']:.2f})",
                             f"{cand['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x",
                             _g(dec[variant]["metrics"].get("token_agreement"), "{:.3f}")])
        lines += md_table(["FP16", "batch", "FP32 tok/s", "FP16 tok/s", "speed-up", "token agreement"], rows) + [""]
    conv = res.get("convert", {})
    if conv and "error" not in conv:
        lines += [f"`{conv['command']}`: {conv['wall_s']:.1f} s, verification "
                  f"{'passed' if conv['passed'] else 'FAILED'} ({conv['budget']}), FP16 FLOPs "
                  f"{100 * conv['low_share_flops']:.1f}% (strict plan: {100 * conv['strict_low_share_flops']:.1f}%), "
                  f"same precisions as the strict plan: {conv['same_precisions_as_strict']}.", ""]
    amp = res.get("amp", {})
    if amp and "error" not in amp:
        lines += [f"AMP trainer ({amp['device']}, size {amp['size']}): step ms, samples/s, peak memory above the "
                  "model and optimizer (torch.cuda.max_memory_allocated - baseline; saved activations on CPU):", ""]
        rows = [[r["model"], r["precision"], str(r["batch"]), f"{r['step_ms']:.2f}", f"{r['samples_per_s']:.0f}",
                 f"{r.get('throughput_ratio', 1.0):.2f}x",
                 f"{r.get('cuda_activation_bytes', r['saved_activation_bytes']) / 2**20:.1f}",
                 f"{r.get('cuda_activation_ratio', r.get('saved_activation_ratio', 1.0)):.2f}x",
                 str(r["skipped_steps"])] for r in amp["rows"]]
        lines += md_table(["model", "precision", "batch", "step ms", "samples/s", "x fp32", "peak MiB", "x fp32",
                           "skipped steps"], rows) + [""]
    tests = res.get("gputests", {})
    if tests and "error" not in tests:
        lines += [f"Tests marked `gpu` ({', '.join(GPU_TEST_FILES)}): {tests['tests']} collected, {tests['failures']} "
                  f"failed, {tests['errors']} errors, {tests['skipped']} skipped"
                  + (f"; failing: {', '.join(tests['failed'])}" if tests["failed"] else "") + ".", ""]
    failed = [f"{k}: {v['error']}" for k, v in res.items() if isinstance(v, dict) and "error" in v]
    if failed:
        lines += ["Steps that failed:", "", *(f"- {f}" for f in failed), ""]
    return "\n".join(lines)


def predictions(models: Path) -> str:
    """The manifest's CPU figures as Markdown: per model, FP16 model and output, the strict emulator's predicted
    error and ONNX Runtime CPU's (both measured by bench/gpu_prepare.py on the held-out data)."""
    from mpinfer.report.markdown import md_table

    manifest = json.loads((models / "manifest.json").read_text())
    rows = []
    for name, m in manifest["models"].items():
        for variant, info in m["variants"].items():
            for o, fig in info.get("strict", {}).items():
                cpu = info["ort_cpu"][o]
                known = fig.get("max_abs") and cpu.get("max_abs") is not None
                ratio = cpu["max_abs"] / fig["max_abs"] if known else None
                rows.append([name, variant, o, _g(fig.get("max_abs")), _g(cpu.get("max_abs")), _g(ratio, "{:.2f}"),
                             _g(fig.get("rel_l2")), _g(cpu.get("rel_l2"))])
    return "\n".join(md_table(["model", "FP16", "output", "strict max_abs", "ORT CPU max_abs", "ratio",
                                "strict rel_l2", "ORT CPU rel_l2"], rows))


def step_summarize(ctx: Context) -> dict:
    res = {}
    for step in STEPS:
        p = ctx.out / f"{step}.json"
        res[step] = json.loads(p.read_text()) if p.exists() else {"error": "did not run (or timed out)"}
    res["manifest"] = ctx.manifest
    (ctx.out / "results.json").write_text(json.dumps(res, indent=1))
    (ctx.out / "results.md").write_text(markdown(res))
    return {"steps_failed": [s for s in STEPS if "error" in res[s]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=[*STEPS, "summarize", "smoke", "predictions"])
    ap.add_argument("--models", type=Path, default=ROOT / ".gpumodels")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu/work"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.step == "smoke":
        return smoke(args.dry_run)
    if args.step == "predictions":
        print(predictions(args.models))
        return 0
    if args.out is None:
        ap.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args)
    start = time.perf_counter()
    try:
        result = globals()[f"step_{args.step}"](ctx)
        rc = 0
    except Exception as err:  # noqa: BLE001 - a failed step is a result; the others still run
        import traceback

        traceback.print_exc()
        result, rc = {"error": f"{type(err).__name__}: {str(err)[:500]}"}, 1
    result["step_s"] = round(time.perf_counter() - start, 2)
    if args.step != "summarize":
        (args.out / f"{args.step}.json").write_text(json.dumps(clean(result), indent=1))
    print(f"{args.step}: {'ok' if rc == 0 else result['error']} ({result['step_s']} s)", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
