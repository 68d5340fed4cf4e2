"""One training step, as every rank runs it — shared by the worker (real ranks), the traced predictor
(fake tensors, fake process group) and the step benchmarks, so what is predicted is what is measured.

A rank takes its slice of the global batch (``batch_size`` rows from ``rank * batch_size``), so the
loss averaged over ranks is the loss of the same global batch on one rank (the correctness check).
The batch is an argument: a timed step gets one built before its timer starts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fsdpbench.core.case import Case
from fsdpbench.engine.parallel import Parallel
from fsdpbench.models import make_global_batch

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs, targets


def rank_batch(case: Case, rank: int, step: int, device: torch.device) -> Batch:
    """This rank's inputs and targets for a step: its rows of the seeded global batch."""
    x, y = make_global_batch(
        case.model, case.model_args, case.global_batch_size, case.seq_len, case.seed, step
    )
    lo, hi = rank * case.batch_size, (rank + 1) * case.batch_size
    return x[lo:hi].to(device), y[lo:hi].to(device)


def train_step(
    parallel: Parallel, batch: Batch, *, after_optim: Callable[[], None] | None = None
) -> torch.Tensor:
    """Forward, backward, optimizer step (``after_optim`` runs here, before zero_grad); the loss."""
    x, y = batch
    with parallel.autocast:
        loss = parallel.loss_fn(parallel.model(x), y)
    loss.backward()
    parallel.optimizer.step()
    if after_optim is not None:
        after_optim()
    parallel.optimizer.zero_grad(set_to_none=True)
    return loss
