"""Your own model in fsdpbench: a factory that returns the module, its block classes, its loss and its
batch maker (``fsdpbench.models.OwnModel``). Its keyword arguments, each with a default, are the
``model_args`` a scenario or ``--model-args`` may set. Run from the repository root:

    python -m fsdpbench run examples/my_model.yaml --allow-plugins            # real CPU ranks
    python -m fsdpbench run examples/my_model.yaml --allow-plugins --emulate  # one rank, fake group
    python -m fsdpbench predict --model examples.my_model:build --model-args width=128 \\
        --world-size 8 --strategy zero3 --device cpu                          # traced (no analytic model)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fsdpbench.models import OwnModel


class ResidualBlock(nn.Module):
    """LayerNorm, then a GELU MLP, added back to the stream: one FSDP unit with ``wrap: block``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TokenMLP(nn.Module):
    """Embedding, ``depth`` residual blocks, a final norm and a per-token classifier."""

    def __init__(self, width: int, depth: int, vocab: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(ResidualBlock(width, 4 * width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build(width: int = 64, depth: int = 2, vocab: int = 256, classes: int = 16) -> OwnModel:
    """Residual-MLP token classifier (width, depth, vocab, classes)."""

    def make_batch(
        samples: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab, (samples, seq_len), generator=generator)
        labels = torch.randint(0, classes, (samples, seq_len), generator=generator)
        return tokens, labels

    return OwnModel(
        module=TokenMLP(width, depth, vocab, classes),
        block_classes=(ResidualBlock,),
        loss=token_loss,
        make_batch=make_batch,
        is_sequence=True,
    )
