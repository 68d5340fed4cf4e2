"""The analytic memory model: per-rank bytes by category for any strategy, world size, precision and
optimizer — the (P+G+K)·Ψ/N family from the strategy's declared ``Sharding``, made exact for a given
model and rank, plus named extra terms (FSDP padding, unsharded units in flight, all-gather and
reduce-scatter buffers, DDP buckets, activations, a CUDA context allowance) and the moment of the peak.

    from fsdpbench.predictors.memory_model import predict_memory
    from fsdpbench.strategies import FULL_SHARD_STRATEGY
    case = Case(model="llama-7b", strategy=FULL_SHARD_STRATEGY, world_size=64, precision="bf16")
    pred = predict_memory(case)
    pred.model_states_bytes, pred.peak_bytes, pred.peak_moment, pred.peak_breakdown

See docs/memory-model.md. ``prediction_columns`` puts the prediction beside every run's measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from fsdpbench.core.case import Case
from fsdpbench.core.schema import RANK
from fsdpbench.models.facts import ModelFacts, get_model_facts
from fsdpbench.predictors.memory_model.activations import (
    AUTOCAST16,
    FP32,
    PURE16,
    ActivationProfile,
    Shape,
    get_activation_profile,
)
from fsdpbench.predictors.memory_model.flat_zero import FlatZeroStates, flat_zero_schedule, flat_zero_states
from fsdpbench.predictors.memory_model.precision import (
    PRECISIONS,
    Precision,
    get_precision,
    optimizer_k,
    optimizer_update_temporaries,
)
from fsdpbench.predictors.memory_model.states import RankStates, get_rank_states
from fsdpbench.predictors.memory_model.timeline import (
    CATEGORIES,
    Event,
    Moment,
    StepConfig,
    account,
    step_schedule,
)
from fsdpbench.strategies import get_strategy
from fsdpbench.strategies.base import FlatBufferZero, Sharding, Strategy

GIB = 1024**3
# what CPU offload keeps in host memory: the sharded parameters, their gradients and the optimizer state
HOST_CATEGORIES = ("params", "padding", "grads", "optim")
# device memory no tensor tracker sees on a GPU: CUDA context (~0.5 GiB on recent drivers) and NCCL
# communicator buffers; a stated allowance, not a measurement (override: --context-allowance)
CUDA_CONTEXT_BYTES = 1 * GIB
# the analytic note of a model without an activation model (``fsdpbench predict`` then traces instead)
NO_ACTIVATION_MODEL = "no activation model for {model!r}: peak not estimated (use --method traced)"
NO_PEAK_TERM = "no term for {gap}: peak not estimated (use --method traced)"


@dataclass(frozen=True, slots=True)
class MemoryPrediction:
    """One rank's predicted memory for one configuration; every term is its own field (bytes)."""

    strategy: str
    world_size: int
    shard_size: int | None
    rank: int
    params: int  # Ψ
    precision: str
    optimizer: str
    optimizer_impl: str
    batch_size: int | None
    seq_len: int | None
    method: str
    # resident states after optimizer.step (before zero_grad), as the tracker's states snapshot measures
    params_bytes: int
    padding_bytes: int  # FSDP dim-0 padding of parameters and gradients
    grads_bytes: int
    optim_bytes: int
    resting_states_bytes: int
    model_states_bytes: int  # the ZeRO paper's accounting (zero2: params as held from forward to backward)
    exact_states: bool  # False when only a parameter count was known (textbook b·Ψ/d)
    # named extra terms (None: not estimated — no model structure or no activation model)
    unsharded_in_flight_bytes: int | None = None  # largest unit × (1 + prefetch) (+ root unit; zero2: all)
    comm_buffers_bytes: int | None = None  # largest all-gather + reduce-scatter buffer, or DDP buckets
    activations_bytes: int | None = None  # saved at the end of forward, batch included
    optimizer_temp_bytes: int | None = None
    peak_bytes: int | None = None  # live tensors at the peak, as PyTorch's memory trackers count them
    peak_moment: str | None = None
    peak_breakdown: dict[str, int] = field(default_factory=dict)
    context_bytes: int = 0  # CUDA context + NCCL allowance (GPU only)
    untracked_bytes: int = 0  # allocated at the peak but not counted by trackers (DDP buckets not yet used)
    # CPU offload: resident states the strategy keeps in host memory (sharded params + grads + optimizer
    # state, padding included), and the parameters' part of it; 0 without offload
    host_bytes: int = 0
    params_host_bytes: int = 0
    device_resident_peak_bytes: int | None = (
        None  # offload: max over the step of the live bytes not on the host
    )
    params_device_bytes: int = 0  # resident parameter storage (padding included) on the compute device
    device: str = "cpu"
    notes: tuple[str, ...] = ()

    @property
    def device_peak_bytes(self) -> int | None:
        """What the device must hold: the tracked peak + untracked buffers + the context allowance,
        less the states CPU offload keeps on the host (on a GPU; on a CPU run host and device are one)."""
        if self.peak_bytes is None:
            return None
        if self.host_bytes and self.device == "cuda" and self.device_resident_peak_bytes is not None:
            return self.device_resident_peak_bytes + self.untracked_bytes + self.context_bytes
        return self.peak_bytes + self.untracked_bytes + self.context_bytes

    def bytes_by_category(self) -> dict[str, int | None]:
        """Categories at the peak moment; None for terms that could not be estimated."""
        if self.peak_breakdown:
            out: dict[str, int | None] = {c: self.peak_breakdown.get(c, 0) for c in CATEGORIES}
        else:
            out = dict.fromkeys(CATEGORIES, None)
            out.update(
                params=self.params_bytes,
                padding=self.padding_bytes,
                optim=self.optim_bytes,
                grads=self.grads_bytes,
            )
        out["context"] = self.context_bytes
        return out

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            RANK: self.rank,
            "params": self.params,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "optimizer_impl": self.optimizer_impl,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "method": self.method,
            "device": self.device,
            "model_states_bytes": self.model_states_bytes,
            "resting_states_bytes": self.resting_states_bytes,
            "peak_bytes": self.peak_bytes,
            "device_peak_bytes": self.device_peak_bytes,
            "host_bytes": self.host_bytes,
            "peak_moment": self.peak_moment,
            "bytes": self.bytes_by_category(),
            "terms": {
                "params": self.params_bytes,
                "padding": self.padding_bytes,
                "grads": self.grads_bytes,
                "optim": self.optim_bytes,
                "unsharded_in_flight": self.unsharded_in_flight_bytes,
                "comm_buffers": self.comm_buffers_bytes,
                "activations": self.activations_bytes,
                "optimizer_temp": self.optimizer_temp_bytes,
                "context": self.context_bytes,
                "untracked": self.untracked_bytes,
                "host": self.host_bytes,
            },
            "exact_states": self.exact_states,
            "notes": list(self.notes),
        }


