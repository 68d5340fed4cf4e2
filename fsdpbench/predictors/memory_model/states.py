"""Per-rank model states, exactly as the strategies lay them out.

- FSDP (``per_unit_gather``): FSDP2 chunks every parameter on dim 0 with ``torch.chunk`` into N
  pieces of ``ceil(d0/N)`` rows and pre-pads each rank's piece to that size
  (torch/distributed/fsdp/_fully_shard/_fsdp_param.py); the optimizer state is ``zeros_like`` the
  unpadded local shard; a unit's sharded gradients are views of one padded reduce-scatter output.
- ZeRO-1 (optimizer sharded; parameters and gradients whole): ZeroRedundancyOptimizer's
  ``_partition_parameters`` hands whole parameters, largest first, to the rank with the fewest
  elements so far.
- Replicated: everything on every rank. Any other declared sharding (a plugin) is split evenly, b·Ψ/N.
- Adam/AdamW/Adadelta keep a ``step`` tensor (fp32 scalar) per parameter, on the CPU.
Where only a parameter count is known, the textbook b·Ψ/d is used (no padding, no step tensors).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from fsdpbench.models.facts import ModelFacts, ParamFact
from fsdpbench.predictors.memory_model.allocator import cuda_storage_bytes
from fsdpbench.predictors.memory_model.precision import (
    STEP_TENSOR_BYTES,
    Precision,
    optimizer_has_step,
    optimizer_k,
    optimizer_update_temporaries,
)
from fsdpbench.strategies.base import Sharding

DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel(bucket_cap_mb=25)


@dataclass(slots=True)
class RankStates:
    """One rank's resident states and the per-unit sizes the timeline needs (bytes)."""

    params: int = 0  # unpadded local parameter bytes
    params_padding: int = 0
    grads: int = 0  # unpadded local gradient bytes (after backward)
    grads_padding: int = 0
    optim: int = 0
    optim_temp: int = 0  # the optimizer update's temporaries at their largest (``update_temp_bytes``)
    clip_temp: int = 0  # gradient clipping's temporaries at their largest (``clip_temp_bytes``)
    # per parameter name: resident gradient storage bytes (replicated grads) — for the timeline
    grad_bytes_by_param: dict[str, int] = field(default_factory=dict)
    # FSDP units (index → bytes): unsharded params, all-gather output, reduce-scatter input,
    # unsharded grads, sharded grad storage
    unit_unsharded: dict[int, int] = field(default_factory=dict)
    unit_all_gather: dict[int, int] = field(default_factory=dict)
    unit_reduce_scatter: dict[int, int] = field(default_factory=dict)
    unit_sharded_grads: dict[int, int] = field(default_factory=dict)
    unit_reduce_output: dict[int, int] = field(default_factory=dict)  # in the reduce dtype
    unsharded_grad_by_param: dict[str, int] = field(default_factory=dict)
    buckets: list[tuple[int, frozenset[str]]] = field(default_factory=list)  # DDP: (bytes, params)
    exact: bool = True  # False when only a parameter count was known

    @property
    def model_states(self) -> int:
        """After optimizer.step, before zero_grad: what the tracker's model-states snapshot measures."""
        return self.params + self.params_padding + self.grads + self.grads_padding + self.optim


@dataclass(frozen=True, slots=True)
class _Layout:
    """How this rank holds every parameter: the sharding degrees, its rank in the shard group, bytes per
    element, the optimizer's state, and the device's storage rounding."""

    d_p: int
    d_g: int
    d_o: int
    shard_rank: int
    precision: Precision
    k: int  # optimizer-state bytes per parameter
    n_state: int  # state tensors per parameter (Adam: exp_avg, exp_avg_sq)
    step: int  # the optimizer's step tensor per parameter (0: none, or not on this device)
    storage: Callable[[int], int]  # bytes a tensor of this many bytes takes on the device

    @property
    def shards(self) -> int:
        return max(self.d_p, self.d_g, self.d_o)


