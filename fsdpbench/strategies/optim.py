"""Optimizers by name, and their state bytes per parameter (K).

Each is named by its class in ``torch.optim``, imported only to build one: the memory model reads
K and the class name without importing torch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from fsdpbench.core.case import Case

if TYPE_CHECKING:
    import torch

# name -> (class name in torch.optim, kwargs beyond lr, fp32 state bytes per parameter)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any], int]] = {
    "adam": ("Adam", {}, 8),
    "adamw": ("AdamW", {}, 8),
    "sgd": ("SGD", {}, 0),
    "sgd-momentum": ("SGD", {"momentum": 0.9}, 4),
    "adadelta": ("Adadelta", {}, 8),
}


def optimizer_class_name(name: str) -> str:
    """The ``torch.optim`` class of a named optimizer (``"adamw"`` → ``"AdamW"``)."""
    try:
        return OPTIMIZERS[name][0]
    except KeyError:
        raise KeyError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}") from None


def get_optimizer(name: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    import torch

    cls = getattr(torch.optim, optimizer_class_name(name))
    return cls, dict(OPTIMIZERS[name][1])


def build_optimizer(params: Iterable[torch.nn.Parameter], case: Case) -> torch.optim.Optimizer:
    cls, kwargs = get_optimizer(case.optimizer)
    # foreach=False keeps the per-parameter update order (and its temporaries) the same on every strategy
    return cls(params, lr=case.lr, foreach=False, **kwargs)  # type: ignore[call-arg]  # every OPTIMIZERS class takes both


def optimizer_state_bytes_per_param(name: str) -> int:
    """K for fp32 state, without a master copy (the ZeRO paper's K=12 adds a 4-byte fp32 master)."""
    optimizer_class_name(name)  # KeyError names the known ones
    return OPTIMIZERS[name][2]