def resolve_shard_size(case: Case, sharding: Sharding) -> int | None:
    """The shard-group size of a ``group="shard_group"`` strategy (fsdpbench's HSDP default: 2)."""
    return case.shard_group_size if sharding.group == "shard_group" else None


def zero_model_states_bytes(
    params: float,
    sharding: Sharding,
    world_size: int,
    shard_size: int | None,
    param_bytes: float,
    grad_bytes: float,
    k: float,
) -> float:
    """The textbook M = b_p·Ψ/d_p + b_g·Ψ/d_g + K·Ψ/d_o, with d_p = 1 for params held unsharded
    from forward to backward (ZeRO-2 through FSDP's SHARD_GRAD_OP)."""
    d_p, d_g, d_o = sharding.degrees(world_size, shard_size)
    if sharding.params_unsharded_fwd_to_bwd:
        d_p = 1
    return param_bytes * params / d_p + grad_bytes * params / d_g + k * params / d_o


# the fields a prediction copies from its case
_FROM_CASE = (
    "strategy",
    "world_size",
    "precision",
    "optimizer",
    "optimizer_impl",
    "batch_size",
    "seq_len",
    "device",
)


@dataclass(frozen=True, slots=True)
class _Setup:
    """What every prediction for one rank of a case starts from."""

    case: Case
    rank: int
    strategy: Strategy
    sharding: Sharding
    precision: Precision
    shard_size: int | None
    uses_units: bool  # FSDP units are all-gathered one by one (else the model is one unit)
    facts: ModelFacts
    flat: FlatBufferZero | None  # the strategy keeps its states in flat buffers of its own (DeepSpeed)

    def flat_states(self, device: str) -> FlatZeroStates | None:
        """The engine's flat buffers, where the strategy has them and the model's parameters are known."""
        if self.flat is None or not self.facts.known:
            return None
        return flat_zero_states(
            self.facts,
            self.flat,
            self.precision,
            self.case.optimizer,
            world_size=self.case.world_size,
            rank=self.rank,
            device=device,
            update_temporaries=optimizer_update_temporaries(self.case.optimizer),
        )

    def rank_states(self, device: str) -> RankStates:
        """The rank's states, with ``device``'s storage rounding."""
        flat = self.flat_states(device)
        if flat is not None:
            return flat.rank_states()
        return get_rank_states(
            self.facts,
            self.sharding,
            self.precision,
            self.case.optimizer,
            world_size=self.case.world_size,
            shard_size=self.shard_size,
            rank=self.rank,
            device=device,
            uses_units=self.uses_units,
            optimizer_impl=self.case.optimizer_impl,
            clips=self.case.max_norm is not None,
        )

    def schedule(self, states: RankStates, profile: ActivationProfile) -> list[Event]:
        """The step's events for these states and activations."""
        flat = self.flat_states(self.case.device)
        if flat is not None and self.flat is not None:
            return flat_zero_schedule(
                self.facts,
                flat,
                profile,
                self.flat,
                self.precision.unsharded_bytes,
                world_size=self.case.world_size,
                backend=self.case.backend,
            )
        world = self.case.world_size
        group = max(self.sharding.degrees(world, self.shard_size))
        config = StepConfig(
            prefetch=self.case.prefetch,
            shard_group=group,
            replicas=world // group,
            backend=self.case.backend,
            kept_after_forward=self.strategy.kept_after_forward(self.case),
        )
        return step_schedule(self.facts, states, profile, self.sharding, config)


