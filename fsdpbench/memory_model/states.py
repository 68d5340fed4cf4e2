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
from dataclasses import dataclass, field

from fsdpbench.memory_model.facts import ModelFacts, ParamFact
from fsdpbench.memory_model.precision import (
    STEP_TENSOR_BYTES,
    Precision,
    optimizer_has_step,
    optimizer_k,
    optimizer_update_temporaries,
)
from fsdpbench.strategies.base import Sharding

CUDA_BLOCK_BYTES = 512  # the tracker (and the caching allocator) round every CUDA storage up to this
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
    optim_temp: int = 0  # the optimizer update's temporaries at their largest (``_update_temp_bytes``)
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
) -> RankStates:
    """This rank's states for a strategy's declared sharding."""
    d_p, d_g, d_o = sharding.degrees(world_size, shard_size)
    n = max(d_p, d_g, d_o)
    shard_rank = rank % n
    k = optimizer_k(optimizer, precision)
    step = STEP_TENSOR_BYTES if optimizer_has_step(optimizer) and device == "cpu" else 0
    n_state = max(1, k // 4) if k else 0  # state tensors per parameter (Adam: exp_avg, exp_avg_sq)
    rnd = _rounder(device)
    out = RankStates()
    if not facts.known:
        psi = facts.n_params
        out.exact = False
        out.params = round(precision.param_bytes * psi / d_p)
        out.grads = round(precision.grad_bytes * psi / d_g)
        out.optim = round(k * psi / d_o)
        return out

    fsdp = sharding.params and sharding.per_unit_gather
    # ZeroRedundancyOptimizer (optimizer sharded, gradients whole): whole parameters per rank
    zero1 = sharding.optim and not sharding.grads and not fsdp
    zero1_owned = _zero1_partition(facts.params, d_o)[shard_rank] if zero1 else None
    update_sizes: list[int] = []  # bytes of each parameter the local optimizer updates, in its order
    for p in facts.params:
        if fsdp:
            local, padded = _fsdp_local(p, n, shard_rank)
            full_padded = padded * n
            out.params += local * precision.param_bytes
            out.params_padding += rnd(padded * precision.param_bytes) - local * precision.param_bytes
            out.grads += local * precision.grad_bytes
            out.grads_padding += (padded - local) * precision.grad_bytes
            out.optim += n_state * rnd(local * k // n_state) + step if k else 0
            update_sizes.append(local * 4)
            if uses_units:
                u = p.unit
                out.unit_unsharded[u] = out.unit_unsharded.get(u, 0) + rnd(
                    full_padded * precision.unsharded_bytes
                )
                # one rank: FSDP2 copies the shard straight into the unsharded parameter, no all-gather buffer
                ag = full_padded * precision.unsharded_bytes if n > 1 else 0
                out.unit_all_gather[u] = out.unit_all_gather.get(u, 0) + ag
                out.unit_reduce_scatter[u] = (
                    out.unit_reduce_scatter.get(u, 0) + full_padded * precision.reduce_bytes
                )
                out.unit_sharded_grads[u] = out.unit_sharded_grads.get(u, 0) + padded * precision.grad_bytes
                out.unit_reduce_output[u] = out.unit_reduce_output.get(u, 0) + padded * precision.reduce_bytes
                out.unsharded_grad_by_param[p.name] = rnd(p.numel * precision.unsharded_bytes)
            continue
        # parameters whole on every rank (DDP, ZeRO-1, FSDP1 NO_SHARD) or a plugin's even split
        out.params += rnd(math.ceil(p.numel * precision.param_bytes / d_p))
        g = rnd(math.ceil(p.numel * precision.grad_bytes / d_g))
        out.grads += g
        out.grad_bytes_by_param[p.name] = g
        if zero1_owned is not None:
            if p.name in zero1_owned and k:
                out.optim += n_state * rnd(p.numel * k // n_state) + step
        elif k:
            out.optim += n_state * rnd(math.ceil(p.numel * k / d_o / n_state)) + step
            update_sizes.append(math.ceil(p.numel / d_o) * 4)
    if zero1_owned is not None:  # the rank's local optimizer holds its partition largest first
        update_sizes = [
            p.numel * 4
            for p in sorted(facts.params, key=lambda t: t.numel, reverse=True)
            if p.name in zero1_owned
        ]
    out.optim_temp = _update_temp_bytes(update_sizes, optimizer_update_temporaries(optimizer))
    if fsdp:
        for u, nbytes in list(out.unit_sharded_grads.items()):
            out.unit_sharded_grads[u] = rnd(nbytes)
    elif not sharding.grads and not uses_units:
        out.buckets = ddp_buckets(facts.params, precision.grad_bytes)
    return out


def _update_temp_bytes(sizes: list[int], per_param: int) -> int:
    """Largest temporaries of a per-parameter update loop (``foreach=False``): ``per_param`` tensors of
    the current parameter's size, plus the previous iteration's result still bound to its loop variable
    (Adam's ``denom``) until reassigned."""
    if not per_param or not sizes:
        return 0
    return max(per_param * cur + (prev if i else 0) for i, (prev, cur) in enumerate(zip([0, *sizes], sizes)))


def _rounder(device: str):
    if device == "cuda":
        return lambda nbytes: -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES if nbytes else 0
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
