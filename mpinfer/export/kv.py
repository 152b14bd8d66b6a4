"""Export a Hugging Face causal LM with its KV cache (like Optimum's ``text-generation-with-past``).

transformers 5 passes the cache as a ``Cache`` object (``DynamicCache``), which no exporter takes as an input.
:func:`kv_call` wraps the model in a module whose ``forward`` takes flat tensors, ``input_ids``,
``attention_mask`` (past + new tokens), ``position_ids`` and ``past_key_values.{i}.key/value``, builds the cache
from them, and returns ``logits`` and the updated cache flattened as ``present.{i}.key/value``. Grouped-query
attention stays as it is: the cache holds ``num_key_value_heads`` heads.

The export goes through ``torch.export`` (``dynamo=True``) with every size dynamic: batch, ``seq`` (new tokens),
``past`` and ``total`` (the mask's, past + new), given by name in the forward's argument structure (the cache as one
tuple, for ``*past``). torch.export records minimum sizes of 2 for them, but the graph holds no branch on them: it
matches torch on a prefill over an empty past and on one-token decode steps at batch 1 (what parity checks, a prefill
and three decode steps). A decoder is written at :func:`decoder_opset`, the opset whose ``RMSNormalization`` convert
fuses the norm chains into, when the installed ONNX Runtime runs it. The TorchScript exporter (``--exporter
torchscript``, opset 17) stays as the fallback ``auto`` takes when dynamo fails, and one the user can name.
"""

from __future__ import annotations

import logging
from typing import Any

from mpinfer.data.decode import KvLayout
from mpinfer.export.loader import LoadedModel, hf_forward_inputs
from mpinfer.modelio import RMS_NORM_OPSET, ort_runs_rms_normalization

logger = logging.getLogger(__name__)

# Example sizes the specs carry: prompt and past of 8 tokens (total 16), the sizes random data and the export's
# example inputs use. total must be past + seq: random data sized from these stays consistent.
EXAMPLE_SEQ = 8
EXAMPLE_PAST = 8
# The attention implementation the KV export traces. Eager attention adds a float mask built from float32's lowest
# value, which convert rewrites to the low format's safe lowest (mpinfer.precision.graph.masks); the TorchScript
# exporter turns SDPA's boolean mask into Where(mask, 0, -inf), which that rewrite does not take, so every layer's
# mask-add and Softmax stayed FP32 (23 Casts against 19 on a 2-layer Llama; the same logits to 2e-7 in parity).
KV_ATTENTION = "eager"
# The opset a decoder is exported at when the installed ONNX Runtime runs its RMSNormalization (the first opset that
# has it): convert then fuses each RMSNorm chain into one op with float32 statistics instead of an FP32 island.
DECODER_OPSET = RMS_NORM_OPSET


def decoder_opset() -> int | None:
    """:data:`DECODER_OPSET` when ONNX Runtime runs RMSNormalization there (probed), else None (the exporter's own)."""
    if ort_runs_rms_normalization(DECODER_OPSET):
        return DECODER_OPSET
    logger.info("ONNX Runtime does not run RMSNormalization (opset %d): the decoder is exported at the exporter's "
                "default opset, its RMSNorm chains stay unfused", DECODER_OPSET)
    return None


def cache_argument(model: Any) -> str | None:
    """The name of the model's cache argument (``cache`` in transformers 5, ``past_key_values`` before)."""
    accepted = hf_forward_inputs(model)
    return next((n for n in ("cache", "past_key_values") if n in accepted), None)


