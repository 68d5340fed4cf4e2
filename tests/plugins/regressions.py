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

import statistics
import time

import torch
from torch import nn

from fsdpbench.metrics.cpu_clock import WorkClock
from fsdpbench.strategies.base import ApplyContext
from fsdpbench.strategies.fsdp2 import Zero3

SLEEP_S = 0.25  # added to every step by SleepyZero3: far above the step-time noise of a 2-core machine
# ComputeZero3's extra work per step, as a share of the work CPU time of one unmodified step on the rank
EXTRA_SHARE = 0.20
_CALIBRATION_REPS = 20  # matmul links timed once, to size the chain
_SIZING_STEPS = 4  # unmodified steps timed to size the chain (their median): forwards 2 to 6


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

    The chain's length is set once, at the sixth forward: ``share`` of the median work CPU time the
    rank spent on one whole unmodified step (forward, backward, communication, optimizer), over the
    ``_SIZING_STEPS`` steps from the second forward to the sixth, divided by the CPU time of one link
    measured then. Not from the first forward: the first step also pays FSDP's lazy initialisation
    (several times a step); a median of four, because one step's CPU time on a shared machine moves
    by a tenth. Sized by time, not by FLOPs: a small model's CPU step is mostly per-op overhead, so a
    share of its counted FLOPs is a much smaller share of its time. Work CPU time
    (``fsdpbench.metrics.cpu_clock.WorkClock``: all threads of the rank but gloo's spinning loop
    threads) because that is what the gate compares on CPU ranks: the share is of the step's work.
    The scenario needs at least 4 timed steps after 2 warm-up steps, so that the sizing steps are
    neither tracked nor profiled.
    """

    def __init__(self, tokens: int, hidden: int, device: torch.device, share: float) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(tokens, hidden, generator=gen).to(device)
        self.w = torch.randn(hidden, hidden, generator=gen).div_(hidden**0.5).to(device)
        self.share = share
        self.clock: WorkClock | None = None  # made at the first forward: the process groups exist then
        self.forward_cpu_s: list[float] = []  # work-CPU stamps of the forwards before sizing
        self.links: int | None = None  # None until sized

    def chain(self, links: int) -> None:
        with torch.no_grad():
            y = self.x
            for _ in range(links):
                y = torch.tanh(y @ self.w)  # dependent: nothing can be skipped

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if self.links is None:
            self.clock = self.clock or WorkClock()
            self.forward_cpu_s.append(self.clock())
            if len(self.forward_cpu_s) < 2 + _SIZING_STEPS:
                return
            stamps = self.forward_cpu_s[1:]
            step_cpu_s = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
            self.chain(_CALIBRATION_REPS)  # first calls of a shape pay for allocation: not timed
            start = self.clock()
            self.chain(_CALIBRATION_REPS)
            link_cpu_s = (self.clock() - start) / _CALIBRATION_REPS
            self.links = max(1, round(self.share * step_cpu_s / link_cpu_s))
        self.chain(self.links)


class ComputeZero3(Zero3):
    """ZeRO-3 that computes ~20% more per step (``EXTRA_SHARE`` of an unmodified step's work CPU time):
    before every forward from the sixth on, a chain of the step's tokens × hidden by a hidden ×
    hidden matrix (``_ExtraCompute``). Real work on the rank's threads, not a sleep: the slowdown a
    load-independent (CPU-time) measurement must still see. Meant for CPU ranks (it times on the CPU)."""

    extra_share = EXTRA_SHARE

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        model = super().apply(model, ctx)
        hidden = next(m.in_features for m in model.modules() if isinstance(m, nn.Linear))
        tokens = ctx.case.batch_size * ctx.case.seq_len
        model.register_forward_pre_hook(_ExtraCompute(tokens, hidden, ctx.device, self.extra_share))
        return model


class Compute10Zero3(ComputeZero3):
    """ComputeZero3 with half the extra work: ~10% of an unmodified step's work CPU time."""

    extra_share = EXTRA_SHARE / 2
