"""Optimizers by name, and their state bytes per parameter (K)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fsdpbench.case import Case

# name -> (class, kwargs beyond lr, fp32 state bytes per parameter)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], int]] = {
    "adam": (torch.optim.Adam, {}, 8),
    "adamw": (torch.optim.AdamW, {}, 8),
    "sgd": (torch.optim.SGD, {}, 0),
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}, 4),
    "adadelta": (torch.optim.Adadelta, {}, 8),
}


def get_optimizer(name: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    try:
        cls, kwargs, _ = OPTIMIZERS[name]
    except KeyError:
        raise KeyError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}") from None
    return cls, dict(kwargs)


def build_optimizer(params: Iterable[torch.nn.Parameter], case: Case) -> torch.optim.Optimizer:
    cls, kwargs = get_optimizer(case.optimizer)
    # foreach=False keeps the per-parameter update order (and its temporaries) the same on every strategy
    return cls(params, lr=case.lr, foreach=False, **kwargs)  # type: ignore[call-arg]  # every OPTIMIZERS class takes both


def optimizer_state_bytes_per_param(name: str) -> int:
    """K for fp32 state, without a master copy (the ZeRO paper's K=12 adds a 4-byte fp32 master)."""
    get_optimizer(name)
    return OPTIMIZERS[name][2]
