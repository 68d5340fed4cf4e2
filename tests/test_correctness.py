"""A benchmark that trains the wrong thing measures nothing: every strategy must train the same
model as a single rank over the same global batch (fp32, same seed and data)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import global_losses, reference_losses, run, tiny_case

pytestmark = pytest.mark.slow

RTOL = 1e-5


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_two_ranks_match_one_rank_over_the_global_batch(strategy: str, reference_2, tmp_path: Path) -> None:
    outcome = run(tiny_case(strategy=strategy, world_size=2), tmp_path)
    assert outcome.status == "ok", outcome.error
    losses = global_losses(outcome)
    assert len(losses) == len(reference_2) == 5  # warm-up 1 + timed 2 + memory 1 + profiled 1
    assert losses[-1] != losses[0]  # the model did train
    assert losses == pytest.approx(reference_2, rel=RTOL)


def test_hsdp_2x2_matches_one_rank(tmp_path: Path) -> None:
    reference = reference_losses(4, tmp_path / "ref")
    outcome = run(tiny_case(strategy="hsdp", world_size=4, shard_size=2), tmp_path)
    assert outcome.status == "ok", outcome.error
    assert global_losses(outcome) == pytest.approx(reference, rel=RTOL)


def test_prefetch_and_wrap_do_not_change_the_maths(reference_2, tmp_path: Path) -> None:
    outcome = run(
        tiny_case(strategy="zero3", world_size=2, wrap="size", wrap_min_params=10_000, prefetch=2), tmp_path
    )
    assert outcome.status == "ok", outcome.error
    assert global_losses(outcome) == pytest.approx(reference_2, rel=RTOL)
