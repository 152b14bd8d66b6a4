"""Hugging Face architectures, each built from a small seeded config, through the CLI: export → convert → compare.

The transformer shapes users bring (encoders, causal LMs with their heads, an encoder-only T5, speech and
vision models), as a user runs them: ``save_pretrained`` folder → ``mpinfer export FOLDER`` (the config's
architecture, so task heads stay on) → ``mpinfer convert`` (defaults: rules, calibration ranges on seeded random
data sized as the export recorded, strict numerics) → ``mpinfer compare --json`` on seeded random data.
Per model: the ONNX outputs, each stage's wall time, the FP16 share of FLOPs and the Casts (from the plan), and
per output the max abs error, cosine and top-1 agreement of the FP16 model against FP32 (ONNX Runtime CPU).
Weights are random (seeded), so the errors show the conversion's numerics, not a task's accuracy; see
bench/published.py for published models on their task.

    PYTHONPATH=$PWD .venv/bin/python bench/hf_archs.py [--models bert_cls,llama] [--out bench/out/hf_archs]

``--vs-autocast PY`` runs the attention models instead (BERT-base, MiniLM and a small Llama decoder, from
their configs): the exported model through ``mpinfer convert`` (calibration on padded random batches) and
through ModelOpt AutoCast (``PY``: a python with nvidia-modelopt[onnx]; bench/precision.py's worker, defaults,
keep_io_types), each in its own process (wall time, peak RSS), then Casts, FP16 share of the Conv/MatMul/Gemm
FLOPs and strict-numerics accuracy (mpinfer's emulator, every low node's arithmetic in FP16) against FP32 on
held-out padded batches. ``--before ROOT`` adds the same convert run with the mpinfer package found in ROOT
(e.g. an earlier checkout).

    PYTHONPATH=$PWD .venv/bin/python bench/hf_archs.py --vs-autocast .venv-modelopt/bin/python \
        [--models bert_base,minilm,llama_small] [--before /tmp/mpinfer-0d5421e] [--samples 16] [--seq 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _bert(**kw: Any) -> Any:
    import transformers

    return transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=64, **kw)


def builders() -> dict[str, Callable[[], Any]]:
    """Model name -> a function building the seeded torch model (transformers imported here)."""
    import transformers as t

    return {
        "bert_cls": lambda: t.BertForSequenceClassification(_bert(num_labels=3)),
        "bert_qa": lambda: t.BertForQuestionAnswering(_bert()),
        "distilbert": lambda: t.DistilBertModel(t.DistilBertConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4,
                                                                   hidden_dim=128)),
        "gpt2_lm": lambda: t.GPT2LMHeadModel(t.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=2,
                                                          n_positions=64, bos_token_id=0, eos_token_id=0)),
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128,
                                                          num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2, max_position_embeddings=128)),
        "t5_encoder": lambda: t.T5EncoderModel(t.T5Config(vocab_size=500, d_model=64, d_kv=16, d_ff=128,
                                                          num_layers=2, num_heads=4)),
        "whisper_cls": lambda: t.WhisperForAudioClassification(t.WhisperConfig(
            vocab_size=500, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
            max_source_positions=50, pad_token_id=1, bos_token_id=2, eos_token_id=3, decoder_start_token_id=2)),
        "wav2vec2_cls": lambda: t.Wav2Vec2ForSequenceClassification(t.Wav2Vec2Config(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16, 16),
            conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2)),
        "swin": lambda: t.SwinForImageClassification(t.SwinConfig(image_size=32, patch_size=4, embed_dim=16,
                                                                  depths=[1, 1], num_heads=[2, 2], window_size=4,
                                                                  num_labels=5)),
        "convnext": lambda: t.ConvNextForImageClassification(t.ConvNextConfig(
            hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], image_size=64, num_labels=10)),
    }


def attention_builders() -> dict[str, Callable[[], Any]]:
    """The --vs-autocast models: BERT-base, MiniLM (BERT 384 x 12) and a 4-layer Llama with grouped KV heads."""
    import transformers as t

    return {
        "bert_base": lambda: t.BertModel(t.BertConfig()),
        "minilm": lambda: t.BertModel(t.BertConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=12,
                                                   intermediate_size=1536)),
        "llama_small": lambda: t.LlamaForCausalLM(t.LlamaConfig(hidden_size=256, intermediate_size=1024,
                                                                num_hidden_layers=4, num_attention_heads=8,
                                                                num_key_value_heads=2)),
    }


def _cli(*args: str) -> float:
    """Run ``mpinfer ARGS`` (quiet); its wall time. Raises with its output when it fails."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "mpinfer", "-q", *args], capture_output=True, text=True)
    if out.returncode not in (0, 1) or (out.returncode == 1 and args[0] != "compare"):
        raise RuntimeError(f"mpinfer {args[0]} failed: {(out.stdout + out.stderr).strip()[-500:]}")
    return time.perf_counter() - start


