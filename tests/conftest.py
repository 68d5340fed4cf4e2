"""Fixtures shared by the test modules."""

from __future__ import annotations

import sys

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_gloo_group():
    """A 1-rank gloo group in this process, undone afterwards (tests only)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    excepthook = sys.excepthook  # init_process_group prefixes it with "[rank0]" and never restores it
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
