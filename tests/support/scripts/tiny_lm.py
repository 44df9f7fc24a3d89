"""The tiny next-token model pieces and the fixed dataset the DeepSpeed user scripts share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

VOCAB, HIDDEN, SEQ, SAMPLES = 64, 32, 16, 512


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(),
                                 nn.Linear(2 * HIDDEN, HIDDEN), nn.Dropout(dropout))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(self.norm(hidden))


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def dataset(samples: int = SAMPLES) -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
