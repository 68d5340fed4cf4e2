"""Live tensor bytes by category for DeepSpeed ZeRO engines (``ds_zero1/2/3``).

DeepSpeed keeps its model states in flat buffers that neither the model's ``parameters()`` nor the
torch optimizer's ``state`` show whole, and they exist before a tracked step starts, so a plain
``MemTracker`` would miss them or file them as "temp". ``DeepSpeedMemTracker`` keeps
``MemTracker``'s accounting (every storage created under it) and files DeepSpeed's storages:

| DeepSpeed storage | category |
| --- | --- |
| stage 1/2 ``bit16_groups_flat`` (the whole model, each parameter a view; fp32 runs: fp32) | params |
| stage 3 ``fp16_partitioned_groups_flat`` (this rank's parameter partition) | params |
| stage 3 persistent parameters (below ``stage3_param_persistence_threshold``, kept whole) | params |
| ``single_partition_of_fp32_groups`` / ``fp32_partitioned_groups_flat`` (fp32 master partition) | optim |
| the torch optimizer's ``state`` (exp_avg, exp_avg_sq of the master partition) | optim |
| stage 1/2 fp32 gradient partition (``.grad`` of the master, ``averaged_gradients``) | grads |
| stage 3 fp32 gradient partition (``grad_partitions_flat_buffer``) | grads |
| reduce buckets (``ipg_buckets[*].buffer``: ``reduce_bucket_size`` elements each) | reduce_scatter |
| stage 3 parameters all-gathered during forward/backward | whatever MemTracker sees them as (temp) |

The fp32 master partition is "optim" because it is the 4 bytes of the ZeRO paper's K=12 (the
optimizer's own fp32 copy); in fp32 runs it duplicates the parameter partition (docs/deepspeed.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from fsdpbench.metrics.fsdp1_tracker import _FSDP1RefType


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a tensor, list, tuple or dict of them (nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def deepspeed_storages(zero: Any) -> dict[str, list[torch.Tensor]]:
    """DeepSpeed's resident model-state tensors by our category (see the module docstring)."""
    masters = _tensors(getattr(zero, "single_partition_of_fp32_groups", None)) + _tensors(
        getattr(zero, "fp32_partitioned_groups_flat", None)
    )
    params = _tensors(getattr(zero, "bit16_groups_flat", None)) + _tensors(
        getattr(zero, "fp16_partitioned_groups_flat", None)
    )
    params += [p.data for p in getattr(zero, "persistent_parameters", []) or []]
    grads = [m.grad for m in masters if m.grad is not None]
    grads += _tensors(getattr(zero, "averaged_gradients", None))
    grads += _tensors(getattr(zero, "grad_partitions_flat_buffer", None))
    buckets = [t for b in (getattr(zero, "ipg_buckets", None) or {}).values() for t in _tensors(b.buffer)]
    return {"params": params, "optim": masters, "grads": grads, "reduce_scatter": buckets}


_REFTYPES = {
    "params": _MemRefType.PARAM,
    "optim": _MemRefType.OPT,
    "grads": _MemRefType.GRAD,
    "reduce_scatter": _FSDP1RefType.REDUCE_SCATTER,
}


class DeepSpeedMemTracker(MemTracker):
    """``MemTracker`` that knows DeepSpeed ZeRO's flat storages (see the module docstring)."""

    def __init__(self, engine: Any, optimizer: Any) -> None:
        super().__init__()
        self._ref_class = _FSDP1RefType  # MemTracker's categories plus "Reduce Scatter"
        self._engine = engine
        self._zero = engine.optimizer
        self._optimizer = optimizer
        self._optim = getattr(optimizer, "optim", optimizer)
        self._saved: Callable[..., Any] | None = None

    def _file_states(self) -> None:
        for category, tensors in deepspeed_storages(self._zero).items():
            for t in tensors:
                if t.numel():
                    self._update_and_maybe_create_winfos(t, _REFTYPES[category])
        for buf in self._engine.module.buffers():
            self._update_and_maybe_create_winfos(buf, _MemRefType.BUFFER)
        self._track_optimizer_states(_MemRefType.OPT, self._optim)

    def _track_module_params_and_buffers(
        self, module: Any, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        # the parameters are views into the flat buffers filed above (stage 3: empty placeholders)
        return 0, 0

    def __enter__(self) -> DeepSpeedMemTracker:
        if self._depth == 0:
            self._file_states()
            if hasattr(self._zero, "setup_buckets"):  # stage 1/2 allocate the buckets in each backward
                saved = self._saved = self._zero.setup_buckets

                def setup_buckets(*args: Any, **kwargs: Any) -> Any:
                    out = saved(*args, **kwargs)
                    self._file_states()
                    return out

                self._zero.setup_buckets = setup_buckets
            if hasattr(self._optimizer, "after_step"):
                self._optimizer.after_step = self._file_states
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        if self._depth == 0 and hasattr(self._optimizer, "after_step"):
            self._optimizer.after_step = None
        if self._depth == 0 and self._saved is not None:
            del self._zero.setup_buckets  # the instance attribute; the class's method shows again
            self._saved = None
