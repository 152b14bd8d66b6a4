"""A 1.1B-parameter Llama-shaped decoder with its KV cache, end to end: wall time and peak RSS per step.

The model (LlamaConfig hidden 2048, 22 layers, intermediate 5632, 32 heads, 4 KV heads, vocab 32000: 1.1 B
parameters, 4.4 GB in FP32) is built from its config with random weights in a subprocess and written with
``save_pretrained``; nothing is downloaded. Each step then runs as its own process, one at a time, and reports
its wall time and peak RSS (GNU time's ``%M``: the process's own high-water mark) as a multiple of the FP32
model's size (the exported ONNX file plus its external data):

* ``export``: ``mpinfer export FOLDER`` (default: with the KV cache);
* ``convert``: ``mpinfer convert --calibration prompts:CAL:steps=4 --budget "cosine>=0.999"`` (16 prompts of 32
  seeded random tokens, each prefilled and decoded 4 greedy steps by the FP32 model);
* ``plain-loop``: the floor for ``compare``: a plain ONNX Runtime greedy loop (no mpinfer) over the same prompts
  and tokens, the FP32 model then the FP16 one, each in its own session (opened, all 16 prompts decoded as one
  batch, 32 tokens with the KV cache, closed);
* ``compare``: ``mpinfer compare FP32 FP16 --data CAL --generate 32`` (its report's token agreement and
  perplexity ratio, and its decode tokens/s, are read back);
* ``build-engine``: ``mpinfer build-engine FP16 --backend onnxruntime``;
* ``autocast-compare``: ``compare --generate`` of the AutoCast model (its token agreement and perplexity ratio);
* ``autocast``: ModelOpt AutoCast's ``convert_to_mixed_precision`` (defaults, keep_io_types) on the same exported
  file (``--autocast PY``: a python with nvidia-modelopt[onnx]; bench/precision.py's worker).

For both converted models: Casts added and the FP16 share of the Conv/MatMul/Gemm FLOPs (as bench/hf_archs.py
counts them, at batch 1, 32 new tokens on a 32-token past), read from the graphs without their weights.

    PYTHONPATH=$PWD .venv/bin/python bench/llm.py [--layers 22] [--shape 3b] [--out DIR] [--steps export ...]
        [--autocast .venv-modelopt/bin/python] [--memory-limit SIZE]

``--layers N`` scales the model down (every layer is the same size, so the ratios to the model size carry over,
less the interpreter's and the embeddings' fixed share).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("export", "convert", "plain-loop", "compare", "build-engine", "autocast", "autocast-compare")
BUDGET = "cosine>=0.999"
PROMPTS, PROMPT_LEN, CAL_STEPS, GENERATE = 16, 32, 4, 32
VOCAB = 32000

# --shape: the LlamaConfig sizes (the layer count comes from --layers)
SHAPES = {
    "1.1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4},
    # Llama-3.2-3B's body (hidden 3072, 28 layers, GQA 24/8 heads) with this vocabulary: 3.0 B parameters, 12 GB
    "3b": {"hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24, "num_key_value_heads": 8},
}
BUILD = """
import json, sys, torch, transformers as t
torch.manual_seed(0)
cfg = t.LlamaConfig(num_hidden_layers=int(sys.argv[1]), vocab_size=32000, max_position_embeddings=2048,
                    **json.loads(sys.argv[3]))
