"""One rank's data-parallel model, built from a case: model → knobs → strategy → optimizer.

The worker (real and emulated ranks), the traced predictor and the step benchmarks all build with
``build_parallel``, so what is predicted and benchmarked is what is measured:

    parallel = build_parallel(case, device, rank)
    loss = train_step(parallel, rank_batch(case, rank, step, device))      # fsdpbench.engine.step

The order is torchtitan's: the wrap units are found on the model's own blocks, then activation
checkpointing → compile → the strategy's ``apply``; the optimizer is built on the result. How the
model's tensors come to exist is a ``Build``: on the rank's device by default; the traced predictor
builds fake tensors, an emulated rank only its own shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdpbench.core.case import Case
from fsdpbench.core.precision import Precision
from fsdpbench.engine.knobs import apply_activation_checkpointing, apply_compile
from fsdpbench.models import ModelDef, resolve_model
from fsdpbench.models.wrap import get_wrap_units
from fsdpbench.strategies import ApplyContext, Strategy, get_strategy


@dataclass(kw_only=True)
class Parallelize:
    """The knobs and the strategy, applied to a built model (``parallelize(model)``); it keeps the
    number of FSDP units it made (the root included)."""

    case: Case
    device: torch.device
    rank: int
    strategy: Strategy
    n_units: int = field(default=1, init=False)

    def __call__(self, model: nn.Module) -> nn.Module:
        units = get_wrap_units(model, self.case) if self.strategy.uses_wrap else []
        self.n_units = len(units) + 1
        ctx = ApplyContext(
            case=self.case, device=self.device, rank=self.rank, world_size=self.case.world_size, units=units
        )
        model = apply_activation_checkpointing(model, self.case)
        model = apply_compile(model, self.case)
        return self.strategy.apply(model, ctx)


# builds the model of ``ModelDef`` with its arguments, parallelizes it, and returns it with Ψ, the
# parameter count of the whole model before anything is sharded
Build = Callable[[ModelDef, dict[str, Any], Parallelize], tuple[nn.Module, int]]


@dataclass(kw_only=True, slots=True)
class Parallel:
    """A model made data-parallel on one rank, and what a training step needs beside it."""

    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[..., torch.Tensor]
    autocast: contextlib.AbstractContextManager  # re-entered by every step
    params: int  # Ψ, counted before the strategy shards anything
    n_units: int  # FSDP units, the root included (1 for strategies without wrap units)
    max_norm: float | None = None  # gradient clipping between backward and the optimizer step


def build_parallel(case: Case, device: torch.device, rank: int, *, build: Build | None = None) -> Parallel:
    """This rank's model with the case's knobs and strategy applied, and its optimizer.

    ``build``: how the model's tensors are made (default: every rank builds the whole model on
    ``device`` from the case's seed, so all ranks start from the same weights)."""
    strategy = get_strategy(case.strategy)
    mdef, margs = resolve_model(case.model, case.model_args)
    parallelize = Parallelize(case=case, device=device, rank=rank, strategy=strategy)
    model, params = (build or _on_device(device, case.seed))(mdef, margs, parallelize)
    return Parallel(
        strategy=strategy,
        model=model,
        optimizer=strategy.build_optimizer(model, case),
        loss_fn=mdef.loss,
        autocast=autocast_for(case.precision_spec, strategy, device),
        params=params,
        n_units=parallelize.n_units,
        max_norm=case.max_norm,
    )


def _on_device(device: torch.device, seed: int) -> Build:
    def build(mdef: ModelDef, margs: dict[str, Any], parallelize: Parallelize) -> tuple[nn.Module, int]:
        torch.manual_seed(seed)
        with torch.device(device):
            model = mdef.build(**margs)
        params = count_params(model)
        return parallelize(model), params

    return build


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def autocast_for(
    precision: Precision, strategy: Strategy, device: torch.device
) -> contextlib.AbstractContextManager:
    """Autocast for 16-bit precisions where the strategy does not cast parameters itself (DDP, ZeRO-1)."""
    if not precision.casts or strategy.native_mixed_precision:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision.torch_dtypes()[0])
