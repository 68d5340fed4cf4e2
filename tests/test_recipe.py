"""The recipe as users configure it: activation checkpointing policies, the optimizer's update
implementation, gradient clipping and FSDP2's per-unit resharding — run, analytic and traced alike."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from fsdpbench.core.case import Case, resolve_activation_checkpointing
from fsdpbench.engine.knobs import apply_activation_checkpointing
from fsdpbench.engine.step import clip_grad_norm
from fsdpbench.models import build_model, make_global_batch
from fsdpbench.pipeline.scenario import ScenarioError, build_case, parse_scenario
from fsdpbench.predictors.memory_model import peak_moments, predict_memory
from fsdpbench.predictors.memory_model.states import clip_temp_bytes, storage_rounder, update_temp_bytes
from fsdpbench.predictors.traced import estimate
from fsdpbench.strategies.optim import implementation_kwargs
from tests.helpers import global_losses, run

GQA = {"d_model": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "vocab": 512}


def _case(**fields) -> Case:
    base = dict(model="decoder", model_args=GQA, world_size=2, batch_size=2, seq_len=32, max_norm=1.0)
    return Case(**{**base, **fields})


# ---- the scenario field and the flag ---------------------------------------------------------------
def test_true_and_full_are_one_case_and_keep_their_ids() -> None:
    full, _ = build_case({"activation_checkpointing": "full"})
    true, _ = build_case({"activation_checkpointing": True})
    assert full.case_id == true.case_id
    assert "_ac_" in full.case_id
    op, _ = build_case({"activation_checkpointing": "op"})
    every, _ = build_case({"activation_checkpointing": "every:2"})
    assert (op.activation_checkpointing_policy, every.activation_checkpointing_policy) == ("op", "every:2")
    assert "_ac-op_" in op.case_id and "_ac-every2_" in every.case_id
    assert resolve_activation_checkpointing("every:1") == (True, "full")
    assert resolve_activation_checkpointing("none") == (False, "full")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("activation_checkpointing: every:0", "defaults.activation_checkpointing"),
        ("activation_checkpointing: selective", "every:N"),
        ("optimizer_impl: vectorized", "for-loop"),
        ("max_norm: 0", "defaults.max_norm"),
    ],
)
def test_a_bad_recipe_field_names_the_field(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(f"name: x\ndefaults: {{{text}}}\nsweep: {{strategy: zero3}}")


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"optimizer": "sgd", "optimizer_impl": "foreach"}, "modelled for adam, adamw"),
        ({"strategy": "fsdp1_full", "max_norm": 1.0}, "clip_grad_norm_"),
        (
            {"strategy": "zero2", "strategy_args": {"reshard_after_forward": "except_last"}},
            "unknown to zero2",
        ),
        (
            {"strategy": "zero3", "world_size": 4, "strategy_args": {"reshard_after_forward": 3}},
            "factor of the 4",
        ),
        (
            {"strategy": "zero3", "world_size": 4, "strategy_args": {"reshard_after_forward": 4}},
            "that is true",
        ),
        (
            {"strategy": "zero3", "world_size": 4, "strategy_args": {"reshard_after_forward": "x"}},
            "a group size",
        ),
    ],
)
def test_combinations_not_run_are_skipped_with_the_reason(fields: dict, reason: str) -> None:
    _, why = build_case(fields)
    assert why is not None and reason in why


# ---- activation checkpointing policies ----------------------------------------------------------------
def _forward_activation_bytes(case: Case) -> int:
    torch.manual_seed(0)
    model = apply_activation_checkpointing(build_model(case.model, case.model_args), case)
    x, _ = make_global_batch(case.model, case.model_args, case.batch_size, case.seq_len, 0, 0)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        out = model(x)
        snap = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
    del out
    return sum(v for k, v in snap.items() if getattr(k, "value", k) == "Activation")


def test_op_policy_saves_every_second_matmul_and_recomputes_cpu_attention() -> None:
    """decoder-tiny (d 64, ffn 192, 4×64 tokens, fp32): per block the op policy keeps the input and
    the outputs of wq, wv, w1, w2 (the 1st, 3rd, 5th, 7th matmul); the CPU's flash attention is not in
    torchtitan's list, so it is recomputed."""
    full = Case(model="decoder-tiny", activation_checkpointing=True)
    op = full.replace(activation_checkpointing_policy="op")
    tok = 4 * 64
    assert _forward_activation_bytes(op) - _forward_activation_bytes(full) == 2 * 4 * tok * (
        64 + 64 + 192 + 64
    )


@pytest.mark.parametrize("policy", ["full", "op", "every:2"])
@pytest.mark.parametrize(("strategy", "world"), [("zero3", 1), ("zero3", 2), ("ddp", 2)])
def test_analytic_equals_traced_for_each_policy(policy: str, strategy: str, world: int) -> None:
    case = _case(strategy=strategy, world_size=world, activation_checkpointing=True)
    case = case.replace(activation_checkpointing_policy=policy)
    assert predict_memory(case).peak_bytes == estimate(case).peak_bytes


