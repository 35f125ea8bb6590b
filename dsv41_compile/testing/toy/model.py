"""The toy family's model: an embedding, residual MLP blocks, a head. About 80 nodes per graph,
compiled in a second."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ToyConfig", "ToyLM"]


@dataclass(frozen=True)
class ToyConfig:
    vocab: int = 64
    dim: int = 16
    hidden: int = 32
    n_layers: int = 2


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.mlp = _MLP(dim, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class ToyLM(nn.Module):
    """tokens [T] int64 -> logits [T, vocab]."""

    def __init__(self, vocab: int = 64, dim: int = 16, hidden: int = 32, n_layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, hidden) for _ in range(n_layers))
        self.out = nn.Linear(dim, vocab, bias=False)
        self.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        for block in self.blocks:
            h = block(h)
        return self.out(h)
