"""A small transformer encoder over token ids: embedding, LayerNorm, softmax attention, GELU MLP."""

from __future__ import annotations

import math

import torch
from torch import nn

VOCAB = 1000
MAX_LEN = 128
INPUT_SPECS = [f"input_ids:batchxseq=16:int64:0..{VOCAB}"]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyEncoder(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, depth: int = 2, num_classes: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(1, MAX_LEN, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos[:, : input_ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x).mean(dim=1))


def build(dim: int = 64, heads: int = 4, depth: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return TinyEncoder(dim, heads, depth).eval()


def example_inputs(batch: int = 2, seq: int = 16) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0)),)


def train_data(train: int = 512, held_out: int = 128, seq: int = 16) -> tuple[object, object]:
    """(train, eval) Datasets for ``mpinfer train``: token sequences whose class is the vocabulary quarter that
    most of their tokens come from (10 of 16 drawn from the class's quarter, the rest from anywhere).

    Synthetic and seeded: the model's inputs are token ids, which the built-in digits images are not.
    """
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    n, quarter, own = train + held_out, VOCAB // 4, (seq * 5) // 8
    labels = torch.randint(0, 4, (n,), generator=g)
    ids = torch.randint(0, VOCAB, (n, seq), generator=g)
    ids[:, :own] = labels[:, None] * quarter + torch.randint(0, quarter, (n, own), generator=g)
    ids = torch.gather(ids, 1, torch.argsort(torch.rand(n, seq, generator=g), dim=1))  # the class tokens anywhere
    return TensorDataset(ids[:train], labels[:train]), TensorDataset(ids[train:], labels[train:])
