"""Turns between a case's ranks and its compute twin's, step by step, so both are timed in the same moments.

The step-time model's compute is the compute twin's timed steps (pipeline/compute_twin.py); the
model is checked against the case's timed steps. Timed one after the other, seconds apart, the two
saw different machines: on a shared or throttled VM the same 1-rank step, timed twice 10 s apart,
differed by −12…+38 % (docs/step-time-model.md), more than the model's target. So the twin's ranks
are started with the case's and take turns with them: case step 0, twin step 0, case step 1, twin
step 1, … Only one group computes at a time (the other waits in a blocking socket read, on no core), and a
group given its turn first sleeps until the other's idle OpenMP threads have stopped spinning (twice
their spin, measured in each process: ``hosttuning/threads.idle_spin_s``; 0 with one thread per rank),
so neither is slowed by the other, and both medians come from the same second.

The turns go through a TCPStore that the orchestrator serves for the case (``serve``); every process
of both groups reaches it through ``BATON_ENV``. The twin's processes wait, before they build
anything, until the case's ranks have finished their warm-up, so the case's set-up and warm-up are
timed as without a twin. Then the case's ranks wait for the twin's to be warmed up, and the turns
begin. A twin rank that fails gives the case's ranks every turn at once (``abandon``), and they go on
alone; a turn not given within the wait's limit (a quarter of the case's timeout) ends the turns
too. The twin's ranks then fail, and the model falls back to a twin run after the case (and says so).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

BATON_ENV = "FSDPBENCH_BATON"  # "port:role:world_size:steps:timeout_s" of the case's baton store
CASE, TWIN = "case", "twin"
TWIN_DIR = "compute_twin"  # in a case directory: the twin's rank files


class BatonBroken(RuntimeError):
    """The other group did not take its turn in time: the turns are over."""


def baton_env(port: int, role: str, world_size: int, steps: int, timeout_s: float) -> dict[str, str]:
    """The environment entry that makes a rank of ``role`` take turns through the store at ``port``,
    waiting at most ``timeout_s`` for a turn (the twin's set-up and warm-up, or a step of the other group)."""
    return {BATON_ENV: f"{port}:{role}:{world_size}:{steps}:{timeout_s:g}"}


def serve() -> Any:
    """The orchestrator's store for one case's turns (a TCPStore server on a free port of 127.0.0.1)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def env_role() -> str | None:
    """This process's role in the turns (``CASE`` or ``TWIN``), or None when it takes none."""
    spec = os.environ.get(BATON_ENV, "")
    return spec.split(":")[1] if spec.count(":") == 4 else None


class Baton:
    """This rank's side of the turns (``from_env``: None when the case runs without a twin)."""

    def __init__(
        self, store: Any, role: str, world_size: int, steps: int, rank: int, timeout_s: float
    ) -> None:
        self.store, self.role, self.world_size, self.steps, self.rank = store, role, world_size, steps, rank
        self.timeout_s = timeout_s
        self.other = TWIN if role == CASE else CASE
        self.turn = 0  # the next timed step's index
        self.broken = False
        self.gap_s = 0.0  # slept after a turn is given, before the step: the other group's threads settle

    @classmethod
    def from_env(cls, rank: int) -> Baton | None:
        spec = os.environ.get(BATON_ENV)
        return cls.connect(spec, rank) if spec else None

    @classmethod
    def connect(cls, spec: str, rank: int) -> Baton:
        """This rank's side of the turns that ``spec`` (``baton_env``'s value) describes."""
        import torch.distributed as dist

        port, role, world_size, steps, timeout_s = spec.split(":")
        store = dist.TCPStore(
            "127.0.0.1", int(port), is_master=False, timeout=timedelta(seconds=float(timeout_s))
        )
        return cls(store, role, int(world_size), int(steps), rank, float(timeout_s))

    def _wait(self, key: str) -> None:
        """Wait for ``key``; past the timeout the turns are over: a case rank goes on alone, a twin
        rank raises ``BatonBroken`` (its figures would no longer be of the same moments). A twin rank
        also stops once another process has abandoned the turns: the case's ranks, given every turn,
        no longer wait for it, and its steps would run beside theirs (a ``ds_zero3`` twin whose rank 1
        failed in its first step: its rank 0 went on, and the case's 2-rank steps measured 77-119 ms
        against 36-41 ms with the twin taking turns)."""
        if not self.broken:
            try:
                self.store.wait([key], timedelta(seconds=self.timeout_s))
                if self.role != TWIN or not self.store.check(["broken"]):
                    return
                self.broken = True
            except Exception:  # noqa: BLE001 — the store's timeout error has no public type
                self.abandon()
        if self.role == TWIN:
            raise BatonBroken(
                f"twin rank {self.rank}: the turns are over (no {key} within {self.timeout_s:g} s, "
                "or another process abandoned them)"
            )

    def abandon(self) -> None:
        """End the turns (a twin rank that failed, or a turn not given in time): every turn of the
        case's ranks is given at once, so they go on alone without waiting."""
        self.broken = True
        try:
            self.store.set("broken", f"{self.role} rank {self.rank}")
            for i in range(self.steps + 1):
                self.store.set(f"go/{CASE}/{i}", "1")
        except Exception:  # noqa: BLE001 — the store is gone: the case has ended, nobody waits
            pass

    def twin_may_start(self) -> None:
        """Case ranks, after their warm-up: the twin may build its model and warm up now."""
        if self.role == CASE and self.rank == 0:
            self.store.set("twin_start", "1")

    def wait_to_start(self) -> None:
        """Twin ranks, first of all: wait until the case's ranks are warmed up."""
        self._wait("twin_start")

    def ready(self) -> None:
        """Both groups, before their timed steps: the last of the 2·N processes gives the case turn 0."""
        if self.store.add("ready", 1) == 2 * self.world_size:
            self.store.set(f"go/{CASE}/0", "1")

    def take_turn(self) -> None:
        """Wait for this group's turn at the next timed step (at turn 0 the case's ranks wait for the
        twin's set-up and warm-up), then ``gap_s`` more: the other group's idle intra-op threads spin
        on a core for a while after its step (hosttuning/threads.idle_spin_s), which would slow this
        group's first milliseconds, and only this group's."""
        self._wait(f"go/{self.role}/{self.turn}")
        if self.gap_s > 0 and not self.broken:
            time.sleep(self.gap_s)

    def pass_turn(self) -> None:
        """After this rank's timed step: the group's last rank to finish gives the other group its turn."""
        if not self.broken and self.store.add(f"done/{self.role}/{self.turn}", 1) == self.world_size:
            self.store.set(f"go/{self.other}/{self.turn if self.role == CASE else self.turn + 1}", "1")
        self.turn += 1

    def finish(self) -> None:
        """Case ranks, after their last timed step: wait for the twin's last one, which must not share
        the cores with the case's next phases."""
        if self.role == CASE:
            self._wait(f"go/{CASE}/{self.turn}")
