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
    """Forward, backward, gradient clipping (with ``max_norm``), optimizer step (``after_optim`` runs
    here, before zero_grad); the loss."""
    x, y = batch
    with parallel.autocast:
        loss = parallel.loss_fn(parallel.model(x), y)
    loss.backward()
    if parallel.max_norm is not None:
        clip_grad_norm(parallel.model, parallel.max_norm)
    parallel.optimizer.step()
    if after_optim is not None:
        after_optim()
    parallel.optimizer.zero_grad(set_to_none=True)
    return loss


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their total 2-norm is at most ``max_norm``, as torchtitan clips: the
    norm by ``torch.nn.utils.get_total_norm`` (foreach; over FSDP2's sharded DTensor gradients a partial
    norm, made whole by an all-reduce), then ``clip_grads_with_norm_`` (foreach). The total norm."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, False, True)  # type: ignore[misc]
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