def run_model(name: str, folder: Path) -> dict[str, Any]:
    """One architecture through export, convert and compare; the row of the table."""
    import onnx
    import torch

    torch.manual_seed(0)
    model = builders()[name]().eval()
    hf = folder / f"{name}_hf"
    model.save_pretrained(hf)
    onnx_path, low = folder / f"{name}.onnx", folder / f"{name}.fp16.onnx"
    row: dict[str, Any] = {"model": name, "class": type(model).__name__}
    row["export_s"] = _cli("export", str(hf), "-o", str(onnx_path), "--force")
    row["outputs"] = [o.name for o in onnx.load(str(onnx_path), load_external_data=False).graph.output]
    row["convert_s"] = _cli("convert", str(onnx_path), "-o", str(low), "--force")
    summary = json.loads(low.with_name(f"{name}.fp16.plan.json").read_text())["summary"]
    row["fp16_flops"] = summary.get("low_share_flops")
    row["casts"] = summary.get("cast_count")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "mpinfer", "-q", "compare", str(onnx_path), str(low), "--json"],
                         capture_output=True, text=True)
    row["compare_s"] = time.perf_counter() - start
    report = json.loads(out.stdout)
    row["passed"] = out.returncode == 0
    row["errors"] = {o["name"]: {k: o["values"].get(k) for k in ("max_abs", "cosine", "top1")}
                     for o in report["candidates"][0]["outputs"]}
    return row


