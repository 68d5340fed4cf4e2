"""How many torch intra-op threads one CPU rank gets: the worker sets them, and whatever must run as the
run's ranks do (the gloo probe, the compute twin) sets the same."""

from __future__ import annotations

import os


def rank_threads(world_size: int) -> int:
    """The intra-op threads of a CPU rank when ``world_size`` ranks share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, world_size))
