"""Emulation: one rank alone on one device, with a fake process group, sees the live tensors a real rank
sees."""

from __future__ import annotations

import pytest

from fsdpbench.core.case import Case
from fsdpbench.core.schema import TRACKER_CATEGORIES
from fsdpbench.engine.emulate import check_emulation, fill_local_data, resolve_emulate_ranks
from fsdpbench.engine.rank_result import RankResult
from fsdpbench.store.results import build_rows
from tests.helpers import run

# scenarios/ci.yaml's shape (its peak is not at gloo's asynchronous reduce-scatter, so a real run's
# tracker is deterministic); CPU semantics pinned
SHAPE = dict(
    model="decoder-tiny",
    batch_size=4,
    seq_len=64,
    warmup_steps=1,
    steps=1,
    memory_steps=1,
    profile_steps=0,
    device="cpu",
    backend="gloo",
    timeout_s=120,
)


def _tracker(rank: RankResult) -> dict:
    memory = rank.memory
    return {"peak": memory.peak, "states": memory.states_tracker, "local": memory.states_local}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "hsdp"])
def test_emulated_rank_equals_the_real_rank_category_by_category(strategy, world, tmp_path):
    # hsdp: shard groups of 2 (at 2 ranks one group, a 1 x 2 mesh; at 4 ranks 2 replicas x 2 shards)
    real = Case(strategy=strategy, world_size=world, shard_size=2 if strategy == "hsdp" else None, **SHAPE)
    emulated = real.replace(emulate=True, emulate_ranks=(0, world - 1))  # first and last (ZeRO-1 differs)
    real_out, emu_out = run(real, tmp_path), run(emulated, tmp_path)
    assert real_out.status == "ok", real_out.error
    assert emu_out.status == "ok", emu_out.error
    assert [r.rank for r in emu_out.ranks] == [0, world - 1]
    for emu_rank in emu_out.ranks:
        real_rank = real_out.ranks[emu_rank.rank]
        got, want = _tracker(emu_rank), _tracker(real_rank)
        assert set(got["peak"]) == set(TRACKER_CATEGORIES) | {"total"}
        for cat in got["peak"]:  # one category at a time, so a failure names it
            assert (cat, got["peak"][cat]) == (cat, want["peak"][cat])
        assert got["states"] == want["states"]
        assert got["local"] == want["local"]
        assert emu_rank.setup.mode == "emulated" and real_rank.setup.mode == "real"


def test_emulated_rows_say_so_and_skip_the_loss(tmp_path):
    case = Case(strategy="zero3", world_size=4, emulate=True, **SHAPE)
    outcome = run(case, tmp_path)
    assert outcome.status == "ok", outcome.error
    rows = build_rows(case, outcome, env={})
    assert list(rows["rank"]) == [0]  # default: rank 0 only, one process
    assert list(rows["mode"]) == ["emulated"]
    assert rows["loss_final"].isna().all() and rows["losses"].iloc[0] == []
    assert "garbage on purpose" in rows["loss_skipped_reason"].iloc[0]
    assert rows["mem_tracker_peak_bytes"].iloc[0] > 0