model = t.LlamaForCausalLM(cfg).eval()
print(sum(p.numel() for p in model.parameters()))
model.save_pretrained(sys.argv[2])
"""


def measured(cmd: list[str]) -> dict[str, Any]:
    """Wall time, CPU time, exit status and peak RSS (GNU time's %M, the child's own high-water mark) of ``cmd``."""
    timer = shutil.which("time") or "/usr/bin/time"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.perf_counter()
    out = subprocess.run([timer, "-f", "peak_kb=%M cpu_s=%U+%S", *cmd], env=env, cwd=ROOT, capture_output=True,
                         text=True)
    row: dict[str, Any] = {"wall_s": round(time.perf_counter() - start, 1), "exit": out.returncode}
    lines = out.stderr.strip().splitlines()
    peak = [ln for ln in lines if ln.startswith("peak_kb=")]
    row["peak_rss_bytes"] = int(peak[-1].split()[0].split("=")[1]) * 1024 if peak else -1
    # CPU seconds (user + system, every thread): steadier than the wall time on a shared machine
    row["cpu_s"] = round(sum(float(x) for x in peak[-1].split("cpu_s=")[1].split("+")), 1) if peak else -1
    row["stdout_tail"] = out.stdout.strip().splitlines()[-3:]
    if out.returncode:
        row["error"] = [ln for ln in lines if not ln.startswith("peak_kb=")][-3:]
    return row


def mpinfer(*args: str, memory_limit: str | None = None) -> dict[str, Any]:
    """``python -m mpinfer ARGS`` measured."""
    extra = ["--memory-limit", memory_limit] if memory_limit and args[0] in ("convert", "compare") else []
    return measured([sys.executable, "-m", "mpinfer", *args, *extra])


def build(folder: Path, layers: int, shape: str) -> int:
    """The seeded random-weight model written with save_pretrained to ``folder``; its parameter count."""
    out = subprocess.run([sys.executable, "-c", BUILD, str(layers), str(folder), json.dumps(SHAPES[shape])],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def prompts(path: Path) -> None:
    """16 x 32 seeded random token ids."""
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(path, input_ids=rng.integers(0, VOCAB, size=(PROMPTS, PROMPT_LEN), dtype=np.int64))


def model_bytes(path: Path) -> int:
    """The ONNX file plus its external data files."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    files = {kv.value for t in model.graph.initializer for kv in t.external_data if kv.key == "location"}
    return path.stat().st_size + sum((path.parent / f).stat().st_size for f in files)


def fp16_share_and_casts(src: Path, dst: Path) -> dict[str, Any]:
    """FP16 share of the Conv/MatMul/Gemm FLOPs of ``dst`` (bench/precision.py's count), its Casts and the FP32
    model's, from the graphs alone (no weights loaded), at batch 1, 32 new tokens on a 32-token past."""
    import onnx

    from mpinfer.modelio import name_nodes
    from mpinfer.precision.core.graphinfo import FLOAT16, GraphInfo

    orig = name_nodes(onnx.load(str(src), load_external_data=False))
    conv = name_nodes(onnx.load(str(dst), load_external_data=False))
    sizes = {"batch": 1, "sequence": PROMPT_LEN, "past": PROMPT_LEN, "total": 2 * PROMPT_LEN}
    for vi in orig.graph.input:
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param"):
                name = d.dim_param.lower()
                key = next((k for k in ("past", "total", "batch") if k in name), "sequence")
                if vi.name == "attention_mask" and name != "batch_size" and "batch" not in name:
                    key = "total"
                d.Clear()
                d.dim_value = sizes[key]
    del orig.graph.value_info[:]
    info = GraphInfo(orig, base_dir=str(src.parent), ask_runtime=False)
    flops = {ref.address: info.flops(ref) for ref in info.nodes}
    cinfo = GraphInfo(conv, base_dir=str(dst.parent), ask_runtime=False)
    low = {ref.address for ref in cinfo.nodes if ref.node.op_type != "Cast" and any(
        cinfo.types.get(n) == FLOAT16 for n in list(ref.node.input) + list(ref.node.output) if n)}
    total = sum(flops.values()) or 1
    casts = sum(n.op_type == "Cast" for n in conv.graph.node)
    return {"fp16_flops": round(sum(f for a, f in flops.items() if a in low) / total, 4), "casts": casts,
            "casts_fp32": sum(n.op_type == "Cast" for n in orig.graph.node)}


def run_steps(args: argparse.Namespace, folder: Path) -> dict[str, dict[str, Any]]:
    """Every step of ``args.steps``, one process at a time."""
    hf, src, cal = folder / "hf", folder / "model.onnx", folder / "prompts.npz"
    low, auto = folder / "model.fp16.onnx", folder / "model.autocast.onnx"
    mem = args.memory_limit
    commands = {
        "export": lambda: mpinfer("export", str(hf), "-o", str(src), "--force"),
        "convert": lambda: mpinfer("convert", str(src), "-o", str(low), "--force", "--calibration",
                                   f"prompts:{cal}:steps={CAL_STEPS}", "--budget", BUDGET,
                                   *shlex.split(args.convert_args), memory_limit=mem),
        "plain-loop": lambda: measured([sys.executable, str(Path(__file__).resolve()), "--plain-loop", str(src),
                                        str(low), str(cal)]),
        "compare": lambda: compare(src, low, cal, folder / "report", mem),
        "build-engine": lambda: mpinfer("build-engine", str(low), "--backend", "onnxruntime", "-o",
                                        str(folder / "model.fp16.ort.onnx"), "--force"),
        "autocast": lambda: autocast(src, auto, args.autocast),
        "autocast-compare": lambda: compare(src, auto, cal, folder / "report-autocast", mem),
    }
    results: dict[str, dict[str, Any]] = {}
    for step in args.steps:
        print(f"{time.strftime('%H:%M:%S')} {step} ...", flush=True)
        results[step] = commands[step]()
        print(f"  {json.dumps(results[step])}", flush=True)
    return results


