"""The harness's own footprint: how the bare loop is placed beside the timed steps (the overhead
ratio), and whether an instrument left anything installed that would slow the steps after it.

What can be left behind, and what fsdpbench does about it:
- ``torch.profiler`` on CUDA: Kineto keeps CUPTI attached after the profile unless ``TEARDOWN_CUPTI=1``
  (pytorch/pytorch#144455: 10–20% slower training after profiling). ``profile_steps`` sets it.
- the memory trackers (``MemTracker``, ``FSDPMemTracker``, ``ModTracker``): a dispatch mode, global
  module and optimizer hooks, and a patched ``UntypedStorage.resize_``, all of which they undo on
  exit; ``instruments_left_installed`` checks that they did.
"""

from __future__ import annotations

import os

import torch

BLOCKS = 4  # timed/bare block pairs; alternating their order cancels a linear drift of the machine


def interleaved_blocks(timed_steps: int, bare_steps: int, blocks: int = BLOCKS) -> list[tuple[str, int]]:
    """("timed" | "bare", steps) blocks: the timed steps and the bare loop split into the same number
    of near-equal blocks, ordered timed, bare, bare, timed, timed, bare, … (no bare steps: one block)."""
    if bare_steps <= 0:
        return [("timed", timed_steps)] if timed_steps else []
    n = max(1, min(blocks, timed_steps, bare_steps))
    timed = _split(timed_steps, n)
    bare = _split(bare_steps, n)
    out: list[tuple[str, int]] = []
    for i in range(n):
        pair = [("timed", timed[i]), ("bare", bare[i])]
        out += pair if i % 2 == 0 else pair[::-1]
    return [block for block in out if block[1] > 0]


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def request_cupti_teardown() -> None:
    """Make Kineto detach CUPTI when a CUDA profile stops (its default keeps it attached, slowing
    every later kernel launch, so every phase after the profiled step). Library configuration of this
    rank process, the same in every run: a value in the user's environment does not change what the
    later phases measure. torch sets 0 itself, after this, where CUDA graphs need it (torch.profiler,
    CUDA < 12.6)."""
    os.environ["TEARDOWN_CUPTI"] = "1"


def instruments_left_installed() -> list[str]:
    """What a memory tracker or the profiler would leave installed in this process; [] when clean."""
    from torch.nn.modules import module
    from torch.optim import optimizer
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    left = []
    if _get_current_dispatch_mode_stack():
        left.append(f"{len(_get_current_dispatch_mode_stack())} dispatch mode(s)")
    for name in (
        "_global_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_backward_pre_hooks",
        "_global_backward_hooks",
    ):
        if getattr(module, name, None):
            left.append(f"global module hook(s) {name}")
    for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        if getattr(optimizer, name, None):
            left.append(f"global optimizer hook(s) {name}")
    if getattr(torch.UntypedStorage.resize_, "__wrapped__", None) is not None:
        left.append("UntypedStorage.resize_ still patched")
    if torch.autograd.profiler._is_profiler_enabled:
        left.append("autograd profiler still enabled")
    return left
