"""How many intra-op threads a CPU rank computes with: the cores shared evenly among the ranks."""

from __future__ import annotations

import os


def rank_threads(world_size: int) -> int:
    """The intra-op threads of a CPU rank when ``world_size`` ranks share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, world_size))