def test_only_this_ranks_shards_are_materialised():
    """zero3 at 64 ranks: the rank holds 1/64 of the parameters (padded), never the whole model."""
    import torch
    import torch.distributed as dist

    from fsdpbench.engine.emulate import build_rank_model, shards_on_meta
    from fsdpbench.engine.fake_pg import init_fake_process_group
    from fsdpbench.models import resolve_model
    from fsdpbench.models.wrap import get_wrap_units
    from fsdpbench.strategies import ApplyContext, get_strategy

    case = Case(model="decoder-small", strategy="zero3", world_size=64, emulate=True)
    strategy = get_strategy("zero3")
    mdef, margs = resolve_model(case.model, case.model_args)
    init_fake_process_group(5, 64)
    try:

        def apply(model):
            ctx = ApplyContext(
                case=case,
                device=torch.device("cpu"),
                rank=5,
                world_size=64,
                units=get_wrap_units(model, case),
            )
            return strategy.apply(model, ctx)

        model, n_params = build_rank_model(
            mdef,
            margs,
            apply,
            shard_on_meta=shards_on_meta(strategy),
            device=torch.device("cpu"),
            seed=0,
            rank=5,
        )
        local = sum(p.to_local().numel() for p in model.parameters())
        assert all(not p.to_local().is_meta for p in model.parameters())
        assert all(p.to_local().abs().sum() > 0 for p in model.parameters() if p.to_local().numel())  # filled
        padded = sum(-(-p.shape[0] // 64) * p[0].numel() for p in model.parameters())
        assert local == padded and local < n_params / 60
    finally:
        dist.destroy_process_group()


def test_fill_is_deterministic_and_finite():
    import torch

    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    fill_local_data(a, seed=1, rank=3)
    fill_local_data(b, seed=1, rank=3)
    assert torch.equal(a.weight, b.weight) and torch.isfinite(a.weight).all()
    assert 0 < a.weight.abs().max() < 0.2


def test_emulate_ranks_resolve_and_check():
    assert resolve_emulate_ranks("all", 3) == (0, 1, 2)
    assert resolve_emulate_ranks([3, 1, 1], 4) == (1, 3)
    case = Case(world_size=2, emulate=True, emulate_ranks=(2,))
    assert "outside world_size=2" in check_emulation(case)
    assert check_emulation(case.replace(emulate_ranks=(1,))) is None
    assert Case(world_size=8, device="cuda", emulate=True).devices_needed == 1
    assert Case(world_size=8, device="cuda").devices_needed == 8


def test_predict_method_emulated_prints_the_measured_rank_beside_analytic(capsys):
    """decoder-tiny, zero3, rank 0 of 4, batch 4 x seq 64, CPU: the emulated rank's tracker equals the golden
    numbers of a real gloo run (tests/test_estimate.py), and "fits?" is answered from its peak."""
    import json

    from fsdpbench.cli import main

    with pytest.raises(SystemExit) as exc:
        main(
            [
                "predict",
                "--model",
                "decoder-tiny",
                "--world-size",
                "4",
                "--strategy",
                "zero3",
                "--batch-size",
                "4",
                "--seq-len",
                "64",
                "--device",
                "cpu",
                "--method",
                "emulated",
                "--device-memory",
                "5MB",
                "--json",
            ]
        )
    assert (exc.value.code or 0) == 0
    analytic, emulated = json.loads(capsys.readouterr().out)
    assert (analytic["method"], emulated["method"]) == ("analytic", "emulated")
    assert emulated["peak_bytes"] == 5347356 and emulated["device_peak_bytes"] == 5347356
    assert sum(emulated["states_by_category"][c] for c in ("params", "grads", "optim")) == 689492
    assert (
        emulated["fits"] is False and emulated["needed_bytes"] == 5347356
    )  # 5 MB < 5.35 MB; CPU: no allowance


def test_emulated_figures_are_labelled_in_summary_report_and_regress():
    import pandas as pd

    from fsdpbench.analysis.regress import build_baseline, case_records
    from fsdpbench.analysis.summary import case_summary
    from fsdpbench.report.data import ranks_label

    assert ranks_label(4, "cpu", "gloo", mode="emulated", emulated_ranks="0") == (
        "rank 0 of 4 CPU ranks (gloo), emulated on one CPU"
    )
    assert ranks_label(4, "cuda", "nccl") == "4 GPUs (NCCL)"
    row = dict(
        case_id="c",
        strategy="zero3",
        world_size=4,
        device="cpu",
        case_status="ok",
        case_error="",
        case_step_time_ms=1.0,
        step_time_ms=1.0,
        status="ok",
        rank=0,
        mem_tracker_peak_bytes=10,
        losses=[],
        mode="emulated",
        timed_steps=1,
        warmup_steps=1,
    )
    frame = pd.DataFrame([row, {**row, "case_id": "r", "mode": "real"}])
    assert list(case_summary(frame)["mode"]) == ["emulated", "real"]
    assert case_records(frame)["c"]["mode"] == "emulated"
    baseline = build_baseline(frame.assign(backend="gloo", device_name="cpu", torch_version="t", commit="x"))
    assert baseline["cases"]["c"]["mode"] == "emulated" and "mode" not in baseline["cases"]["r"]
