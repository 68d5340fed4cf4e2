"""What a strategy is: how it makes a model data-parallel, and which states it shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from fsdpbench.case import Case


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """Which model states are sharded (over the shard group) rather than replicated.

    The memory model reads this; it never needs a table of strategy names.
    """

    params: bool
    grads: bool
    optim: bool
    # SHARD_GRAD_OP / ZeRO-2 via FSDP: params sharded at rest, unsharded from forward to backward.
    params_unsharded_fwd_to_bwd: bool = False
    # "world": sharded over all ranks; "shard_group": over the HSDP shard group only.
    group: str = "world"
    # params are all-gathered unit by unit (FSDP); DDP/ZeRO-1 keep them whole.
    per_unit_gather: bool = False

    def comm_pattern(self) -> str:
        """Which textbook communication pattern this sharding implies (for the analytic volume)."""
        if self.params and self.group == "shard_group":
            return "hsdp"
        if self.params:
            return "zero2" if self.params_unsharded_fwd_to_bwd else "zero3"
        if self.optim:
            return "zero1"
        return "ddp"

    def degrees(self, world_size: int, shard_size: int | None = None) -> tuple[int, int, int]:
        """(d_p, d_g, d_o): 1 for a replicated state, the shard-group size for a sharded one.

        ``shard_size``: a shard-group sharding's group size, resolved (``Case.shard_group_size``)."""
        n = world_size
        if self.group == "shard_group":
            if shard_size is None:
                raise ValueError("a shard-group sharding needs its shard size (Case.shard_group_size)")
            n = shard_size
        return (n if self.params else 1, n if self.grads else 1, n if self.optim else 1)


@dataclass(kw_only=True)
class ApplyContext:
    """What a strategy gets to work with on one rank."""

    case: Case
    device: torch.device
    rank: int
    world_size: int
    units: list[nn.Module]  # wrap units in forward order, root excluded


class Strategy:
    """Base class; subclasses set the class variables and implement ``apply``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    sharding: ClassVar[Sharding]
    uses_wrap: ClassVar[bool] = False
    uses_prefetch: ClassVar[bool] = False
    # True when the strategy casts parameters itself (FSDP mixed precision); else the worker autocasts.
    native_mixed_precision: ClassVar[bool] = False

    def check(self, case: Case) -> str | None:
        """Why this case cannot run (a sentence), or None."""
        if case.prefetch and not self.uses_prefetch:
            return f"prefetch={case.prefetch} applies to FSDP strategies; {self.name} has no prefetch"
        return None

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        raise NotImplementedError

    def build_optimizer(self, model: nn.Module, case: Case) -> torch.optim.Optimizer:
        from fsdpbench.strategies.optim import build_optimizer

        return build_optimizer(model.parameters(), case)

    def fsdp_root(self, model: nn.Module) -> nn.Module | None:
        """The FSDP2 root module if this strategy uses FSDP2 (memory tracking picks its tracker)."""
        return None
