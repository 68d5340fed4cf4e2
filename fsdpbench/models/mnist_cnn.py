"""The PyTorch FSDP getting-started tutorial's MNIST network (conv 1→32→64, fc 9216→128→10)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    """As in the FSDP tutorial; input 1×28×28, log-probabilities out."""

    def __init__(self, dropout: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def make_batch(args: dict[str, Any], batch: int, seq_len: int, gen: torch.Generator):
    x = torch.randn(batch, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return x, y


def block_classes(args: dict[str, Any]) -> tuple[type[nn.Module], ...]:
    return (nn.Conv2d, nn.Linear)
