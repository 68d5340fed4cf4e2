"""A plain MLP: ``depth`` blocks of Linear(width, width) + ReLU, then a 10-way classifier.

The torch side of the ``mlp`` family (declared in ``fsdpbench/models/families/mlp.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(x))


class MLP(nn.Module):
    def __init__(self, width: int = 256, depth: int = 4, n_classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_batch(args: dict[str, Any], batch: int, seq_len: int, gen: torch.Generator):
    x = torch.randn(batch, args["width"], generator=gen)
    y = torch.randint(0, args["n_classes"], (batch,), generator=gen)
    return x, y


def block_classes(args: dict[str, Any]) -> tuple[type[nn.Module], ...]:
    return (MLPBlock,)
