"""One training step per strategy (ddp, zero1, zero2, zero3) under pytest-benchmark.

    python -m pytest tests/benchmarks -q --benchmark-enable --benchmark-autosave     # record
    python -m pytest tests/benchmarks -q --benchmark-enable --benchmark-compare \\
        --benchmark-compare-fail=median:25%

What is timed, honestly: one forward+backward+optimizer step of the tiny decoder with each
strategy applied on a **1-rank gloo group in this pytest process** (CPU). That is the per-step
cost of the strategy's own machinery — DDP's reducer, ZeroRedundancyOptimizer, FSDP2's
unshard/reshard hooks and its all-gather/reduce-scatter calls on one rank — not multi-rank
communication: pytest-benchmark times a function in its own process, and N ranks need N
processes. Multi-rank step time and memory are gated by ``fsdpbench run`` + ``fsdpbench regress``
(docs/ci.md). The batch is made once, outside the timed function.

``benchmark.extra_info`` gets the tracker's memory of one tracked step (live tensor bytes by
category) and the analytic prediction beside it. pytest-benchmark can only gate the timing stats;
``fsdpbench regress`` gates memory.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from fsdpbench.core.case import Case
from fsdpbench.engine.parallel import build_parallel
from fsdpbench.engine.step import rank_batch, train_step
from fsdpbench.metrics.tracker import build_tracker, snapshot_by_category
from fsdpbench.pipeline.scenario import build_case
from tests.helpers import one_rank_gloo

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
CASE_FIELDS = {
    "model": "decoder-tiny",
    "world_size": 1,
    "batch_size": 4,
    "seq_len": 64,
    "optimizer": "adamw",
    "precision": "fp32",
    "wrap": "block",
    "device": "cpu",
    "backend": "gloo",
}
ROUNDS, WARMUP_ROUNDS = 5, 2  # a few seconds for all four in the default test run


@pytest.fixture(scope="module")
def one_rank_group(torch_threads):
    """A 1-rank gloo group and ``torch_threads`` intra-op threads for the module's benchmarks."""
    with one_rank_gloo(torch_threads):
        yield


class StepBench:
    """A model with a strategy applied, its optimizer, and a fixed batch: ``step()`` is what is timed."""

    def __init__(self, case: Case) -> None:
        self.device = torch.device(case.device)
        self.parallel = build_parallel(case, self.device, rank=0)
        self.params = self.parallel.params
        self.n_tensors = len(list(self.parallel.model.parameters()))
        self.batch = rank_batch(case, 0, 0, self.device)  # inputs and targets beside the model

    def step(self, after_optim: Any = None) -> float:
        return train_step(self.parallel, self.batch, after_optim=after_optim).item()

    def tracked_step(self) -> dict[str, int]:
        """Tracker bytes of one step, named as in results.parquet (peak by category, states after step)."""
        model, optimizer = self.parallel.model, self.parallel.optimizer
        tracker = build_tracker(model, optimizer, self.parallel.strategy)
        states: dict[str, int] = {}
        with tracker:
            self.step(
                after_optim=lambda: states.update(snapshot_by_category(tracker, "current", self.device))
            )
        peak = snapshot_by_category(tracker, "peak", self.device)
        out = {"mem_tracker_peak_bytes": peak.pop("total")}
        out.update({f"mem_tracker_peak_{cat}_bytes": n for cat, n in peak.items() if n})
        out["mem_tracker_model_states_bytes"] = sum(states.get(c, 0) for c in ("params", "grads", "optim"))
        return out


def prediction_info(case: Case, measured: dict[str, int]) -> dict[str, Any]:
    """The analytic prediction for the same case (pred_* fields)."""
    import pandas as pd

    from fsdpbench.predictors.memory_model.columns import prediction_columns

    try:
        pred = prediction_columns(case, pd.DataFrame([{"rank": 0, **measured}]))
    except Exception as exc:  # noqa: BLE001 — a prediction bug must not hide the benchmark
        return {"pred_failed": f"{type(exc).__name__}: {exc}"}
    out = {}
    for key, value in pred.items():
        value = (
            value.iloc[0]
            if hasattr(value, "iloc")
            else (value[0] if isinstance(value, (list, tuple)) else value)
        )
        if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
            out[key] = value.item() if hasattr(value, "item") else value
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_step(benchmark, one_rank_group, strategy):
    case, reason = build_case({**CASE_FIELDS, "strategy": strategy})
    assert reason is None, reason
    bench = StepBench(case)
    benchmark.group = f"one step: {case.model}, 1 {case.device} rank ({case.backend})"
    benchmark.extra_info.update(
        case_id=case.case_id,
        strategy=strategy,
        world_size=1,
        model=case.model,
        params=bench.params,
        batch_size=case.batch_size,
        seq_len=case.seq_len,
        backend=case.backend,
        device=case.device,
    )
    loss = benchmark.pedantic(bench.step, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    assert math.isfinite(loss)

    memory = bench.tracked_step()
    benchmark.extra_info.update(memory)
    benchmark.extra_info.update(prediction_info(case, memory))
    # one rank holds every state whole: fp32 params + grads + AdamW (exp_avg, exp_avg_sq) = 16 B per
    # parameter, plus AdamW's 4-byte ``step`` tensor per parameter tensor
    assert memory["mem_tracker_model_states_bytes"] == 16 * bench.params + 4 * bench.n_tensors
