"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from tests.helpers import one_rank_gloo, reference_losses


@pytest.fixture
def one_rank_gloo_group():
    """A 1-rank gloo group in this process, undone afterwards (tests only)."""
    with one_rank_gloo():
        yield


@pytest.fixture(scope="session")
def reference_2(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Losses of ddp on one rank over the global batch of 2 ranks (the reference of the 2-rank tests)."""
    return reference_losses(2, tmp_path_factory.mktemp("ref2"))