def _padded_batch(onnx_path: Path, vocab: int, samples: int, seq: int, seed: int) -> dict[str, Any]:
    """Random token ids with right padding (each sample keeps 50-100 % of ``seq``), for every model input."""
    import numpy as np
    import onnx

    rng = np.random.default_rng(seed)
    keep = rng.integers(seq // 2, seq + 1, size=samples)
    mask = (np.arange(seq)[None, :] < keep[:, None]).astype(np.int64)
    feeds = {"input_ids": rng.integers(0, vocab, size=(samples, seq), dtype=np.int64), "attention_mask": mask,
             "token_type_ids": np.zeros((samples, seq), np.int64)}
    names = [i.name for i in onnx.load(str(onnx_path), load_external_data=False).graph.input]
    return {n: feeds[n] for n in names}


def run_vs_autocast(name: str, folder: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One attention model: export, convert (mpinfer now, mpinfer --before, AutoCast), evaluate each strictly."""

    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import precision as bp  # bench/precision.py: the AutoCast worker, metrics, FP16 share and casts

    torch.manual_seed(0)
    model = attention_builders()[name]().eval()
    hf, src = folder / f"{name}_hf", folder / f"{name}.onnx"
    if not src.exists():
        model.save_pretrained(hf)
        _cli("export", str(hf), "-o", str(src), "--force")
    vocab = model.config.vocab_size
    del model
    cal = folder / f"{name}.cal.npz"
    np.savez(cal, **_padded_batch(src, vocab, args.samples, args.seq, seed=0))
    feeds = _padded_batch(src, vocab, args.samples, args.seq, seed=123)
    runs = [("mpinfer", str(ROOT))] + ([("mpinfer-before", str(args.before))] if args.before else [])
    rows = []
    for tool, root in runs:
        dst = folder / f"{name}.{tool}.onnx"
        cmd = [sys.executable, "-m", "mpinfer", "-q", "convert", str(src), "-o", str(dst), "--calibration",
               str(cal), "--force"]
        rows.append({"model": name, "tool": tool, **_measured(cmd, root), "dst": dst})
    dst = folder / f"{name}.autocast.onnx"
    rows.append({"model": name, "tool": "autocast", **bp.launch("modelopt", src, dst, cal, args.vs_autocast),
                 "dst": dst})
    shapes = {k: v.shape for k, v in feeds.items()}
    ref = _strict_outputs(src, feeds)
    for row in rows:
        dst = row.pop("dst")
        if row["ok"]:
            row.update(bp.fp16_share_and_casts(src, dst, shapes))
            got = _strict_outputs(dst, feeds)
            row["strict"] = {n: bp.metrics([ref[n]], [got[n]]) for n in ref}
    return rows


def _measured(cmd: list[str], root: str) -> dict[str, Any]:
    """Wall time and peak RSS of one command run in ``root`` (``python -m`` imports from there first).

    The peak comes from GNU time's ``%M`` (wait4 in a small parent): a child forked from this process would
    report this process's own peak, since Linux carries the forked parent's high-water mark over ``exec``.
    """
    import os
    import shutil

    timer = shutil.which("time") or ""
    full = [timer, "-f", "peak_kb=%M", *cmd] if timer else cmd
    start = time.perf_counter()
    out = subprocess.run(full, env={**os.environ, "PYTHONPATH": root}, cwd=root, capture_output=True, text=True)
    row: dict[str, Any] = {"wall_s": round(time.perf_counter() - start, 1), "ok": out.returncode == 0}
    lines = out.stderr.strip().splitlines()
    peak = [ln for ln in lines if ln.startswith("peak_kb=")]
    if peak:
        row["peak_rss_mb"] = round(int(peak[-1].split("=")[1]) / 1024)
    if out.returncode:
        row["error"] = ([ln for ln in lines if not ln.startswith("peak_kb=")] or ["no output"])[-1][:200]
    return row


def _strict_outputs(path: Path, feeds: dict[str, Any]) -> dict[str, Any]:
    """Every output of ``path`` under strict numerics, batch by batch of 4 samples (memory stays bounded)."""
    import numpy as np

    from mpinfer.precision.emulator.runner import StrictRunner

    n = len(next(iter(feeds.values())))
    parts: dict[str, list[Any]] = {}
    with StrictRunner(path) as runner:
        for i in range(0, n, 4):
            for k, v in runner.infer({k: v[i : i + 4] for k, v in feeds.items()}).items():
                parts.setdefault(k, []).append(np.asarray(v, np.float32))
    return {k: np.concatenate(v) for k, v in parts.items()}


def markdown_vs_autocast(rows: list[dict[str, Any]]) -> str:
    """The --vs-autocast table: per model and tool, Casts, FP16 FLOPs, strict cosine (min over outputs), max abs."""
    lines = ["| model | tool | Casts | FP16 share of FLOPs | strict cosine (min over outputs) | strict max abs "
             "(max over outputs) | convert wall s | peak RSS MB |", "|" + "---|" * 8]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['model']} | {r['tool']} | | | | | {r.get('wall_s', '')} | failed: "
                         f"{r.get('error', '')[:100]} |")
            continue
        errs = list(r["strict"].values())
        lines.append(
            f"| {r['model']} | {r['tool']} | {r['casts']} | {r['fp16_flops']:.1%} | "
            f"{min(e['cosine'] for e in errs):.7f} | {max(e['max_abs'] for e in errs):.3g} | {r['wall_s']} | "
            f"{r.get('peak_rss_mb', '')} |"
        )
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The results table."""
    lines = ["| model | class | outputs | export s | convert s | compare s | FP16 FLOPs | Casts | max abs | cosine "
             "(min) | top-1 (min) | compare |", "|" + "---|" * 12]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | | | | | | | | | | | {r['error'][:120]} |")
            continue
        errs = list(r["errors"].values())
        top1 = [e["top1"] for e in errs if e.get("top1") is not None]
        lines.append(
            f"| {r['model']} | {r['class']} | {', '.join(r['outputs'])} | {r['export_s']:.1f} | {r['convert_s']:.2f} "
            f"| {r['compare_s']:.2f} | {r['fp16_flops']:.1%} | {r['casts']} | "
            f"{max(e['max_abs'] for e in errs):.3g} | {min(e['cosine'] for e in errs):.7f} | "
            f"{f'{min(top1):.4f}' if top1 else 'n/a'} | {'PASS' if r['passed'] else 'FAIL'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(builders()), help="comma-separated subset")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "hf_archs")
    ap.add_argument("--vs-autocast", metavar="PY", help="python with nvidia-modelopt: the attention models vs AutoCast")
    ap.add_argument("--before", type=Path, help="a root whose mpinfer package is run as 'mpinfer-before'")
    ap.add_argument("--samples", type=int, default=16, help="calibration and evaluation samples (--vs-autocast)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (--vs-autocast)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.vs_autocast:
        main_vs_autocast(args)
        return
    rows = []
    for name in args.models.split(","):
        try:
            rows.append(run_model(name, args.out))
        except Exception as err:  # one architecture failing is a result, the others still run
            rows.append({"model": name, "error": f"{type(err).__name__}: {err}"})
        print(json.dumps(rows[-1]), flush=True)
    (args.out / "hf_archs.json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows)
    (args.out / "hf_archs.md").write_text(table + "\n")
    print(table)


def main_vs_autocast(args: argparse.Namespace) -> None:
    """The --vs-autocast run: one model at a time (one heavy process at a time), rows printed as they come."""
    names = args.models.split(",") if args.models != ",".join(builders()) else list(attention_builders())
    rows: list[dict[str, Any]] = []
    for name in names:
        for row in run_vs_autocast(name, args.out, args):
            rows.append(row)
            print(json.dumps(row), flush=True)
    (args.out / "vs_autocast.json").write_text(json.dumps(rows, indent=1))
    table = markdown_vs_autocast(rows)
    (args.out / "vs_autocast.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