def _set_up(
    case: Case, rank: int, facts: ModelFacts | None = None, strategy: Strategy | None = None
) -> _Setup:
    strategy = strategy or get_strategy(case.strategy)
    sharding = strategy.sharding
    prec = case.precision_spec
    shard = resolve_shard_size(case, sharding)
    uses_units = bool(strategy.uses_wrap and sharding.per_unit_gather)
    if facts is None:
        facts = get_model_facts(
            case.model,
            case.model_args,
            wrap=case.wrap if uses_units else "none",
            wrap_min_params=case.wrap_min_params,
            wrap_classes=tuple(case.wrap_classes),
        )
    return _Setup(case, rank, strategy, sharding, prec, shard, uses_units, facts, strategy.flat_buffers(case))


def predict_memory(
    case: Case,
    *,
    rank: int = 0,
    facts: ModelFacts | None = None,
    strategy: Strategy | None = None,
    context_bytes: int | None = None,
) -> MemoryPrediction:
    """The analytic prediction for one rank of a case (``facts`` overrides the model, e.g. a bare Ψ)."""
    setup = _set_up(case, rank, facts, strategy)
    facts, prec = setup.facts, setup.precision
    states = setup.rank_states(case.device)
    # CPU offload: the same states as host tensors (no CUDA allocator rounding)
    host_states = None
    if case.cpu_offload and setup.flat_states(case.device) is None:  # DeepSpeed's offload: not modelled
        host_states = states if case.device == "cpu" else setup.rank_states("cpu")
    notes = _case_notes(case, setup.strategy)
    if not states.exact:
        notes.append(
            "model states from the parameter count alone (textbook b·Ψ/d: no padding, no ZeRO-1 "
            "partition imbalance, no step tensors)"
        )
    context = (CUDA_CONTEXT_BYTES if context_bytes is None else context_bytes) if case.device == "cuda" else 0
    pred = MemoryPrediction(
        **{name: getattr(case, name) for name in _FROM_CASE},
        shard_size=setup.shard_size,
        rank=rank,
        params=facts.n_params,
        method="analytic",
        params_bytes=states.params,
        padding_bytes=states.params_padding + states.grads_padding,
        grads_bytes=states.grads,
        optim_bytes=states.optim,
        resting_states_bytes=states.model_states,
        model_states_bytes=_model_states_bytes(setup, states),
        exact_states=states.exact,
        context_bytes=context,
        host_bytes=host_states.model_states if host_states else 0,
        params_host_bytes=host_states.params + host_states.params_padding if host_states else 0,
        params_device_bytes=0 if host_states else states.params + states.params_padding,
    )
    if not facts.known:
        notes.append(
            "activations, unsharded units and communication buffers need a model (--model): not estimated"
        )
        return replace(pred, notes=tuple(notes))
    flat = setup.flat_states(case.device)
    terms = _named_terms(facts, states, case.prefetch, setup.sharding) if flat is None else _flat_terms(flat)
    profile = _profile(case, setup.strategy, prec)
    if profile is None:
        notes.append(NO_ACTIVATION_MODEL.format(model=case.model))
        return replace(pred, notes=tuple(notes), **terms)
    gap = setup.strategy.analytic_gap(case)
    if gap is not None:
        notes.append(NO_PEAK_TERM.format(gap=gap))
        return replace(pred, notes=tuple(notes), **terms)
    if profile.kernel_note:
        notes.append(profile.kernel_note)
    if prec.name == "mixed":
        notes.append("'mixed' is an accounting (ZeRO paper); the peak assumes FSDP-style 16-bit compute")
    return replace(
        pred,
        **terms,
        **_peak_terms(account(setup.schedule(states, profile)), offload=host_states is not None),
        activations_bytes=profile.inputs_bytes + profile.saved_bytes,
        notes=tuple(notes),
    )


