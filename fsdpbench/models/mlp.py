"""A plain MLP: ``depth`` blocks of Linear(width, width) + ReLU, then a 10-way classifier."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdpbench.models.registry import ModelDef, register_model, register_preset


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


def _make_batch(args: dict[str, Any], batch: int, seq_len: int, gen: torch.Generator):
    x = torch.randn(batch, args["width"], generator=gen)
    y = torch.randint(0, args["n_classes"], (batch,), generator=gen)
    return x, y


register_model(
    ModelDef(
        name="mlp",
        build=MLP,
        defaults={"width": 256, "depth": 4, "n_classes": 10},
        make_batch=_make_batch,
        loss=F.cross_entropy,
        block_classes=lambda args: (MLPBlock,),
        description="MLP of `depth` Linear+ReLU blocks of `width`",
    )
)
register_preset("mlp-tiny", "mlp", "MLP 64 wide, 2 deep (~9k params)", width=64, depth=2)
register_preset("mlp-1m", "mlp", "MLP 512 wide, 4 deep (~1.05M params)", width=512, depth=4)
