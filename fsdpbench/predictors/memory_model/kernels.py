"""What each kernel saves for backward, by target device and compute dtype: the one table that the
analytic activation model (activations.py) and the traced predictor's CUDA stand-ins
(fsdpbench/predictors/cuda_standins.py) both read.

Source: every tensor autograd saves in one decoder block, on an H100 (torch 2.11) and on the CPU
(``../shared/reference/gpu-h100/saved_tensors_per_block.jsonl``), and PyTorch's kernels:

- RMSNorm. On CUDA one fused kernel (``FusedRmsNormBackward0``) saves its input itself and an fp32
  ``(…, 1)`` rstd. On the CPU the norm is decomposed: rstd, the normalised fp32 result, and in 16-bit
  compute an fp32 copy of the input instead of the input.
- SDPA. CUDA picks cuDNN attention for 16-bit inputs on Hopper and memory-efficient attention for fp32;
  both save q, k, v, the output, an fp32 logsumexp and the dropout RNG's seed and offset (two int64
  scalars, saved even without dropout: cuDNN's on the GPU, 512 bytes each; memory-efficient
  attention's, without dropout, on the host, so the GPU tracker does not count them). cuDNN's
  logsumexp is ``(b, h, s, 1)`` and its output is laid out ``(b, h, s, d)``, so the ``(b, s, h·d)``
  reshape before ``wo`` is a copy; memory-efficient attention pads its logsumexp's sequence dimension to
  a multiple of 32 and lays its output out ``(b, s, h, d)``, so that reshape is a view. The CPU's flash
  attention saves a ``(b, h, s)`` logsumexp, lays its output out ``(b, h, s, d)`` and keeps no RNG state.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpbench.predictors.memory_model.allocator import cuda_storage_bytes


@dataclass(frozen=True, slots=True)
class NormKernel:
    name: str  # the grad_fn that saves its tensors
    fused: bool  # True: saves its input itself and an fp32 (…, 1) rstd; False: the CPU's decomposition


@dataclass(frozen=True, slots=True)
class AttentionKernel:
    name: str
    op: str  # the aten op that runs it (a selective checkpointing policy saves by op: engine/ac_policy.py)
    lse_trailing_one: bool  # logsumexp shaped (b, h, s, 1) rather than (b, h, s)
    lse_seq_multiple: int  # logsumexp's sequence dimension padded up to a multiple of this
    output_heads_last: bool  # output laid out (b, s, h, d): the (b, s, h·d) reshape for wo is a view
    rng_state: bool  # saves the RNG's seed and offset (two int64 scalars) on the device

    def lse_shape(self, batch: int, heads: int, seq: int) -> tuple[int, ...]:
        padded = -(-seq // self.lse_seq_multiple) * self.lse_seq_multiple
        return (batch, heads, padded, 1) if self.lse_trailing_one else (batch, heads, padded)


FUSED_RMS_NORM = NormKernel("FusedRmsNormBackward0", fused=True)
DECOMPOSED_RMS_NORM = NormKernel("RsqrtBackward0, MulBackward0", fused=False)
CUDNN_ATTENTION = AttentionKernel(
    "ScaledDotProductCudnnAttentionBackward0",
    "aten._scaled_dot_product_cudnn_attention",
    lse_trailing_one=True,
    lse_seq_multiple=1,
    output_heads_last=False,
    rng_state=True,
)
EFFICIENT_ATTENTION = AttentionKernel(
    "ScaledDotProductEfficientAttentionBackward0",
    "aten._scaled_dot_product_efficient_attention",
    lse_trailing_one=False,
    lse_seq_multiple=32,
    output_heads_last=True,
    rng_state=False,
)
CPU_FLASH_ATTENTION = AttentionKernel(
    "ScaledDotProductFlashAttentionForCpuBackward0",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    lse_trailing_one=False,
    lse_seq_multiple=1,
    output_heads_last=False,
    rng_state=False,
)

# (device, 16-bit compute?) → (norm, attention)
KERNELS: dict[tuple[str, bool], tuple[NormKernel, AttentionKernel]] = {
    ("cuda", True): (FUSED_RMS_NORM, CUDNN_ATTENTION),
    ("cuda", False): (FUSED_RMS_NORM, EFFICIENT_ATTENTION),
    ("cpu", True): (DECOMPOSED_RMS_NORM, CPU_FLASH_ATTENTION),
    ("cpu", False): (DECOMPOSED_RMS_NORM, CPU_FLASH_ATTENTION),
}

# the torch that ran the H100 measurements the CUDA rules come from and are checked against
# (../shared/reference/gpu-h100/README.md; tests/test_cuda_predictions.py): the kernels it picked are the
# ones assumed, whatever torch the predicting machine has
REFERENCE_TORCH = "2.11"
# the case a device's rules assume, where its kernel choice depends on versions, hardware or shapes (the
# CPU's kernels do not vary: nothing to state)
ASSUMED_CASE: dict[str, str] = {
    "cuda": (
        f"CUDA kernels as torch {REFERENCE_TORCH} picks them on an H100 (sm90), the torch of the H100 "
        "measurements these rules are checked against (a newer torch may pick others): fused RMSNorm "
        "(saves its input and an fp32 "
        "rstd); SDPA = cuDNN attention in bf16/fp16 (before Hopper FlashAttention-2 runs instead, whose "
        "output reshape is a view: one b·s·d 16-bit tensor less per block) and memory-efficient attention in "
        "fp32; causal, no dropout, n_kv_heads = n_heads (grouped-query attention not checked on a GPU)"
    ),
}


def kernels_for(device: str, sixteen_bit: bool) -> tuple[NormKernel, AttentionKernel]:
    """The norm and attention kernels a step on ``device`` runs (16-bit or fp32 matmul/attention inputs)."""
    return KERNELS[("cuda" if device == "cuda" else "cpu", sixteen_bit)]


def storage_bytes(nbytes: int, device: str) -> int:
    """What one tensor's storage occupies: CUDA rounds every allocation up to 512 bytes."""
    if device != "cuda":
        return nbytes
    return cuda_storage_bytes(nbytes)
