"""Tracing a CUDA target where CUDA kernels cannot run (a CPU-only torch build): during the trace only,
RMSNorm and SDPA are swapped for autograd Functions that save exactly what the CUDA kernels save
(memory_model/kernels.py, the rules the analytic model uses), and PyTorch's tracker rounds every storage
to CUDA's 512 bytes. Everything else (FSDP, the optimizer, the loss) runs its own code on fake CPU tensors.

The stand-ins compute nothing: on fake tensors only shapes, dtypes and lifetimes matter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from fsdpbench.engine.ac_policy import STANDIN_OPS
from fsdpbench.predictors.memory_model.allocator import cuda_storage_bytes
from fsdpbench.predictors.memory_model.kernels import AttentionKernel, kernels_for


class _FusedRmsNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm: saves its input itself and an fp32 (…, 1) rstd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        rstd = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
        ctx.save_for_backward(x, rstd, weight)
        out_dtype = torch.promote_types(x.dtype, weight.dtype) if weight is not None else x.dtype
        return x.new_empty(x.shape, dtype=out_dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, _, weight = ctx.saved_tensors
        return torch.empty_like(x), (torch.empty_like(weight) if weight is not None else None)


# CUDA's SDPA as one op, so that a selective checkpointing policy sees it as it sees the kernel's own op
# (engine/knobs.py: saved like cuDNN's or memory-efficient attention, both in torchtitan's save list)
def _attention_outputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    output_heads_last: bool,
    lse_trailing_one: bool,
    lse_seq_multiple: int,
    rng_state: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output in the kernel's layout, the fp32 logsumexp, and the RNG's seed and offset (int64
    scalars where the kernel keeps them on the GPU, else empty)."""
    b, h, s, _ = q.shape
    dv = v.shape[-1]
    out = q.new_empty((b, s, h, dv)).transpose(1, 2) if output_heads_last else q.new_empty((b, h, s, dv))
    padded = -(-s // lse_seq_multiple) * lse_seq_multiple
    lse = q.new_empty((b, h, padded, 1) if lse_trailing_one else (b, h, padded), dtype=torch.float32)
    rng_shape: tuple[int, ...] = () if rng_state else (0,)
    return out, lse, q.new_empty(rng_shape, dtype=torch.int64), q.new_empty(rng_shape, dtype=torch.int64)


_cuda_attention = torch.library.custom_op("fsdpbench::cuda_attention", _attention_outputs, mutates_args=())
_cuda_attention.register_fake(_attention_outputs)  # on fake tensors: the same shapes


def _attention_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    q, k, v = inputs[:3]
    out, lse, seed, offset = output
    rng = (seed, offset) if inputs[6] else ()
    ctx.save_for_backward(q, k, v, out, lse, *rng)


def _attention_backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[Any, ...]:
    q, k, v = ctx.saved_tensors[:3]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None, None, None


_cuda_attention.register_autograd(_attention_backward, setup_context=_attention_setup)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: AttentionKernel) -> torch.Tensor:
    """CUDA's SDPA (cuDNN or memory-efficient): saves q, k, v, the output in its layout, the logsumexp
    and, where the kernel keeps it on the GPU, the RNG's seed and offset."""
    out, _, _, _ = _cuda_attention(
        q, k, v, kernel.output_heads_last, kernel.lse_trailing_one, kernel.lse_seq_multiple, kernel.rng_state
    )
    return out


@contextlib.contextmanager
def cuda_kernel_standins() -> Iterator[list[str]]:
    """Swap F.rms_norm and F.scaled_dot_product_attention for CUDA stand-ins; yields the notes of calls
    no CUDA rule covers (those run the CPU kernel)."""
    rms_norm, sdpa = F.rms_norm, F.scaled_dot_product_attention
    uncovered: list[str] = []

    def rms_norm_standin(
        input: torch.Tensor,
        normalized_shape: Any,
        weight: torch.Tensor | None = None,
        eps: float | None = None,
    ) -> torch.Tensor:
        dims = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(dims) != 1:
            _note(uncovered, "RMSNorm over more than one dimension traced with the CPU kernel (no CUDA rule)")
            return rms_norm(input, normalized_shape, weight, eps)
        return _FusedRmsNorm.apply(input, weight)

    def sdpa_standin(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None or dropout_p > 0 or query.dim() != 4:
            _note(uncovered, "SDPA with a mask or dropout traced with the CPU kernel (no CUDA rule)")
            return sdpa(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        _, kernel = kernels_for("cuda", query.dtype != torch.float32)
        return _attention(query, key, value, kernel)

    F.rms_norm, F.scaled_dot_product_attention = rms_norm_standin, sdpa_standin
    standin = torch.ops.fsdpbench.cuda_attention.default
    # saved as the kernel it stands for (both CUDA kernels are in the op policy's save list)
    STANDIN_OPS[standin] = kernels_for("cuda", True)[1].op
    try:
        yield uncovered
    finally:
        F.rms_norm, F.scaled_dot_product_attention = rms_norm, sdpa
        STANDIN_OPS.pop(standin, None)


@contextlib.contextmanager
def cuda_storage_rounding() -> Iterator[None]:
    """PyTorch's trackers count a CUDA storage rounded up to 512 bytes: count the fake CPU ones so too."""
    from torch.distributed._tools import mem_tracker

    info = mem_tracker._WeakRefInfo
    original = info._calculate_mem_consumed

    def rounded(self: Any) -> int:
        return cuda_storage_bytes(self.size * self.element_size)

    info._calculate_mem_consumed = rounded  # type: ignore[method-assign]  # patched for the trace only
    try:
        yield
    finally:
        info._calculate_mem_consumed = original  # type: ignore[method-assign]


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)
