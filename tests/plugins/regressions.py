"""Deliberate regressions, as strategy plugins, for the tests of ``fsdpbench regress``.

Each class subclasses a registered strategy and changes one thing. A scenario loads them as
``regressions:ParamCopyZero3`` once ``tests/plugins`` is on ``sys.path`` (or ``PYTHONPATH``): the
rank processes come from the launcher's fork server, which hands every new child the launching
process's ``sys.path``, so inserting the folder in the process that runs ``fsdpbench run`` is enough.

What the memory tracker can see decides which copy is a visible regression:
``MemTracker`` / ``FSDPMemTracker`` count module parameters, buffers and gradients, optimizer
state, and tensors allocated while tracking. A copy registered as a buffer is counted; a copy
held in a plain Python attribute, made before the tracked step, is not (``HiddenParamCopyZero3``
shows that blind spot — on a GPU the CUDA allocator's peak would still see it).
"""

from __future__ import annotations

import json
import time

import torch
from torch import nn

from fsdpbench.strategies.base import ApplyContext
from fsdpbench.strategies.fsdp2 import Zero3

SLEEP_S = 0.25  # added to every step by SleepyZero3: far above the step-time noise of a 2-core machine
# ComputeZero3's extra matmuls, as a fraction of the step's counted FLOPs. Not 0.20: on decoder-tiny
# (d64) a step's time is mostly per-op overhead, not FLOPs, and 20% of the FLOPs as matmuls measured
# +9.5% of the step-time ratio (docs/ci.md); 0.45 aims at ~20% of the step's CPU time.
EXTRA_COMPUTE = 0.45


def _full_param_copies(model: nn.Module) -> list:
    """A full (unsharded) copy of every parameter, as a plain tensor — the classic "keep a copy" bug."""
    out = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 params are DTensors
        out.append(full.detach().clone())
    return out


class ParamCopyZero3(Zero3):
    """ZeRO-3 that keeps a full copy of the parameters on every rank, registered as buffers (visible)."""

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        model = super().apply(model, ctx)
        for i, copy in enumerate(_full_param_copies(model)):
            model.register_buffer(f"_param_copy_{i}", copy, persistent=False)
        return model


class HiddenParamCopyZero3(Zero3):
    """The same copy, held in a plain attribute: the tracker does not see it (a known blind spot)."""

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        model = super().apply(model, ctx)
        model._hidden_param_copy = _full_param_copies(model)  # type: ignore[assignment]
        return model


class SleepyZero3(Zero3):
    """ZeRO-3 with ``SLEEP_S`` of sleep before every forward: a step-time regression, memory unchanged."""

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        model = super().apply(model, ctx)
        model.register_forward_pre_hook(lambda module, args: time.sleep(SLEEP_S))
        return model


class ComputeZero3(Zero3):
    """ZeRO-3 that does ~20% more work per step: before every forward, a dependent chain of matmuls of
    the step's tokens by a hidden × hidden matrix worth ``EXTRA_COMPUTE`` of the step's counted FLOPs
    (``fsdpbench.metrics.flops.step_flops``). Real work on the rank's threads, not a sleep: the
    slowdown a load-independent (CPU-time) measurement must still see."""

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        from fsdpbench.metrics.flops import step_flops

        model = super().apply(model, ctx)
        case = ctx.case
        flops = step_flops(
            case.model, json.dumps(case.model_args, sort_keys=True), case.batch_size, case.seq_len
        )
        hidden = next(m.in_features for m in model.modules() if isinstance(m, nn.Linear))
        tokens = case.batch_size * case.seq_len
        reps = max(1, round(EXTRA_COMPUTE * flops / (2 * tokens * hidden * hidden)))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, hidden, generator=gen).to(ctx.device)
        w = torch.randn(hidden, hidden, generator=gen).div_(hidden**0.5).to(ctx.device)

        def extra_work(module: nn.Module, args: tuple) -> None:
            with torch.no_grad():
                y = x
                for _ in range(reps):
                    y = torch.tanh(y @ w)  # dependent chain: nothing can be skipped

        model.register_forward_pre_hook(extra_work)
        return model