def get_rank_states(
    facts: ModelFacts,
    sharding: Sharding,
    precision: Precision,
    optimizer: str,
    *,
    world_size: int,
    shard_size: int | None,
    rank: int,
    device: str = "cpu",
    uses_units: bool = True,
    optimizer_impl: str = "for-loop",
    clips: bool = False,
) -> RankStates:
    """This rank's states for a strategy's declared sharding, with the temporaries of the optimizer's
    update as ``optimizer_impl`` runs it, and of gradient clipping where the step ``clips``."""
    d_p, d_g, d_o = sharding.degrees(world_size, shard_size)
    k = optimizer_k(optimizer, precision)
    layout = _Layout(
        d_p=d_p,
        d_g=d_g,
        d_o=d_o,
        shard_rank=rank % max(d_p, d_g, d_o),
        precision=precision,
        k=k,
        n_state=max(1, k // 4) if k else 0,
        step=_step_tensor_bytes(optimizer, optimizer_impl, device),
        storage=storage_rounder(device),
    )
    if facts.params is None:  # not known: the textbook's states
        return _textbook_states(facts.n_params, layout)
    params = facts.params
    out = RankStates()
    if sharding.params and sharding.per_unit_gather:
        update_sizes = [_add_fsdp_param(out, p, layout, uses_units) for p in params]
        for u, nbytes in list(out.unit_sharded_grads.items()):
            out.unit_sharded_grads[u] = layout.storage(nbytes)
    else:
        update_sizes = _add_whole_params(out, params, sharding, layout)
        if not sharding.grads and not uses_units:
            out.buckets = ddp_buckets(params, precision.grad_bytes)
    out.optim_temp = update_temp_bytes(update_sizes, optimizer, optimizer_impl, layout.storage)
    out.clip_temp = clip_temp_bytes(len(params), layout.storage) if clips else 0
    return out


def _step_tensor_bytes(optimizer: str, impl: str, device: str) -> int:
    """The optimizer's ``step`` tensor per parameter on the device: on the host unless fused (a CUDA
    tracker does not count host tensors); a fused update keeps it on the parameters' device."""
    if not optimizer_has_step(optimizer):
        return 0
    if impl == "fused":
        return storage_rounder(device)(STEP_TENSOR_BYTES)
    return STEP_TENSOR_BYTES if device == "cpu" else 0


def update_temp_bytes(sizes: list[int], optimizer: str, impl: str, storage: Callable[[int], int]) -> int:
    """The largest temporaries of the optimizer's update over parameters whose fp32 state tensors take
    ``sizes`` bytes each (in the local optimizer's order):

    - ``for-loop``: one parameter at a time (``_update_temp_bytes``);
    - ``foreach`` (torch/optim/adam.py ``_multi_tensor_adam``, AdamW through it): every update op runs on
      the whole list of a (device, dtype) group at once; the only list it allocates is
      ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`` (divided, shifted by eps and used in
      ``_foreach_addcdiv_`` in place), so one state-sized tensor per parameter, all alive together
      (bias corrections are Python floats; the step increment's scalar is freed before);
    - ``fused`` (``torch._fused_adamw_``): one kernel updates every tensor in place, no temporaries.
    """
    per_param = optimizer_update_temporaries(optimizer)
    if impl == "fused" or not per_param:
        return 0
    if impl == "foreach":
        return sum(storage(size) for size in sizes)
    return _update_temp_bytes(sizes, per_param)


def clip_temp_bytes(n_grads: int, storage: Callable[[int], int]) -> int:
    """The largest temporaries of gradient clipping (``engine/step.clip_grad_norm``, torch/nn/utils/
    clip_grad.py ``_get_total_norm``): one fp32 norm per gradient (``torch._foreach_norm``), their
    ``torch.stack`` and its norm, all alive together; the clip coefficient and its clamp come after the
    first two are freed, and ``torch._foreach_mul_`` scales the gradients in place."""
    if not n_grads:
        return 0
    return n_grads * storage(4) + storage(4 * n_grads) + storage(4)


def _textbook_states(psi: int, layout: _Layout) -> RankStates:
    """b·Ψ/d from a parameter count alone."""
    prec = layout.precision
    return RankStates(
        params=round(prec.param_bytes * psi / layout.d_p),
        grads=round(prec.grad_bytes * psi / layout.d_g),
        optim=round(layout.k * psi / layout.d_o),
        exact=False,
    )


def _add_fsdp_param(out: RankStates, p: ParamFact, layout: _Layout, uses_units: bool) -> int:
    """One parameter's dim-0 shard (and its unit's buffers); returns the bytes its update reads."""
    prec, rnd, n = layout.precision, layout.storage, layout.shards
    local, padded = _fsdp_local(p, n, layout.shard_rank)
    out.params += local * prec.param_bytes
    out.params_padding += rnd(padded * prec.param_bytes) - local * prec.param_bytes
    out.grads += local * prec.grad_bytes
    out.grads_padding += (padded - local) * prec.grad_bytes
    if layout.k:
        out.optim += layout.n_state * rnd(local * layout.k // layout.n_state) + layout.step
    if uses_units:
        _add_to_unit(out, p, padded, layout)
    return local * 4


def _add_to_unit(out: RankStates, p: ParamFact, padded: int, layout: _Layout) -> None:
    prec, n, u = layout.precision, layout.shards, p.unit
    full_padded = padded * n

    def add(sizes: dict[int, int], nbytes: int) -> None:
        sizes[u] = sizes.get(u, 0) + nbytes

    add(out.unit_unsharded, layout.storage(full_padded * prec.unsharded_bytes))
    # one rank: FSDP2 copies the shard straight into the unsharded parameter, no all-gather buffer
    add(out.unit_all_gather, full_padded * prec.unsharded_bytes if n > 1 else 0)
    add(out.unit_reduce_scatter, full_padded * prec.reduce_bytes)
    add(out.unit_sharded_grads, padded * prec.grad_bytes)
    add(out.unit_reduce_output, padded * prec.reduce_bytes)
    out.unsharded_grad_by_param[p.name] = layout.storage(p.numel * prec.unsharded_bytes)


def _add_whole_params(
    out: RankStates, params: tuple[ParamFact, ...], sharding: Sharding, layout: _Layout
) -> list[int]:
    """Parameters whole on every rank (DDP, ZeRO-1, FSDP1 NO_SHARD) or a plugin's even split; returns
    the bytes each parameter's update reads, in the local optimizer's order."""
    prec, rnd, k, n_state = layout.precision, layout.storage, layout.k, layout.n_state
    # ZeroRedundancyOptimizer (optimizer sharded, gradients whole): whole parameters per rank
    zero1 = sharding.optim and not sharding.grads
    owned = _zero1_partition(params, layout.d_o)[layout.shard_rank] if zero1 else None
    update_sizes: list[int] = []
    for p in params:
        out.params += rnd(math.ceil(p.numel * prec.param_bytes / layout.d_p))
        g = rnd(math.ceil(p.numel * prec.grad_bytes / layout.d_g))
        out.grads += g
        out.grad_bytes_by_param[p.name] = g
        if owned is not None:
            if p.name in owned and k:
                out.optim += n_state * rnd(p.numel * k // n_state) + layout.step
        elif k:
            out.optim += n_state * rnd(math.ceil(p.numel * k / layout.d_o / n_state)) + layout.step
            update_sizes.append(math.ceil(p.numel / layout.d_o) * 4)
    if owned is not None:  # the rank's local optimizer holds its partition largest first
        return [p.numel * 4 for p in sorted(params, key=lambda t: t.numel, reverse=True) if p.name in owned]
    return update_sizes


def _update_temp_bytes(sizes: list[int], per_param: int) -> int:
    """Largest temporaries of a per-parameter update loop (``foreach=False``): ``per_param`` tensors of
    the current parameter's size, plus the previous iteration's result still bound to its loop variable
    (Adam's ``denom``) until reassigned."""
    if not per_param or not sizes:
        return 0
    return max(per_param * cur + (prev if i else 0) for i, (prev, cur) in enumerate(zip([0, *sizes], sizes)))


def storage_rounder(device: str) -> Callable[[int], int]:
    if device == "cuda":
        return cuda_storage_bytes
    return lambda nbytes: nbytes


def _fsdp_local(p: ParamFact, n: int, shard_rank: int) -> tuple[int, int]:
    """(local unpadded numel, padded local numel) of FSDP2's dim-0 chunk on this shard rank."""
    d0 = p.shape[0] if p.shape else 1
    rest = p.numel // d0 if d0 else 0
    rows = -(-d0 // n)  # torch.chunk: ceil(d0 / n) rows per chunk, fewer (or empty) chunks at the end
    local_rows = min(rows, max(0, d0 - shard_rank * rows))
    return local_rows * rest, rows * rest


def _zero1_partition(params: tuple[ParamFact, ...], world: int) -> list[set[str]]:
    """ZeroRedundancyOptimizer._partition_parameters: largest first, to the least-loaded rank."""
    owned: list[set[str]] = [set() for _ in range(world)]
    sizes = [0] * world
    for p in sorted(params, key=lambda t: t.numel, reverse=True):
        r = sizes.index(min(sizes))
        owned[r].add(p.name)
        sizes[r] += p.numel
    return owned


def ddp_buckets(params: tuple[ParamFact, ...], grad_bytes: int) -> list[tuple[int, frozenset[str]]]:
    """DDP's gradient buckets after its first-iteration rebuild: gradient-ready order (taken as the
    reverse of ``model.parameters()``), a 1 MiB first bucket, then 25 MiB; a bucket closes once full."""
    buckets: list[tuple[int, frozenset[str]]] = []
    size, names = 0, []
    limit = DDP_FIRST_BUCKET_BYTES
    for p in reversed(params):
        size += p.numel * grad_bytes
        names.append(p.name)
        if size >= limit:
            buckets.append((size, frozenset(names)))
            size, names, limit = 0, [], DDP_BUCKET_BYTES
    if names:
        buckets.append((size, frozenset(names)))
    return buckets
