"""Decode speed of a small Llama-shaped decoder with its KV cache, FP32 vs FP16, through ONNX Runtime.

The issue's small decoder (hidden 256, 4 layers, 8 heads, 2 KV heads, intermediate 688, vocab 32000; random
weights from the config, nothing downloaded) goes through mpinfer's API as a user's CLI run would:
export (KV cache) → convert to FP16 with calibration prompts decoded by the FP32 model and a budget → greedy
generation with both models (``compare --generate``'s code). Per batch size: prefill ms (one prompt batch of
``--prompt-len`` tokens on an empty past) and decode tokens/s (``--tokens - 1`` steps, one token per row each),
median of 5 runs after a warm-up; plus the generation metrics of the FP16 model against the FP32 one.

    PYTHONPATH=$PWD .venv/bin/python bench/decode.py [--batch-sizes 1,8] [--tokens 32] [--prompt-len 32]
        [--providers CUDAExecutionProvider,CPUExecutionProvider] [--out bench/out/decode]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

CONFIG = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
          "intermediate_size": 688, "vocab_size": 32000, "max_position_embeddings": 512}


def build(folder: Path) -> None:
    """The seeded random-weight decoder, saved as a Hugging Face folder."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval().save_pretrained(folder)


def main() -> None:
    """Build, export, convert, then time decoding with both models."""
    from mpinfer.export import ExportConfig, export_onnx
    from mpinfer.generation import GenerateConfig, generate_compare
    from mpinfer.precision.convert import ConvertConfig, convert_precision

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--providers", default="")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="mpinfer-decode-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    build(out / "llama")
    m32 = export_onnx(ExportConfig(source=str(out / "llama"), output=out / "m.onnx", force=True)).path
    t_export = time.perf_counter() - t0
    ids = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (args.prompts, args.prompt_len))
    np.savez(out / "prompts.npz", input_ids=ids.astype(np.int64))
    t0 = time.perf_counter()
    convert_precision(ConvertConfig(model=m32, output=out / "m.fp16.onnx", calibration=f"prompts:{out / 'prompts.npz'}",
                                    budget="cosine>=0.999", force=True))
    t_convert = time.perf_counter() - t0
    plan = json.loads((out / "m.fp16.plan.json").read_text())
    (res,) = generate_compare(GenerateConfig(
        str(m32), (str(out / "m.fp16.onnx"),), str(out / "prompts.npz"), args.tokens,
        latency_batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
        providers=tuple(p for p in args.providers.split(",") if p)))
    print(f"export {t_export:.1f} s, convert {t_convert:.1f} s; plan: {plan.get('summary', {})}")
    print("| batch | model | prefill ms | decode tokens/s |\n|---|---|---|---|")
    for batch, models in res.latency.items():
        for who, t in models.items():
            print(f"| {batch} | {'FP32' if who == 'baseline' else 'FP16'} | {t['prefill_ms']:.2f} | "
                  f"{t['decode_tokens_per_s']:.0f} |")
    print(json.dumps(res.metrics()))


if __name__ == "__main__":
    main()
