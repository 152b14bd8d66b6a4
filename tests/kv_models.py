"""Tiny random-weight causal LMs built from a config (nothing downloaded), and prompts for them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Llama-shaped: grouped-query attention (4 query heads, 2 KV heads), head_dim 16.
LLAMA = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 256}


def llama_folder(folder: Path, seed: int = 0, **overrides: int) -> Path:
    """A LlamaForCausalLM with random weights, saved with save_pretrained."""
    import torch
    import transformers

    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **overrides})).eval().save_pretrained(folder)
    return folder


def gpt2_folder(folder: Path, seed: int = 0) -> Path:
    """A GPT2LMHeadModel (multi-head attention, learned positions) with random weights."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=2, n_positions=128,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(folder)
    return folder


def prompts_npz(path: Path, count: int = 6, length: int = 10, vocab: int = LLAMA["vocab_size"], seed: int = 0,
                padded: bool = True) -> Path:
    """Prompts ``input_ids`` [count, length]; with ``padded`` two of them are left-padded."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (count, length)).astype(np.int64)
    mask = np.ones_like(ids)
    if padded:
        mask[1, :3] = 0
        mask[-1, :1] = 0
    np.savez(path, input_ids=ids, attention_mask=mask)
    return path


def tokenizer_folder(folder: Path, words: int = 100) -> Path:
    """A word-level tokenizer built offline (``[UNK]`` 0, ``[PAD]`` 1, then ``w0``.. ``w{words-1}``)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1} | {f"w{i}": i + 2 for i in range(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(
        folder)
    return folder
