"""Live tensor bytes by category for FSDP1 (``FullyShardedDataParallel``) models.

PyTorch ships ``FSDPMemTracker`` for FSDP2 only; its plain ``MemTracker`` cannot follow FSDP1:
- with ``use_orig_params=True`` FSDP1 puts non-leaf views of the unsharded flat parameter into
  ``module._parameters`` during forward, and ``MemTracker`` fails registering grad hooks on them;
- with ``use_orig_params=False`` it runs, but files the unsharded flat parameter under "params" and
  the sharded gradient (made inside FSDP1's post-backward hook) under "temp", so the resting
  model-state bytes lose their gradients.

``FSDP1MemTracker`` keeps ``MemTracker``'s accounting (every storage created under it, resizes
included) and files FSDP1's own storages by what they are, using FSDP2's category names:
sharded flat parameter → Sharded Param; padded unsharded flat parameter (all-gather output) →
Unsharded Param; low-precision shard copied for the all-gather (mixed precision) → All Gather;
the gradient autograd computed → Unsharded Grad; padding copy and output of the reduce-scatter
while it runs → Reduce Scatter; the reduced gradient it keeps → Sharded Grad (NO_SHARD: the
all-reduced full gradient). CPU offload's host-side gradient copy is a Sharded Grad on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _RefType
from torch.distributed.fsdp import FullyShardedDataParallel, _runtime_utils
from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles


class _FSDP1RefType(_RefType):
    """``MemTracker``'s categories (its base code files by them; equal name and value, so they match)
    plus FSDP2's names for the sharded/unsharded states and the collective buffers."""

    PARAM = "Parameter"
    BUFFER = "Buffer"
    GRAD = "Gradient"
    ACT = "Activation"
    TEMP = "Temp"
    OPT = "Optstate"
    OTH = "Other"
    SHARDED_PARAM = "Sharded Param"
    UNSHARDED_PARAM = "Unsharded Param"
    SHARDED_GRAD = "Sharded Grad"
    UNSHARDED_GRAD = "Unsharded Grad"
    ALL_GATHER = "All Gather"
    REDUCE_SCATTER = "Reduce Scatter"


def is_fsdp1(model: nn.Module) -> bool:
    return isinstance(model, FullyShardedDataParallel)


class FSDP1MemTracker(MemTracker):
    """``MemTracker`` that knows FSDP1's flat-parameter storages (see the module docstring)."""

    def __init__(self, root: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        if not is_fsdp1(root):
            raise TypeError(
                f"FSDP1MemTracker needs a FullyShardedDataParallel root, not {type(root).__name__}"
            )
        super().__init__()
        self._ref_class = _FSDP1RefType
        self._root = root
        self._optimizer = optimizer
        self._handles = _get_fsdp_handles(root)
        self._in_reduce = False
        self._saved: dict[str, Callable[..., Any]] = {}

    # -- categorising FSDP1's storages ---------------------------------------------------------
    def _file(self, t: torch.Tensor | None, reftype: _FSDP1RefType) -> None:
        if isinstance(t, torch.Tensor):
            self._update_and_maybe_create_winfos(t, reftype)

    def _file_handle_states(self) -> None:
        for handle in self._handles:
            fp = handle.flat_param
            if handle.uses_sharded_strategy:
                self._file(getattr(fp, "_local_shard", None), _FSDP1RefType.SHARDED_PARAM)
                self._file(getattr(fp, "_full_param_padded", None), _FSDP1RefType.UNSHARDED_PARAM)
                self._file(getattr(fp, "_full_prec_full_param_padded", None), _FSDP1RefType.UNSHARDED_PARAM)
                self._file(getattr(fp, "_mp_shard", None), _FSDP1RefType.ALL_GATHER)
            else:  # NO_SHARD: the flat parameter is the whole parameter; _mp_shard its low-precision copy
                self._file(getattr(fp, "_local_shard", fp), _FSDP1RefType.SHARDED_PARAM)
                self._file(getattr(fp, "_mp_shard", None), _FSDP1RefType.UNSHARDED_PARAM)
            self._file_grads(handle)
        for buf in self._root.buffers():
            self._file(buf, _FSDP1RefType.BUFFER)
        if self._optimizer is not None:
            inner = getattr(self._optimizer, "optim", self._optimizer)
            self._track_optimizer_states(_FSDP1RefType.OPT, inner)

    def _file_grads(self, handle: Any) -> None:
        fp = handle.flat_param
        self._file(getattr(fp, "_cpu_grad", None), _FSDP1RefType.SHARDED_GRAD)
        self._file(getattr(fp, "_saved_grad_shard", None), _FSDP1RefType.SHARDED_GRAD)
        self._file(fp.grad, _FSDP1RefType.SHARDED_GRAD)

    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        # FSDP1 swaps parameter variables (sharded views, unsharded non-leaf views) in and out of
        # module._parameters; they are all views into the flat-parameter storages filed above.
        return 0, 0

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        super()._track(_FSDP1RefType.REDUCE_SCATTER if self._in_reduce else reftype, t)

    # -- FSDP1's gradient reduction, wrapped while tracking --------------------------------------
    def _wrap_reduce(self, orig: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        def reduce_grad(state: Any, handle: Any) -> None:
            self._file(handle.flat_param.grad, _FSDP1RefType.UNSHARDED_GRAD)
            self._in_reduce = True
            try:
                orig(state, handle)
            finally:
                self._in_reduce = False
            self._file_grads(handle)

        return reduce_grad

    def __enter__(self) -> FSDP1MemTracker:
        if self._depth == 0:
            for name in ("_reduce_grad", "_reduce_grad_no_shard"):
                self._saved[name] = getattr(_runtime_utils, name)
                setattr(_runtime_utils, name, self._wrap_reduce(self._saved[name]))
            self._file_handle_states()
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        if self._depth == 0:
            for name, fn in self._saved.items():
                setattr(_runtime_utils, name, fn)
            self._saved.clear()
