"""FLOPs of one training step (counted, not estimated) and model FLOPs utilisation on GPUs.

The count runs the model's forward and backward once on the meta device under PyTorch's
``FlopCounterMode``: exact matmul/conv/attention FLOPs of *this* implementation, no memory used.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from fsdpbench.core.precision import Precision

# dense peak TFLOP/s per GPU by compute dtype (``Precision.param_dtype``; vendor datasheets; SXM unless
# named). float32 is the non-tensor-core rate, what fp32 matmuls get with PyTorch's default precision.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "H100 PCIe": {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0},
    "H100 NVL": {"bfloat16": 835.0, "float16": 835.0, "float32": 60.0},
    "H100": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
    "L40S": {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6},
    "A10G": {"bfloat16": 125.0, "float16": 125.0, "float32": 31.2},
}


def peak_tflops(device_name: str, precision: Precision) -> float | None:
    """The datasheet peak for this GPU and compute dtype, or None (CPU, unknown GPU)."""
    for key, table in PEAK_TFLOPS.items():  # most specific names first
        if key in device_name:
            return table.get(precision.param_dtype)
    return None


@lru_cache(maxsize=64)
def step_flops(model: str, model_args_json: str, batch_size: int, seq_len: int) -> int:
    """FLOPs of forward + backward of one rank's batch (the optimizer step is not counted)."""
    import json

    from torch.utils.flop_counter import FlopCounterMode

    from fsdpbench.models import build_model, make_global_batch, resolve_model

    args = json.loads(model_args_json)
    mdef, _ = resolve_model(model, args)
    net = build_model(model, args, device="meta")
    x, y = make_global_batch(model, args, batch_size, seq_len, seed=0, step=0)
    counter = FlopCounterMode(display=False)
    with counter:
        loss = mdef.loss(net(x.to("meta")), y.to("meta"))
        loss.backward()
    return int(counter.get_total_flops())


def mfu(flops_per_step: float, step_time_ms: float, device_name: str, precision: Precision) -> float | None:
    """Model FLOPs utilisation of one rank: achieved / peak; None where the peak is unknown (CPU)."""
    peak = peak_tflops(device_name, precision)
    if not peak or not step_time_ms:
        return None
    return flops_per_step / (step_time_ms / 1e3) / (peak * 1e12)


def achieved_tflops(flops_per_step: float, step_time_ms: float) -> float | None:
    return flops_per_step / (step_time_ms / 1e3) / 1e12 if step_time_ms else None


__all__ = ["PEAK_TFLOPS", "achieved_tflops", "mfu", "peak_tflops", "step_flops", "torch"]
