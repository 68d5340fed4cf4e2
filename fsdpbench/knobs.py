"""Model transforms applied around sharding, in torchtitan's order: activation checkpointing →
compile → data-parallel strategy."""

from __future__ import annotations

import torch
from torch import nn

from fsdpbench.case import Case
from fsdpbench.models import resolve_model


def apply_activation_checkpointing(model: nn.Module, case: Case) -> nn.Module:
    """Non-reentrant activation checkpointing of every block (the model's block classes)."""
    if not case.activation_checkpointing:
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing as _apply_ac,
        checkpoint_wrapper,
    )

    mdef, args = resolve_model(case.model, case.model_args)
    blocks = mdef.block_classes(args)
    _apply_ac(
        model,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, blocks),
    )
    return model


def apply_compile(model: nn.Module, case: Case) -> nn.Module:
    """torch.compile each block (per-block compile composes with FSDP2, as in torchtitan)."""
    if not case.compile:
        return model
    mdef, args = resolve_model(case.model, case.model_args)
    blocks = mdef.block_classes(args)
    for module in model.modules():
        if isinstance(module, blocks):
            module.compile()
    return model
