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


# optimizers whose grouped (foreach) and fused updates fsdpbench runs and models (memory_model/precision.py)
GROUPED_UPDATE_OPTIMIZERS = ("adam", "adamw")


def implementation_kwargs(impl: str) -> dict[str, bool]:
    """The constructor arguments that pick the update's implementation (``Case.optimizer_impl``): named
    always, so torch's device-dependent default never decides it."""
    return (
        {"foreach": impl == "foreach", "fused": impl == "fused"} if impl != "for-loop" else {"foreach": False}
    )


def build_optimizer(params: Iterable[torch.nn.Parameter], case: Case) -> torch.optim.Optimizer:
    cls, kwargs = get_optimizer(case.optimizer)
    kwargs.update(implementation_kwargs(case.optimizer_impl))
    return cls(params, lr=case.lr, **kwargs)  # type: ignore[call-arg]  # every OPTIMIZERS class takes them


def check_optimizer_impl(case: Case) -> str | None:
    """Why the case's optimizer cannot run its ``optimizer_impl`` (a sentence), or None."""
    if case.optimizer_impl != "for-loop" and case.optimizer not in GROUPED_UPDATE_OPTIMIZERS:
        return (
            f"optimizer_impl={case.optimizer_impl} is run and modelled for "
            f"{', '.join(GROUPED_UPDATE_OPTIMIZERS)}; {case.optimizer} runs for-loop"
        )
    return None


def optimizer_state_bytes_per_param(name: str) -> int:
    """K for fp32 state, without a master copy (the ZeRO paper's K=12 adds a 4-byte fp32 master)."""
    optimizer_class_name(name)  # KeyError names the known ones
    return OPTIMIZERS[name][2]
