"""K (optimizer bytes per parameter) and the optimizer's step-time temporaries, for a ``Precision``.

Torch-free (optimizers are keyed by their class name), as is the precision table itself, in
``fsdpbench.core.precision`` (a ``Case`` carries its parsed record); the memory model's modules import it
from here, beside what depends on the optimizer.
"""

from __future__ import annotations

from fsdpbench.core.precision import PRECISIONS, Precision, get_precision
from fsdpbench.strategies.optim import optimizer_class_name, optimizer_state_bytes_per_param

# optimizers (by their torch.optim class) whose per-parameter state includes a ``step`` tensor (fp32
# scalar, on the CPU unless capturable/fused), and how many parameter-sized temporaries their
# per-parameter update allocates at once (torch/optim/adam.py ``_single_tensor_adam``:
# ``(exp_avg_sq.sqrt() / bc2).add_(eps)`` holds two)
_STEP_TENSOR = {"Adam": True, "AdamW": True, "Adadelta": True}
_UPDATE_TEMPORARIES = {"Adam": 2, "AdamW": 2, "Adadelta": 2}
STEP_TENSOR_BYTES = 4


def optimizer_k(optimizer: str, precision: Precision) -> int:
    """K: optimizer-state bytes per parameter (fp32 state; +4 for a master copy under ``mixed``)."""
    k = optimizer_state_bytes_per_param(optimizer)
    return k + 4 if precision.master_in_optimizer else k


def optimizer_has_step(optimizer: str) -> bool:
    return _STEP_TENSOR.get(optimizer_class_name(optimizer), False)


def optimizer_update_temporaries(optimizer: str) -> int:
    return _UPDATE_TEMPORARIES.get(optimizer_class_name(optimizer), 0)


__all__ = [
    "PRECISIONS",
    "STEP_TENSOR_BYTES",
    "Precision",
    "get_precision",
    "optimizer_has_step",
    "optimizer_k",
    "optimizer_update_temporaries",
]
