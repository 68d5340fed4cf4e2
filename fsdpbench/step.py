"""One training step, as every rank runs it — shared by the worker (real ranks) and the traced
predictor (fake tensors, fake process group), so what is predicted is what is measured.

A rank takes its slice of the global batch (``batch_size`` rows from ``rank * batch_size``), so the
loss averaged over ranks is the loss of the same global batch on one rank (the correctness check).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdpbench.case import Case
from fsdpbench.models import make_global_batch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_for(case: Case, strategy: Any, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast for 16-bit precisions where the strategy does not cast parameters itself (DDP, ZeRO-1)."""
    if case.precision == "fp32" or strategy.native_mixed_precision:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[case.precision.split("-")[0]])


def rank_batch(case: Case, rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets for a step: its rows of the seeded global batch."""
    x, y = make_global_batch(
        case.model, case.model_args, case.global_batch_size, case.seq_len, case.seed, step
    )
    lo, hi = rank * case.batch_size, (rank + 1) * case.batch_size
    return x[lo:hi].to(device), y[lo:hi].to(device)


def train_step(
    case: Case,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    *,
    rank: int,
    step: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager,
    after_optim: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Forward, backward, optimizer step (``after_optim`` runs here, before zero_grad); the loss."""
    x, y = rank_batch(case, rank, step, device)
    with autocast:
        loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    if after_optim is not None:
        after_optim()
    optimizer.zero_grad(set_to_none=True)
    return loss