def plain_loop(models: list[str], prompts_path: str) -> None:
    """Greedy-decode every prompt of ``prompts_path`` (one batch) for GENERATE tokens with each model in turn;
    prints each model's wall time (session included) and decode tokens/s as JSON."""
    import numpy as np
    import onnxruntime as ort

    ids = np.load(prompts_path)["input_ids"].astype(np.int64)
    report = {}
    for path in models:
        start = time.perf_counter()
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in sess.get_inputs()}
        pasts = [n for n in inputs if n.startswith("past_key_values.")]
        kv_type = np.float16 if inputs[pasts[0]].type == "tensor(float16)" else np.float32
        heads, dim = inputs[pasts[0]].shape[1], inputs[pasts[0]].shape[3]
        batch, length = ids.shape
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids),
                 **{n: np.zeros((batch, heads, 0, dim), kv_type) for n in pasts}}
        if "position_ids" in inputs:
            feeds["position_ids"] = np.arange(length, dtype=np.int64)[None].repeat(batch, 0)
        outs = ["logits", *(n.replace("past_key_values.", "present.") for n in pasts)]
        decode_start = start
        for step in range(GENERATE):
            res = dict(zip(outs, sess.run(outs, feeds)))
            token = res["logits"][:, -1].argmax(-1).astype(np.int64)[:, None]
            if step == 0:
                decode_start = time.perf_counter()
            total = feeds["attention_mask"].shape[1] + 1
            feeds = {"input_ids": token, "attention_mask": np.ones((batch, total), np.int64),
                     **{n: res[n.replace("past_key_values.", "present.")] for n in pasts}}
            if "position_ids" in inputs:
                feeds["position_ids"] = np.full((batch, 1), total - 1, np.int64)
        end = time.perf_counter()
        del sess, inputs  # (the inputs' NodeArgs kept the session, and its weights, alive beside the next model's)
        report[Path(path).name] = {"wall_s": round(end - start, 2),
                                   "decode_tokens_per_s": round(batch * (GENERATE - 1) / (end - decode_start), 1)}
    print(json.dumps(report))


def compare(src: Path, low: Path, cal: Path, report: Path, mem: str | None) -> dict[str, Any]:
    """``mpinfer compare --generate``, measured; the generation figures read back from its report.json."""
    row = mpinfer("compare", str(src), str(low), "--data", str(cal), "--generate", str(GENERATE), "--quiet",
                  "--report", str(report), "--force", memory_limit=mem)
    path = report / "report.json"
    if row["exit"] in (0, 1) and path.is_file():  # 1: a failed check, the figures are there all the same
        gen = json.loads(path.read_text()).get("data", {}).get("generation") or [{}]
        metrics, latency = gen[0].get("metrics", {}), gen[0].get("latency", {})
        row["generation"] = {k: metrics.get(k) for k in ("token_agreement", "ppl_ratio", "first_divergence")}
        row["latency"] = latency
    return row


def autocast_feeds(src: Path, path: Path) -> None:
    """One consistent decode-shaped sample for AutoCast's reference run (its own random data gives every
    dynamic dim the same size, which a KV-cache graph rejects): batch 1, 32 new tokens on a 32-token past."""
    import numpy as np
    import onnx

    rng = np.random.default_rng(1)
    sizes = {"batch": 1, "seq": PROMPT_LEN, "past": PROMPT_LEN, "total": 2 * PROMPT_LEN}
    feeds = {}
    for vi in onnx.load(str(src), load_external_data=False).graph.input:
        shape = [d.dim_value or sizes.get(d.dim_param, 1) for d in vi.type.tensor_type.shape.dim]
        if vi.name == "input_ids":
            feeds[vi.name] = rng.integers(0, VOCAB, size=shape, dtype=np.int64)
        elif vi.name == "attention_mask":
            feeds[vi.name] = np.ones(shape, np.int64)
        elif vi.name == "position_ids":
            feeds[vi.name] = np.arange(PROMPT_LEN, 2 * PROMPT_LEN, dtype=np.int64)[None].repeat(shape[0], 0)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    np.savez(path, **feeds)


