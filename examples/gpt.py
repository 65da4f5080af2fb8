"""A tiny byte-level GPT and its bundled training text, for the example job.

Everything here is deterministic in (seed, step, rank): the batch a rank trains on at a step
does not depend on what happened before, so a run that restarts from a checkpoint sees exactly
the batches a run without faults sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

# Bundled text (written for this project), repeated to form the corpus: nothing is downloaded.
TEXT = (
    "A training job is a long walk across a narrow bridge. Every step costs time on many "
    "machines at once, and every fault sends some of that time into the river. A good "
    "framework notices the fault at once, stops every worker cleanly, brings the state back "
    "from the nearest copy, and walks on. The copy in memory is the nearest; the copy on the "
    "local disk survives a lost process; the copy in the shared store survives a lost node. "
    "Checkpoints cost time too, so they are written while the next steps already run. When a "
    "loss turns into a number that is not a number, the step is run again with the same data "
    "and the same random state: if the answer changes, the hardware blinked; if it stays, "
    "the model itself is at fault, and no restart will fix it. "
)


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256  # bytes
    seq: int = 64  # context length in bytes
    d_model: int = 64
    n_head: int = 4
    n_layer: int = 2


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.n_head, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(1, cfg.seq, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        mask = torch.triu(torch.full((cfg.seq, cfg.seq), -math.inf), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:, :t]
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """The same initial weights on every rank and in every restart for the same seed."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = GPT(cfg)
    torch.random.set_rng_state(gen_state)
    return model


def corpus() -> torch.Tensor:
    data = (TEXT * 8).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch(
    data: torch.Tensor, *, seed: int, step: int, rank: int, batch_size: int, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `rank` at `step`: a pure function of its arguments (replay-safe)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, data.numel() - seq - 1, (batch_size,), generator=gen)
    x = torch.stack([data[s : s + seq] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + seq + 1] for s in starts.tolist()])
    return x, y
