"""Per-rank data, as a data loader gives it: a rank makes only its own samples (each from its own seed),
never the global batch; the ranks' samples together are the global batch, whatever the world size, so
losses stay comparable across strategies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdpbench.core.case import Case
from fsdpbench.core.schema import LOSSES, PRED_PEAK, TRACKER_PEAK
from fsdpbench.engine.step import rank_batch
from fsdpbench.models import make_global_batch, make_samples
from fsdpbench.models.registry import sample_seed
from fsdpbench.predictors.memory_model import predict_memory
from fsdpbench.predictors.traced import estimate
from tests.helpers import run_with_predictions


class LargestTensor(TorchDispatchMode):
    """The largest tensor any op makes while it is active (bytes of its storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_a_rank_never_makes_the_global_batch():
    """Rank 3 of 8 ranks × 4 samples × 64 tokens: no op makes more than its own 4 × 64 int64 tokens."""
    case = Case(model="decoder-tiny", world_size=8, batch_size=4, seq_len=64)
    with LargestTensor() as mode:
        x, y = rank_batch(case, rank=3, step=0, device=torch.device("cpu"))
    assert mode.largest == 4 * 64 * 8  # the rank's tokens (or targets), not 32 × 64 of the global batch
    assert [t.untyped_storage().nbytes() for t in (x, y)] == [4 * 64 * 8, 4 * 64 * 8]


def test_the_analytic_batch_is_the_ranks_own_to_the_byte():
    case = Case(model="decoder-tiny", strategy="zero3", world_size=8, batch_size=4, seq_len=64)
    x, y = rank_batch(case, rank=5, step=1, device=torch.device("cpu"))
    held = sum(t.untyped_storage().nbytes() for t in (x, y))
    assert predict_memory(case).peak_breakdown["inputs"] == held == 2 * 4 * 64 * 8


def test_the_ranks_samples_are_the_global_batch_whatever_the_world_size():
    gx, gy = make_global_batch("decoder-tiny", None, 8, 16, seed=3, step=2)
    for world in (1, 2, 4, 8):
        per = 8 // world
        case = Case(model="decoder-tiny", world_size=world, batch_size=per, seq_len=16, seed=3)
        parts = [rank_batch(case, r, 2, torch.device("cpu")) for r in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), gx)
        assert torch.equal(torch.cat([p[1] for p in parts]), gy)
    x5, _ = make_samples("decoder-tiny", None, 5, 1, 16, seed=3, step=2)
    assert torch.equal(x5, gx[5:6])  # sample 5 alone is sample 5 of the batch
    assert sample_seed(0, 1, 0) != sample_seed(0, 0, 1)  # steps and samples do not share seeds


def test_losses_are_equal_across_strategies_and_the_peaks_are_predicted(tmp_path: Path):
    """llama3-tiny (GQA) on 2 CPU ranks: ddp, zero2 and zero3 train on the same global batch (same
    losses); each rank's tracker peak is the analytic and the traced one to the byte."""
    base = Case(
        model="llama3-tiny", world_size=2, batch_size=2, seq_len=32, warmup_steps=1, steps=2, timeout_s=180
    )
    losses = {}
    for strategy in ("ddp", "zero2", "zero3"):
        case = base.replace(strategy=strategy, wrap="none" if strategy == "ddp" else "block")
        rows = run_with_predictions(case, tmp_path)
        measured = rows[TRACKER_PEAK].tolist()
        assert rows[PRED_PEAK].tolist() == measured
        assert [estimate(case, rank=r).peak_bytes for r in (0, 1)] == measured
        losses[strategy] = rows[LOSSES].iloc[0]
    assert losses["zero2"] == pytest.approx(losses["ddp"], rel=1e-5)
    assert losses["zero3"] == pytest.approx(losses["ddp"], rel=1e-5)