def peak_moments(case: Case, *, rank: int = 0) -> list[Moment]:
    """Every moment of the step (for inspection: which term grows when)."""
    return account(step_events(case, rank=rank))


def step_events(case: Case, *, rank: int = 0) -> list[Event]:
    """The step's schedule: every buffer allocated and freed, and the moments recorded (empty without
    an activation model)."""
    setup = _set_up(case, rank)
    profile = _profile(case, setup.strategy, setup.precision)
    return [] if profile is None else setup.schedule(setup.rank_states(case.device), profile)


def recipe_note(case: Case) -> str:
    """One line: the optimizer update, clipping and activation checkpointing a prediction assumes."""
    from fsdpbench.strategies.optim import optimizer_class_name

    default = " (torch's default on CUDA: foreach)" if case.optimizer_impl != "foreach" else ""
    clip = f"gradients clipped to norm {case.max_norm:g}" if case.max_norm is not None else "no clipping"
    ac = case.activation_checkpointing_policy if case.activation_checkpointing else "none"
    return (
        f"assumes {optimizer_class_name(case.optimizer)} with the {case.optimizer_impl} update{default}; "
        f"{clip}; activation checkpointing: {ac}"
    )


def _case_notes(case: Case, strategy: Strategy) -> list[str]:
    """What the prediction leaves out for this case's strategy and knobs (first: the recipe it assumes)."""
    notes: list[str] = [recipe_note(case), *strategy.memory_model_notes]
    flat = strategy.flat_buffers(case)
    if case.cpu_offload and flat is not None:
        notes.append(
            "cpu_offload: DeepSpeed's offload (its pinned host buffers, CPU optimizer) is not modelled; "
            "its buffers are laid out as without offload"
        )
    elif case.cpu_offload:
        notes.append(
            "cpu_offload: sharded params, grads and optimizer state are host memory (host_bytes), left "
            "out of the device peak on a GPU; the host-to-device staging copies are not modelled"
        )
    if flat is not None and case.precision_spec.casts:
        notes.append(
            f"{case.precision}: DeepSpeed's 16-bit gradient paths (a separate fp32 accumulator) are not "
            "modelled; its buffers are laid out with fp32's mechanism in the 16-bit dtype"
        )
    if case.compile:
        notes.append("torch.compile is not modelled: activations are those of the eager model")
    return notes


