"""torchtitan's selective op-level activation checkpointing policy, as data: the ops whose outputs a
checkpointed block saves (the rest is recomputed in backward), named as ``torch.ops`` names them.

Torch-free, so the analytic activation model reads the same list the run applies
(``engine/knobs.py`` resolves the names to ops; a name this torch lacks is skipped, as torchtitan does).

Source: torchtitan ``torchtitan/distributed/activation_checkpoint.py`` (``_get_default_save_ops``,
``SelectiveAC``): the compute-intensive ops of ``torch._functorch.partitioners.get_default_op_list()``
(mm, addmm, bmm, the CUDA SDPA kernels, ...) plus its own list (cuDNN and math SDPA, ``max``, linear,
topk, reduce-scatter, all-to-all); every second matmul (``mm`` or ``linear``, counted in forward order
within a block, and again within its recompute) is recomputed rather than saved.
"""

from __future__ import annotations

# partitioners' compute-intensive ops (torch 2.13) and torchtitan's additions, overload ``default``
SAVED_OPS = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.convolution",
    "aten.convolution_backward",
    "aten._scaled_mm",
    "aten.upsample_bilinear2d",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_attention_math",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "aten.max",
    "aten.linear",
    "aten.topk",
    "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_to_all_single",
)
# ops that stand in for another while a step is traced (predictors/cuda_standins.py: CUDA's attention on
# a CPU-only build), by the name of the op they stand for; the policy treats them as that op
STANDIN_OPS: dict[object, str] = {}
# the matmuls of which every second one (2nd, 4th, ...) is recomputed
ALTERNATING_OPS = ("aten.mm", "aten.linear")


def saves_output(op: str, matmul_index: int) -> bool:
    """Whether the policy saves the output of ``op`` (a ``SAVED_OPS``-style name); ``matmul_index``: the
    1-based count of matmuls in the block so far, this one included (ignored for other ops)."""
    if op not in SAVED_OPS:
        return False
    return op not in ALTERNATING_OPS or matmul_index % 2 == 1