def test_every_second_block_keeps_the_others_whole() -> None:
    full = _case(strategy="zero3", activation_checkpointing=True)
    peaks = {
        p: predict_memory(full.replace(activation_checkpointing_policy=p)).peak_bytes
        for p in ("full", "op", "every:2")
    }
    assert peaks["full"] < peaks["op"] < peaks["every:2"] < predict_memory(_case(strategy="zero3")).peak_bytes


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_cuda_target_traced_on_the_cpu_saves_cuda_attention_under_the_op_policy(precision: str) -> None:
    """CUDA's attention (cuDNN in bf16, memory-efficient in fp32) is in torchtitan's save list; its CPU
    stand-in is one op the policy treats as the kernel it stands for, so the trace saves what the
    analytic model does (bf16: both peak at the loss's backward, where they differ by one 512-byte
    scalar with or without checkpointing)."""
    case = Case(
        model="decoder-small", strategy="zero3", world_size=4, precision=precision, batch_size=2,
        seq_len=256, device="cuda", backend="nccl", activation_checkpointing=True,
        activation_checkpointing_policy="op",
    )  # fmt: skip

    def gap(c: Case) -> int:
        return estimate(c).peak_bytes - predict_memory(c).peak_bytes

    assert gap(case) == (gap(case.replace(activation_checkpointing=False)) if precision == "bf16" else 0)


# ---- the optimizer's update and clipping --------------------------------------------------------------
def _optimizer_step_peak(impl: str) -> tuple[int, int]:
    """Live bytes at the optimizer step's peak and before it, one rank, no strategy."""
    torch.manual_seed(0)
    model = build_model("decoder-tiny", {})
    optimizer = torch.optim.AdamW(model.parameters(), **implementation_kwargs(impl))
    x, y = make_global_batch("decoder-tiny", {}, 1, 4, 0, 0)
    for _ in range(2):
        model(x).sum().backward()
        optimizer.step()
    model(x).sum().backward()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        optimizer.step()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return peak, before


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
def test_update_temporaries_are_what_each_implementation_allocates(impl: str) -> None:
    model = build_model("decoder-tiny", {})
    sizes = [p.numel() * 4 for p in model.parameters()]
    peak, before = _optimizer_step_peak(impl)
    assert peak - before == update_temp_bytes(sizes, "adamw", impl, storage_rounder("cpu"))
    assert update_temp_bytes(sizes, "adamw", "foreach", storage_rounder("cpu")) == sum(sizes)
    assert update_temp_bytes(sizes, "adamw", "fused", storage_rounder("cpu")) == 0


def test_clipping_temporaries_are_the_norms_their_stack_and_the_total() -> None:
    torch.manual_seed(0)
    model = build_model("decoder-tiny", {})
    x, _ = make_global_batch("decoder-tiny", {}, 1, 4, 0, 0)
    model(x).sum().backward()
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        clip_grad_norm(model, 1e-3)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    n = len(list(model.parameters()))
    assert peak - before == clip_temp_bytes(n, storage_rounder("cpu")) == 8 * n + 4
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert total.item() == pytest.approx(1e-3, rel=1e-4)  # scaled to the norm asked for
    assert clip_temp_bytes(n, storage_rounder("cuda")) == n * 512 + 512 * -(-4 * n // 512) + 512


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_the_optimizer_step_peak_follows_the_implementation(impl: str) -> None:
    """DDP at a tiny batch peaks at the optimizer step: traced and analytic agree to the byte."""
    case = _case(
        model="decoder-tiny", model_args={}, strategy="ddp", batch_size=1, seq_len=8, optimizer_impl=impl
    )
    pred, est = predict_memory(case), estimate(case)
    assert pred.peak_bytes == est.peak_bytes
    loop = predict_memory(case.replace(optimizer_impl="for-loop"))
    assert (pred.peak_bytes > loop.peak_bytes) == (impl == "foreach")
    assert f"the {impl} update" in pred.notes[0]


# ---- FSDP2's per-unit resharding -----------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_every_unit_but_the_last_reshards(prefetch: int) -> None:
    case = _case(strategy="zero3", prefetch=prefetch, strategy_args={"reshard_after_forward": "except_last"})
    pred = predict_memory(case)
    assert pred.peak_bytes == estimate(case).peak_bytes
    moments = {m.label: m.bytes for m in peak_moments(case)}
    # the last block stays unsharded through the loss; with every unit resharded nothing is
    assert moments["backward: head (loss)"]["params_unsharded"] > 0
    plain = {m.label: m.bytes for m in peak_moments(case.replace(strategy_args={}))}
    assert plain["backward: head (loss)"].get("params_unsharded", 0) == 0


# ---- the scaled-down recipe, measured ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("policy", [False, "op"])
def test_recipe_measured_equals_analytic_and_traced_and_losses_agree(policy, tmp_path) -> None:
    from fsdpbench.pipeline.runner import add_predictions
    from fsdpbench.store.results import build_rows

    losses = {}
    for strategy in ("zero2", "zero3"):
        fields = dict(
            model="decoder", model_args=GQA, world_size=2, batch_size=2, seq_len=32, max_norm=1.0,
            optimizer_impl="foreach", strategy=strategy, activation_checkpointing=policy,
            warmup_steps=1, steps=2, profile_steps=0, timeout_s=180,
        )  # fmt: skip
        case, why = build_case(fields)
        assert why is None
        outcome = run(case, tmp_path)
        assert outcome.status == "ok", outcome.error
        rows = add_predictions(case, build_rows(case, outcome, {}))
        assert list(rows["pred_peak_err"]) == [0.0, 0.0]
        assert list(rows["mem_tracker_peak_bytes"]) == [estimate(case, rank=r).peak_bytes for r in (0, 1)]
        losses[strategy] = global_losses(outcome)
    # clipping sees the same global norm whether gradients are sharded or not
    assert losses["zero2"] == pytest.approx(losses["zero3"], rel=1e-6)