def _model_states_bytes(setup: _Setup, states: RankStates) -> int:
    """The ZeRO paper's accounting: the real layout where it is known (plus the params ZeRO-2 holds
    unsharded from forward to backward), the textbook formula otherwise or under ``mixed``."""
    case, prec, sharding = setup.case, setup.precision, setup.sharding
    if prec.master_in_optimizer or not states.exact:
        k = optimizer_k(case.optimizer, prec)
        params = setup.facts.n_params
        return round(
            zero_model_states_bytes(
                params, sharding, case.world_size, setup.shard_size, prec.param_bytes, prec.grad_bytes, k
            )
        )
    held = sum(states.unit_unsharded.values()) if sharding.params_unsharded_fwd_to_bwd else 0
    return states.model_states + held


def _peak_terms(moments: list[Moment], *, offload: bool) -> dict[str, Any]:
    """The peak moment's fields of a prediction."""
    peak = max(moments, key=lambda m: m.total)
    device_resident = None
    if offload:  # the host keeps the sharded states: the device's own peak may fall elsewhere
        device_resident = max(m.total - sum(m.bytes.get(c, 0) for c in HOST_CATEGORIES) for m in moments)
    return {
        "peak_bytes": peak.total,
        "peak_moment": peak.label,
        "peak_breakdown": {c: peak.bytes.get(c, 0) for c in CATEGORIES},
        "untracked_bytes": peak.untracked_bytes,
        "device_resident_peak_bytes": device_resident,
    }


def _profile(case: Case, strategy: Strategy, prec: Precision) -> ActivationProfile | None:
    from fsdpbench.models import resolve_model

    mdef, args = resolve_model(case.model, case.model_args)
    if prec.compute_bytes == 4:
        mode = FP32
    else:
        mode = PURE16 if strategy.native_mixed_precision else AUTOCAST16
    shape = Shape(
        batch=case.batch_size,
        seq_len=case.seq_len,
        mode=mode,
        checkpointing=case.activation_checkpointing,
        checkpoint_policy=case.activation_checkpointing_policy,
        device=case.device,
    )
    return get_activation_profile(mdef.name, args, shape)


def _flat_terms(flat: FlatZeroStates) -> dict[str, Any]:
    """A flat-buffer engine's named terms: its reduce buckets; parameters gathered in flight (stage 3)
    are in the peak's breakdown."""
    return {
        "unsharded_in_flight_bytes": 0,
        "comm_buffers_bytes": flat.reduce_bucket * flat.reduce_buckets,
        "optimizer_temp_bytes": flat.update_temp,
    }


def _named_terms(facts: ModelFacts, states: RankStates, prefetch: int, sharding: Sharding) -> dict[str, Any]:
    if states.unit_unsharded:
        blocks = {u: b for u, b in states.unit_unsharded.items() if u != facts.root}
        largest = max(blocks.values(), default=0)
        root = states.unit_unsharded.get(facts.root, 0)
        in_flight = (
            sum(states.unit_unsharded.values())
            if sharding.params_unsharded_fwd_to_bwd
            else root + largest * (1 + prefetch)
        )
        comm = max(states.unit_all_gather.values(), default=0) + max(
            states.unit_reduce_scatter.values(), default=0
        )
    else:
        in_flight, comm = 0, sum(b for b, _ in states.buckets)
    return {
        "unsharded_in_flight_bytes": in_flight,
        "comm_buffers_bytes": comm,
        "optimizer_temp_bytes": states.optim_temp,
    }


__all__ = [
    "CUDA_CONTEXT_BYTES",
    "MemoryPrediction",
    "ModelFacts",
    "NO_ACTIVATION_MODEL",
    "NO_PEAK_TERM",
    "PRECISIONS",
    "Precision",
    "RankStates",
    "get_model_facts",
    "get_precision",
    "peak_moments",
    "predict_memory",
    "recipe_note",
    "step_events",
    "zero_model_states_bytes",
]