def supports_kv(model: Any) -> bool:
    """True for a causal LM (decoder-only, with a language-model head) that takes and returns a cache."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or cache_argument(model) is None:
        return False
    name = type(model).__name__
    if not (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")):
        return False
    accepted = hf_forward_inputs(model)
    return "input_ids" in accepted and "attention_mask" in accepted and "position_ids" in accepted


def _cache_of(out: Any) -> Any:
    for key in ("cache", "past_key_values"):
        value = getattr(out, key, None)
        if value is not None:
            return value
    raise ValueError(f"{type(out).__name__} holds no cache (keys: {list(out.keys())})")


def _flatten_cache(cache: Any) -> list[Any]:
    if hasattr(cache, "layers"):
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [t for pair in cache for t in pair[:2]]  # a legacy tuple of (key, value) per layer


def _kv_call_class() -> Any:
    import torch

    class KvCall(torch.nn.Module):
        """A causal LM called with flat tensors for its cache; returns logits and the flat updated cache."""

        def __init__(self, model: Any, layout: KvLayout) -> None:
            super().__init__()
            self.model = model
            self.kv_layout = layout  # parity looks for it: a prefill and decode steps instead of random shapes
            self.num_layers = layout.num_layers
            self.cache_arg = cache_argument(model)

        def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, *past: Any) -> Any:
            from transformers.cache_utils import DynamicCache

            pairs = [(past[2 * i], past[2 * i + 1]) for i in range(self.num_layers)]
            cache = DynamicCache(ddp_cache_data=pairs, config=self.model.config)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, return_dict=True, **{str(self.cache_arg): cache})
            return (out.logits, *_flatten_cache(_cache_of(out)))

    return KvCall


def probe_layout(model: Any) -> KvLayout:
    """The model's cache layout, read from the cache of a 2-token forward pass (no config arithmetic)."""
    import numpy as np
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.zeros((1, 2), dtype=torch.long), use_cache=True, return_dict=True)
    flat = _flatten_cache(_cache_of(out))
    key = flat[0]
    return KvLayout(len(flat) // 2, int(key.shape[1]), int(key.shape[3]),
                    np.dtype(str(key.dtype).replace("torch.", "")), True)


def kv_specs(layout: KvLayout, vocab_size: int) -> list[str]:
    """Input specs of the KV export: dynamic batch, seq (new tokens), past and total (= past + seq) lengths."""
    total = EXAMPLE_SEQ + EXAMPLE_PAST
    dtype = layout.dtype.name
    specs = [f"input_ids:batchxseq={EXAMPLE_SEQ}:int64:0..{vocab_size}",
             f"attention_mask:batchxtotal={total}:int64:1..2",
             f"position_ids:batchxseq={EXAMPLE_SEQ}:int64:0..{total}"]
    specs += [f"{name}:batchx{layout.kv_heads}xpast={EXAMPLE_PAST}x{layout.head_dim}:{dtype}"
              for name in layout.past_names]
    return specs


def output_axes(layout: KvLayout) -> dict[str, dict[int, str]]:
    """Dynamic axes of the outputs: logits [batch, seq, vocab], presents [batch, heads, total, dim]."""
    axes = {"logits": {0: "batch", 1: "seq"}}
    axes.update({name: {0: "batch", 2: "total"} for name in layout.present_names})
    return axes


def kv_call(model: Any) -> tuple[Any, KvLayout, list[str]]:
    """Wrap a causal LM for export with its cache: (module, layout, input specs)."""
    layout = probe_layout(model)
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or 0)
    if vocab <= 0:
        vocab = int(model.get_output_embeddings().weight.shape[0])
    module = _kv_call_class()(model, layout).eval()
    return module, layout, kv_specs(layout, vocab)


def example_args(layout: KvLayout, vocab_size: int, seed: int = 0) -> tuple[Any, ...]:
    """Consistent example inputs (positions after the past, mask over past + new) for tracing."""
    import torch

    g = torch.Generator().manual_seed(seed)
    batch, seq, past = 2, EXAMPLE_SEQ, EXAMPLE_PAST
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    mask = torch.ones((batch, past + seq), dtype=torch.long)
    pos = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    dtype = getattr(torch, layout.dtype.name)
    cache = [torch.randn((batch, layout.kv_heads, past, layout.head_dim), generator=g).to(dtype)
             for _ in layout.past_names]
    return (ids, mask, pos, *cache)


def with_kv_cache(loaded: LoadedModel) -> LoadedModel:
    """A Hugging Face causal LM wrapped to take and return its KV cache; any other model as it is."""
    model = getattr(loaded.module, "model", None)
    if loaded.kind != "huggingface" or model is None or not supports_kv(model):
        return loaded
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(KV_ATTENTION)
    module, layout, specs = kv_call(model)
    name = loaded.description.rsplit(" (", 1)[0]
    return LoadedModel(module, "huggingface", input_specs=specs, input_names=layout.input_names,
                       output_names=layout.output_names, kv=layout, output_axes=output_axes(layout),
                       description=f"{name} ({type(model).__name__}, with KV cache)")
