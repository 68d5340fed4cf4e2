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

import time

import torch
from torch import nn

from fsdpbench.strategies.base import ApplyContext
from fsdpbench.strategies.fsdp2 import Zero3

SLEEP_S = 0.25  # added to every step by SleepyZero3: far above the step-time noise of a 2-core machine
# ComputeZero3's extra work per step, as a share of the CPU time of one unmodified step on the rank
EXTRA_SHARE = 0.20
_CALIBRATION_REPS = 20  # matmul links timed once, to size the chain


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


class _ExtraCompute:
    """A forward pre-hook that runs a dependent chain of matmuls, sized on the rank from its own timing.

    The chain's length is set once, at the third forward: ``EXTRA_SHARE`` of the CPU time the rank
    spent from the second forward to the third (one whole unmodified step: forward, backward,
    communication, optimizer), divided by the CPU time of one link measured then. Not from the
    first forward: the first step also pays FSDP's lazy initialisation (several times a step). Sized
    by time, not by FLOPs: a small model's CPU step is mostly per-op overhead, so a share of its
    counted FLOPs is a much smaller share of its time. CPU time (``time.process_time``, all threads
    of the rank) because that is what the gate compares on CPU ranks, and it is what other
    processes on the machine disturb least.
    """

    def __init__(self, tokens: int, hidden: int, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(tokens, hidden, generator=gen).to(device)
        self.w = torch.randn(hidden, hidden, generator=gen).div_(hidden**0.5).to(device)
        self.forward_cpu_s: list[float] = []  # CPU-time stamps of the forwards before sizing
        self.links: int | None = None  # None until sized

    def chain(self, links: int) -> None:
        with torch.no_grad():
            y = self.x
            for _ in range(links):
                y = torch.tanh(y @ self.w)  # dependent: nothing can be skipped

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if self.links is None:
            self.forward_cpu_s.append(time.process_time())
            if len(self.forward_cpu_s) < 3:
                return
            step_cpu_s = self.forward_cpu_s[2] - self.forward_cpu_s[1]
            self.chain(_CALIBRATION_REPS)  # first calls of a shape pay for allocation: not timed
            start = time.process_time()
            self.chain(_CALIBRATION_REPS)
            link_cpu_s = (time.process_time() - start) / _CALIBRATION_REPS
            self.links = max(1, round(EXTRA_SHARE * step_cpu_s / link_cpu_s))
        self.chain(self.links)


class ComputeZero3(Zero3):
    """ZeRO-3 that computes ~20% more per step (``EXTRA_SHARE`` of an unmodified step's CPU time):
    before every forward from the third on, a chain of the step's tokens × hidden by a hidden ×
    hidden matrix (``_ExtraCompute``). Real work on the rank's threads, not a sleep: the slowdown a
    load-independent (CPU-time) measurement must still see. Meant for CPU ranks (it times on the CPU)."""

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        model = super().apply(model, ctx)
        hidden = next(m.in_features for m in model.modules() if isinstance(m, nn.Linear))
        tokens = ctx.case.batch_size * ctx.case.seq_len
        model.register_forward_pre_hook(_ExtraCompute(tokens, hidden, ctx.device))
        return model
