"""Precision names, parsed once into typed ``Precision`` records (torch-free: a ``Case`` carries one).

Each record says the bytes per element of every copy a strategy keeps (what the memory model reads)
and the torch dtypes of compute and gradient reduction (what the worker and strategies cast to).

``mixed`` is the ZeRO paper's accounting (16-bit params and grads; the optimizer keeps an fp32
master copy and fp32 Adam moments: b_p = b_g = 2, K = 12). It is an accounting, not a runnable case.
``bf16``/``fp16`` follow what FSDP2's ``MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)``
really keeps: fp32 sharded params and grads (b_p = b_g = 4), 16-bit unsharded params and grads in
flight, fp32 reduce-scatter input; ``-lowreduce`` reduces in 16 bits. DDP and ZeRO-1 have no
parameter casting: the worker autocasts, so their resident states are fp32 too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Precision:
    """Bytes per element of each copy, and the dtypes compute and gradient reduction run in."""

    name: str
    # bytes per element, 4 (fp32) unless the precision says otherwise
    param_bytes: int = 4  # b_p: the resident (sharded or replicated) parameter copy
    grad_bytes: int = 4  # b_g: the resident gradient
    unsharded_bytes: int = 4  # FSDP unsharded parameters and their gradients (param_dtype)
    reduce_bytes: int = 4  # reduce-scatter / all-reduce buffers (reduce_dtype)
    compute_bytes: int = 4  # activations of the matmul path (2 for 16-bit compute)
    master_in_optimizer: bool = False  # the optimizer keeps a separate fp32 master copy (+4 bytes/param)
    runnable: bool = True  # a Case can use it (``mixed`` is an accounting only)
    description: str = ""
    # torch dtype names: the unsharded parameters / autocast (FSDP's param_dtype) and gradient reduction
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"

    @property
    def casts(self) -> bool:
        """Compute runs in 16 bits: the strategy casts parameters (FSDP) or the step autocasts (DDP)."""
        return self.param_dtype != "float32"

    @property
    def reduces_low(self) -> bool:
        """Gradients are reduced in 16 bits (``-lowreduce``)."""
        return self.reduce_dtype != "float32"

    def torch_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(param_dtype, reduce_dtype) as torch dtypes."""
        import torch

        return getattr(torch, self.param_dtype), getattr(torch, self.reduce_dtype)


def _fsdp_mixed(name: str, dtype: str, *, low_reduce: bool, description: str) -> Precision:
    """What ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=fp32 or dtype)`` keeps: fp32 shards
    and resident gradients, 16-bit unsharded copies and compute; reduction in fp32 or in ``dtype``."""
    return Precision(
        name=name,
        unsharded_bytes=2,
        reduce_bytes=2 if low_reduce else 4,
        compute_bytes=2,
        description=description,
        param_dtype=dtype,
        reduce_dtype=dtype if low_reduce else "float32",
    )


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision(name="fp32", description="plain fp32: every copy 4 bytes"),
        _fsdp_mixed(
            "bf16",
            "bfloat16",
            low_reduce=False,
            description="FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 shards, "
            "bf16 unsharded params/grads in flight; DDP/ZeRO-1: fp32 states, bf16 autocast",
        ),
        _fsdp_mixed("fp16", "float16", low_reduce=False, description="as bf16 with float16"),
        _fsdp_mixed(
            "bf16-lowreduce", "bfloat16", low_reduce=True, description="as bf16, gradients reduced in bf16"
        ),
        _fsdp_mixed(
            "fp16-lowreduce", "float16", low_reduce=True, description="as fp16, gradients reduced in fp16"
        ),
        Precision(
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
            param_dtype="float16",
            reduce_dtype="float16",
        ),
    )
}


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise KeyError(f"unknown precision {name!r}; known: {', '.join(PRECISIONS)}") from None


def runnable_precisions() -> tuple[str, ...]:
    """The precision names a Case can run (``mixed`` is an accounting only)."""
    return tuple(name for name, p in PRECISIONS.items() if p.runnable)