def autocast(src: Path, dst: Path, python: str) -> dict[str, Any]:
    """AutoCast (defaults, keep_io_types, one consistent KV-cache sample as calibration_data), under GNU time."""
    feeds = dst.with_suffix(".feeds.npz")
    autocast_feeds(src, feeds)
    dst.unlink(missing_ok=True)
    row = measured([python, str(Path(__file__).resolve()), "--autocast-worker", str(src), str(dst), str(feeds)])
    if row["exit"] == 0 and not dst.exists():
        row["exit"], row["error"] = -1, ["no output written"]
    return row


def autocast_worker(src: str, dst: str, feeds: str) -> None:
    """Run in the python that has nvidia-modelopt: convert ``src``, save to ``dst`` (external data)."""
    from modelopt.onnx.autocast import convert_to_mixed_precision

    from mpinfer.modelio import save_onnx

    out = convert_to_mixed_precision(onnx_path=src, low_precision_type="fp16", keep_io_types=True,
                                     calibration_data=feeds)
    save_onnx(out, Path(dst))


def markdown(results: dict[str, dict[str, Any]], size: int, shares: dict[str, dict[str, Any]]) -> str:
    """The table: per step wall time, peak RSS and its ratio to the FP32 size; Casts and FP16 FLOPs."""
    lines = ["| step | tool | exit | wall s | CPU s | peak RSS GB | peak / FP32 size | Casts (FP32 model's) | "
             "FP16 share of FLOPs |", "|" + "---|" * 9]
    for step, r in results.items():
        tool = "AutoCast" if step == "autocast" else "mpinfer"
        share = shares.get("autocast" if step == "autocast" else ("convert" if step == "convert" else ""), {})
        peak = r["peak_rss_bytes"]
        casts = f"{share['casts']} ({share['casts_fp32']})" if share else ""
        lines.append(f"| {step} | {tool} | {r['exit']} | {r['wall_s']} | {r.get('cpu_s', '')} | {peak / 1e9:.2f} | "
                     f"{peak / size:.2f}x | "
                     f"{casts} | "
                     f"{format(share['fp16_flops'], '.1%') if 'fp16_flops' in share else ''} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.1b",
                   help="layer sizes: 1.1b (TinyLlama, the default) or 3b (Llama-3.2-3B's, with --layers 28)")
    p.add_argument("--out", type=Path, default=Path("/tmp/mpinfer-llm"))
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    p.add_argument("--autocast", default=str(ROOT / ".venv-modelopt" / "bin" / "python"),
                   help="a python with nvidia-modelopt[onnx] (for the autocast step)")
    p.add_argument("--memory-limit", default=None, help="--memory-limit of convert and compare")
    p.add_argument("--convert-args", default="", help='more options for convert, e.g. --convert-args="--opset 23"')
    args = p.parse_args()
    folder = args.out
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "hf" / "config.json").is_file():
        start = time.perf_counter()
        params = build(folder / "hf", args.layers, args.shape)
        print(f"built {params / 1e9:.3f} B parameters in {time.perf_counter() - start:.0f}s", flush=True)
    if not (folder / "prompts.npz").is_file():
        prompts(folder / "prompts.npz")
    results = run_steps(args, folder)
    src = folder / "model.onnx"
    size = model_bytes(src)
    shares = {}
    for tool, dst in (("convert", folder / "model.fp16.onnx"), ("autocast", folder / "model.autocast.onnx")):
        if dst.is_file() and results.get(tool, {}).get("exit", 0) == 0:
            shares[tool] = fp16_share_and_casts(src, dst)
    print(f"FP32 model: {size / 1e9:.2f} GB ({args.layers} layers)")
    print(markdown(results, size, shares))
    if "plain-loop" in results and "compare" in results:
        gen, loop = results["compare"]["wall_s"], results["plain-loop"]["wall_s"]
        cgen, cloop = results["compare"].get("cpu_s", 0), results["plain-loop"].get("cpu_s", 0)
        print(f"compare --generate {gen} s vs the plain loop {loop} s ({gen / max(loop, 1e-9):.2f}x); CPU {cgen} s vs "
              f"{cloop} s ({cgen / max(cloop, 1e-9):.2f}x); plain loop: "
              f"{results['plain-loop']['stdout_tail'][-1:]}; compare: {results['compare'].get('generation')} "
              f"{results['compare'].get('latency')}")
    (folder / "llm.json").write_text(json.dumps({"layers": args.layers, "shape": args.shape, "model_bytes": size,
                                                  "steps": results, "shares": shares}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--autocast-worker":
        autocast_worker(*sys.argv[2:5])
    elif len(sys.argv) > 1 and sys.argv[1] == "--plain-loop":
        plain_loop(sys.argv[2:4], sys.argv[4])
    else:
        main()
