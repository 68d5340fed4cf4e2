"""Host tuning of a CPU rank, at the moments the worker offers (``engine.worker.RankHooks``): its compute
threads pinned, gloo's loop threads idled and bound, and the turns a case's ranks take with its compute
twin's (``baton``). The worker calls these moments and knows nothing of what they do."""

from __future__ import annotations

import os

import torch

from fsdpbench.engine.worker import RankHooks
from fsdpbench.hosttuning.baton import TWIN, Baton
from fsdpbench.hosttuning.threads import (
    GLOO_LOOP_IDLE_ENV,
    PIN_ENV,
    bind_to_rank_cores,
    idle_gloo_loops,
    idle_spin_s,
    pin_compute_threads,
    rank_cores,
)


class HostHooks(RankHooks):
    """What the launcher asked of this rank: pinning (``PIN_ENV``), idle gloo loops (``GLOO_LOOP_IDLE_ENV``),
    turns with a compute twin (``baton``)."""

    def __init__(self, baton: Baton | None, pin: bool, idle_loops: bool) -> None:
        self.baton, self.pin, self.idle_loops = baton, pin, idle_loops

    @classmethod
    def from_env(cls, rank: int) -> HostHooks:
        return cls(
            Baton.from_env(rank), os.environ.get(PIN_ENV) == "1", os.environ.get(GLOO_LOOP_IDLE_ENV) == "1"
        )

    def before_setup(self) -> None:
        if self.baton is not None and self.baton.role == TWIN:
            self.baton.wait_to_start()  # the case's set-up and warm-up are timed as without a twin

    def after_process_group(self, device: torch.device, local_rank: int, local_world: int) -> list[int]:
        if device.type != "cpu" or not self.pin:  # after the group: gloo's threads float
            return []
        cores = rank_cores(local_rank, local_world)
        return cores if pin_compute_threads(cores) else []

    def after_build(self, device: torch.device, cores: list[int]) -> tuple[int, int]:
        # after the build: every group the strategy made has its gloo loop thread by now
        idled = idle_gloo_loops() if device.type == "cpu" and self.idle_loops else 0
        bound = bind_to_rank_cores(cores) if idled else 0  # only beside idle loops: see its docstring
        return idled, bound

    def after_warmup(self) -> None:
        if self.baton is not None:  # the pause between turns: twice what this process's idle threads spin
            self.baton.gap_s = 2 * idle_spin_s()

    def before_timed(self) -> None:
        if self.baton is not None:  # every rank has warmed up (the barrier): the twin may set up now
            self.baton.twin_may_start()
            self.baton.ready()

    def before_step(self) -> None:
        if self.baton is not None:
            self.baton.take_turn()

    def after_step(self) -> None:
        if self.baton is not None:
            self.baton.pass_turn()

    def after_timed(self) -> None:
        if self.baton is not None:
            self.baton.finish()

    def failed(self) -> None:
        if self.baton is not None:
            self.baton.abandon()  # the other group must not wait for turns this rank will not take
