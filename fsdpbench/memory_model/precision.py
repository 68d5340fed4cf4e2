"""Precision names → bytes per element of every copy a strategy keeps, and K (optimizer bytes/param).

``mixed`` is the ZeRO paper's accounting (16-bit params and grads; the optimizer keeps an fp32
master copy and fp32 Adam moments: b_p = b_g = 2, K = 12). It is an accounting, not a runnable case.
``bf16``/``fp16`` follow what FSDP2's ``MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)``
really keeps: fp32 sharded params and grads (b_p = b_g = 4), 16-bit unsharded params and grads in
flight, fp32 reduce-scatter input; ``-lowreduce`` reduces in 16 bits. DDP and ZeRO-1 have no
parameter casting: the worker autocasts, so their resident states are fp32 too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdpbench.strategies.optim import get_optimizer, optimizer_state_bytes_per_param


@dataclass(frozen=True, slots=True)
class Precision:
    """Bytes per element of each copy, for one precision name."""

    name: str
    param_bytes: int  # b_p: the resident (sharded or replicated) parameter copy
    grad_bytes: int  # b_g: the resident gradient
    unsharded_bytes: int  # FSDP unsharded parameters and their gradients (param_dtype)
    reduce_bytes: int  # reduce-scatter / all-reduce buffers (reduce_dtype)
    compute_bytes: int  # activations of the matmul path (2 for 16-bit compute)
    master_in_optimizer: bool = False  # the optimizer keeps a separate fp32 master copy (+4 bytes/param)
    runnable: bool = True  # a Case can use it (``mixed`` is an accounting only)
    description: str = ""


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(
        name="fp32",
        param_bytes=4,
        grad_bytes=4,
        unsharded_bytes=4,
        reduce_bytes=4,
        compute_bytes=4,
        description="plain fp32: every copy 4 bytes",
    ),
    "bf16": Precision(
        name="bf16",
        param_bytes=4,
        grad_bytes=4,
        unsharded_bytes=2,
        reduce_bytes=4,
        compute_bytes=2,
        description="FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 shards, "
        "bf16 unsharded params/grads in flight; DDP/ZeRO-1: fp32 states, bf16 autocast",
    ),
    "fp16": Precision(
        name="fp16",
        param_bytes=4,
        grad_bytes=4,
        unsharded_bytes=2,
        reduce_bytes=4,
        compute_bytes=2,
        description="as bf16 with float16",
    ),
    "bf16-lowreduce": Precision(
        name="bf16-lowreduce",
        param_bytes=4,
        grad_bytes=4,
        unsharded_bytes=2,
        reduce_bytes=2,
        compute_bytes=2,
        description="as bf16, gradients reduced in bf16",
    ),
    "fp16-lowreduce": Precision(
        name="fp16-lowreduce",
        param_bytes=4,
        grad_bytes=4,
        unsharded_bytes=2,
        reduce_bytes=2,
        compute_bytes=2,
        description="as fp16, gradients reduced in fp16",
    ),
    "mixed": Precision(
        name="mixed",
        param_bytes=2,
        grad_bytes=2,
        unsharded_bytes=2,
        reduce_bytes=2,
        compute_bytes=2,
        master_in_optimizer=True,
        runnable=False,
        description="ZeRO paper accounting: 16-bit params and grads (b_p=b_g=2), fp32 master + Adam "
        "moments in the optimizer (K=12); analytic only",
    ),
}

# optimizers whose per-parameter state includes a ``step`` tensor (fp32 scalar, on the CPU unless
# capturable/fused), and how many parameter-sized temporaries their per-parameter update allocates at once
# (torch/optim/adam.py ``_single_tensor_adam``: ``(exp_avg_sq.sqrt() / bc2).add_(eps)`` holds two)
_STEP_TENSOR = {torch.optim.Adam: True, torch.optim.AdamW: True, torch.optim.Adadelta: True}
_UPDATE_TEMPORARIES = {torch.optim.Adam: 2, torch.optim.AdamW: 2, torch.optim.Adadelta: 2}
STEP_TENSOR_BYTES = 4


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise KeyError(f"unknown precision {name!r}; known: {', '.join(PRECISIONS)}") from None


def optimizer_k(optimizer: str, precision: Precision) -> int:
    """K: optimizer-state bytes per parameter (fp32 state; +4 for a master copy under ``mixed``)."""
    k = optimizer_state_bytes_per_param(optimizer)
    return k + 4 if precision.master_in_optimizer else k


def optimizer_has_step(optimizer: str) -> bool:
    return _STEP_TENSOR.get(get_optimizer(optimizer)[0], False)


def optimizer_update_temporaries(optimizer: str) -> int:
    return _UPDATE_TEMPORARIES.get(get_optimizer(optimizer)[0], 0)
