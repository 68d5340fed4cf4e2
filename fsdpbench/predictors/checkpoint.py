"""Checkpoint terms, predicted per rank (modelled, beside the checkpoint phase's measurement):

- **bytes on disk**: the payload (every saved tensor's storage) plus the format's own bytes, laid out as
  the installed torch writes them (``torch_save_format``): one ``torch.save`` archive for ``full`` (rank
  0) and for ``sharded`` (every rank); for DCP every item is its own ``torch.save`` archive inside the
  rank's ``.distcp`` file, a replicated item written once, by the rank DCP's planner gives it to (the
  rank with the fewest bytes planned so far, ``dedup_save_plans``); DCP's ``.metadata`` file (rank 0) in
  ``dcp_metadata``; DeepSpeed's own files (``native``) in ``deepspeed_checkpoint``.
- **host memory the save adds** (RSS above the training baseline): what the method copies into host
  memory and holds. A full state dict gathers every sharded tensor into new memory and holds it on rank 0
  until written; a tensor already whole on the host (DDP on a CPU rank) is the state dict's entry itself.
  A sharded save or DCP writes the tensors where they are (one at a time when DCP copies a view); an async
  DCP save stages a copy of the rank's whole state first.
- **device transient while gathering** (GPU): one unit's unsharded parameters at a time for FSDP's full
  state dict, nothing for DDP's (already whole), nothing for sharded saves.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpbench.core.case import Case
from fsdpbench.core.numbers import numel
from fsdpbench.core.rundir import CHECKPOINT_DIR, NATIVE_TAG
from fsdpbench.predictors import dcp_metadata as dcp_md
from fsdpbench.predictors import torch_save_format as fmt
from fsdpbench.predictors.optimizer_state_dict import OPTIMIZER_STATE, PARAM_GROUP

if TYPE_CHECKING:
    from fsdpbench.strategies.base import Strategy

# torch.save names its records after the file's stem, or "archive" when it writes to a stream, as
# engine/checkpoint does for ``full`` and ``sharded`` (a file it created itself, no link followed)
SAVED_ARCHIVE = "archive"
SAVED_DTYPE = "float32"  # parameters and optimizer state are kept (and saved) in fp32 in every precision


@dataclass(kw_only=True)
class CheckpointPrediction:
    """One rank's predicted checkpoint terms (bytes)."""

    rank: int
    bytes: int  # this rank's files on disk
    payload_bytes: int  # the tensors' storages among them
    save_host_peak_bytes: int  # host memory the save adds on this rank
    device_transient_bytes: int  # device memory while gathering (GPU ranks)
    terms: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    unit: int


def _params(case: Case) -> tuple[list[_Param], int]:
    from fsdpbench.models.facts import get_model_facts

    facts = get_model_facts(
        case.model,
        case.model_args,
        wrap=case.wrap,
        wrap_min_params=case.wrap_min_params,
        wrap_classes=case.wrap_classes,
    )
    if not facts.known:
        raise ValueError(f"model {case.model!r}: parameter shapes unknown, no checkpoint prediction")
    return [_Param(p.name, p.shape, p.unit) for p in facts.params or ()], len(facts.units)


def _chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(rows this rank holds, rows of its padded chunk): torch.chunk along dim 0, as FSDP shards."""
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk)), chunk


def _local_shape(shape: tuple[int, ...], sharded: bool, world: int, rank: int) -> tuple[int, ...]:
    if not sharded or not shape:
        return shape
    return (_chunk_rows(shape[0], world, rank)[0], *shape[1:])


def _state_graph(
    case: Case,
    params: list[_Param],
    local: bool,
    world: int,
    rank: int,
    sharded: bool,
    padded_views: bool,
    gathered_padded: bool = False,
) -> dict[str, Any]:
    """A stand-in of the saved state dict (what ``torch_save_format`` pickles): the model's tensors by
    name, then (optionally) the optimizer's state by name and its param groups.

    ``gathered_padded``: a whole tensor is a view of its padded all-gather output (FSDP2's
    ``full_tensor`` of a dim-0 not divisible by the world size), whose storage torch.save writes whole."""

    def tensor(shape: tuple[int, ...], is_param: bool) -> fmt.Tensor:
        if not local and gathered_padded and sharded and shape:
            padded_rows = _chunk_rows(shape[0], world, 0)[1] * world
            return fmt.Tensor(SAVED_DTYPE, shape, fmt.Storage(SAVED_DTYPE, numel((padded_rows, *shape[1:]))))
        if not local or not sharded or not shape:
            return fmt.Tensor(SAVED_DTYPE, shape)
        rows, chunk = _chunk_rows(shape[0], world, rank)
        shard = (rows, *shape[1:])
        if is_param and padded_views:  # FSDP2's local shard views its padded chunk: torch.save writes it
            return fmt.Tensor(SAVED_DTYPE, shard, fmt.Storage(SAVED_DTYPE, numel((chunk, *shape[1:]))))
        return fmt.Tensor(SAVED_DTYPE, shard)

    graph: dict[str, Any] = {"model": {p.name: tensor(p.shape, True) for p in params}}
    if case.checkpoint_optimizer:
        state = {
            p.name: {
                name: fmt.Tensor(SAVED_DTYPE, ()) if scalar else tensor(p.shape, False)
                for name, scalar in OPTIMIZER_STATE.get(case.optimizer, ())
            }
            for p in params
        }
        group = {"lr": case.lr, **PARAM_GROUP.get(case.optimizer, {}), "params": [p.name for p in params]}
        graph["optim"] = {"state": state, "param_groups": [group]}
    return graph


def _flatten(graph: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str, tuple[str | int, ...], Any]]:
    """DCP's flatten_state_dict: (dotted key, path of keys, leaf); every mapping is walked, a list only when
    it holds a container or a tensor (a list of names or a tuple of floats is one item)."""
    if isinstance(graph, dict):
        return [item for k, v in graph.items() for item in _flatten(v, (*path, k))]
    if isinstance(graph, list) and any(isinstance(v, (dict, list, fmt.Tensor)) for v in graph):
        return [item for i, v in enumerate(graph) for item in _flatten(v, (*path, i))]
    return [(".".join(str(k) for k in path), path, graph)]


def _dcp_item_bytes(value: Any) -> tuple[int, int]:
    """(bytes in the .distcp file, payload) of one DCP item: a tensor or a pickled object, torch.saved."""
    return fmt.torch_save_bytes(value), fmt.payload_bytes(value)


def _dcp_plan(case: Case, params: list[_Param], sharded: bool) -> list[list[tuple[dcp_md.Item, int]]]:
    """Every rank's items (with their payload) in write order, as DCP's dedup_save_plans assigns them.

    It walks the items in first-seen order: rank 0's plan, then each next rank's items not seen before.
    An item one rank holds (its shard) stays with it and adds to its planned storage; an item several
    ranks hold goes to the one with the least storage planned so far, lowest rank on a tie. Every
    replicated item is in rank 0's plan, so all of them are placed while rank 0's is walked, when the
    other ranks' planned storage is only the replicated items they were given."""
    world = case.world_size
    out: list[list[tuple[dcp_md.Item, int]]] = [[] for _ in range(world)]
    others = [(0, r) for r in range(1, world)]  # (planned storage, rank), a heap
    planned0 = 0
    whole = {fqn: v for fqn, _, v in _flatten(_state_graph(case, params, False, world, 0, sharded, False))}

    def is_shard(value: Any) -> bool:
        return sharded and isinstance(value, fmt.Tensor) and bool(value.shape)

    def item(fqn: str, path: tuple[str | int, ...], value: Any, rank: int) -> tuple[dcp_md.Item, int]:
        nbytes, payload = _dcp_item_bytes(value)
        if not isinstance(value, fmt.Tensor):
            return dcp_md.Item(fqn, path, None, length=nbytes), payload
        shape = whole[fqn].shape
        first_row = rank * _chunk_rows(shape[0], world, rank)[1] if is_shard(value) else 0
        offsets = (first_row, *([0] * (len(shape) - 1))) if shape else ()
        return dcp_md.Item(fqn, path, shape, offsets, value.shape, nbytes), payload

    for fqn, path, value in _flatten(_state_graph(case, params, True, world, 0, sharded, padded_views=False)):
        size = value.nbytes if isinstance(value, fmt.Tensor) else 1
        if is_shard(value) or not others or planned0 <= others[0][0]:
            rank = 0
            planned0 += size
        else:
            planned, rank = heapq.heappop(others)
            heapq.heappush(others, (planned + size, rank))
        out[rank].append(item(fqn, path, value, rank))
    for rank in range(1, world):
        for fqn, path, value in _flatten(_state_graph(case, params, True, world, rank, sharded, False)):
            if is_shard(value):
                out[rank].append(item(fqn, path, value, rank))
    return out


def _dcp_bytes(case: Case, params: list[_Param], sharded: bool) -> tuple[list[tuple[int, int]], int]:
    """(file bytes, payload) per rank of the ``.distcp`` files, and rank 0's ``.metadata`` bytes."""
    plan = _dcp_plan(case, params, sharded)
    paths = [
        (fqn, path)
        for fqn, path, _ in _flatten(_state_graph(case, params, True, case.world_size, 0, sharded, False))
    ]
    metadata = dcp_md.metadata_bytes([[i for i, _ in items] for items in plan], paths, _checkpoint_path(case))
    return [(sum(i.length for i, _ in items), sum(p for _, p in items)) for items in plan], metadata


def _checkpoint_path(case: Case) -> Path:
    """The checkpoint directory as DCP records it in ``.metadata``, from the case's directory on (the run
    directory's own path, unknown here, adds its length in bytes: tens of bytes)."""
    return Path(case.case_id) / CHECKPOINT_DIR


def _rank_signature(params: list[_Param], world: int, rank: int, sharded: bool) -> tuple[int, ...]:
    """What a rank's local state depends on: the rows it holds of each parameter (ranks alike share it)."""
    if not sharded:
        return ()
    return tuple(_chunk_rows(p.shape[0], world, rank)[0] if p.shape else -1 for p in params)


def _sharded_host_terms(local_payload: int, on_gpu: bool, regathers: bool) -> dict[str, int]:
    """What a sharded state dict holds in host memory beyond the training state.

    FSDP2 (and DDP): the local tensors themselves on a CPU rank, nothing new; a copy of them from a GPU.
    FSDP1 (SHARDED_STATE_DICT and its sharded optimizer state dict): every parameter and every optimizer
    state is rebuilt from the unit's gathered flat tensor and this rank's ``torch.chunk`` of it cloned
    (``_shard_utils._create_chunk_sharded_tensor``): a new copy of the rank's local state."""
    if on_gpu or regathers:
        return {"sharded_state_dict_host": local_payload}
    return {}


def _fsdp1_flat_numel(params: list[_Param], unit: int, world: int) -> int:
    """A unit's padded unsharded FlatParameter, elements: with ``use_orig_params`` every parameter starts
    16-byte aligned (4 fp32 elements, ``FlatParamHandle``'s alignment padding), and the whole is padded
    to a multiple of the world size (``_padded_unsharded_size``)."""
    align = 16 // 4  # fp32 elements
    offset = 0
    for p in params:
        if p.unit == unit:
            offset = -(-offset // align) * align + numel(p.shape)
    return -(-offset // world) * world


def _fsdp1_gather_terms(
    params: list[_Param], world: int, rank: int, method: str, with_optim: bool
) -> dict[str, int]:
    """What FSDP1's state dicts add while a unit is gathered, on a CPU rank (gloo), beyond what they hold.

    Each unit's flat parameter (model) and then each of its flat optimizer states (one buffer,
    ``_allgather_orig_param_states``' ``gathered_tensor``, reused for every state name) is all-gathered
    whole; gloo's all-gather receives into a flat buffer of the output's size of its own
    (``ProcessGroupGloo``'s allgather: ``newLikeFlat``) and copies it out; the optimizer's gather also
    concatenates this rank's shard first (``torch.cat``, 1/N of the flat). The peak is at the last gather
    of the largest unit, before its own entries are cloned:

    - full, rank 0 (``rank0_only``): the whole state held but the unit's last entries, plus the gathered
      flat (P), the receive buffer (P) and with the optimizer the shard (P/N): above the full payload,
      P with the model only, P + P/N with the optimizer;
    - full, another rank: nothing held; 2P (model), 2P + P/N (optimizer);
    - sharded and DCP: the local state held (a 1/N clone of each entry) but the last chunk: 2P (+ P/N with
      the optimizer), less the last chunk not yet cloned (P/N)."""
    units = {p.unit for p in params}
    largest = max(units, key=lambda u: _fsdp1_flat_numel(params, u, world))
    flat = 4 * _fsdp1_flat_numel(params, largest, world)
    shard = flat // world
    terms = {
        "fsdp1_flat_gather_host": flat,
        "gloo_allgather_receive_host": flat,
        "fsdp1_flat_shard_host": shard if with_optim else 0,
    }
    if method == "full" and rank == 0:  # the unit's entries (of the state being gathered) not yet cloned
        terms["fsdp1_entries_not_yet_cloned_host"] = -4 * sum(
            numel(p.shape) for p in params if p.unit == largest
        )
    elif method != "full":
        terms["fsdp1_entries_not_yet_cloned_host"] = -shard
    return terms


def _fsdp1_freed_grad_bytes(params: list[_Param], world: int) -> int:
    """This rank's sharded flat gradients, which an FSDP1 state dict frees before it gathers anything.

    With ``use_orig_params=True``, ``zero_grad(set_to_none=True)`` frees the original parameters'
    gradients but not each ``FlatParameter``'s sharded ``.grad`` (the unit's padded flat / N), which lives
    until ``_reset_flat_param_grad_info_if_needed`` (torch 2.13, ``fsdp/_flat_param.py``): the state-dict
    pre-hook calls it at the root (``_common_pre_state_dict_hook``), as ``FSDP.optim_state_dict`` does. The
    memory was resident when the phase's baseline was read; on a CPU rank it is host memory, released."""
    return sum(4 * _fsdp1_flat_numel(params, u, world) // world for u in {p.unit for p in params})


def _zero1_partitions(params: list[_Param], world: int) -> list[list[_Param]]:
    """ZeroRedundancyOptimizer's partition of the parameters (``_partition_parameters``): largest first
    (a stable sort by numel), each to the rank with the fewest elements so far, the lowest on a tie."""
    parts: list[list[_Param]] = [[] for _ in range(world)]
    sizes = [0] * world
    for p in sorted(params, key=lambda q: numel(q.shape), reverse=True):
        rank = sizes.index(min(sizes))
        parts[rank].append(p)
        sizes[rank] += numel(p.shape)
    return parts


def _zero1_consolidation_terms(case: Case, params: list[_Param], rank: int) -> dict[str, int]:
    """What ``consolidate_state_dict(to=0)`` adds in host memory (CPU ranks, gloo).

    Rank by rank, the partition's owner ``torch.save``s its optimizer state dict into a BytesIO (S bytes),
    copies it into a bytearray (S) and that into a ``torch.ByteTensor`` (S), and broadcasts it
    (``_broadcast_object``); the legacy constructor reads the bytearray as a sequence of Python ints
    through an 8-byte-per-element tensor first (8S, measured: 11S at its peak): 11S on the sender.
    Rank 0 receives it into a new uint8 tensor (S), wraps it in a BytesIO, which copies
    it (S), and ``torch.load``s it: the partition's tensors (O, kept in ``_all_state_dicts`` until the
    state dict is saved). Rank 0's peak is at the end of a load: the partitions loaded before it, plus
    2S + O of that one; its own partition is its optimizer's state itself (no copy on a CPU rank)."""
    world = case.world_size
    state = OPTIMIZER_STATE.get(case.optimizer, ())
    group = {"lr": case.lr, **PARAM_GROUP.get(case.optimizer, {})}

    def partition_state(part: list[_Param]) -> dict[str, Any]:
        return {
            "state": {
                i: {n: fmt.Tensor(SAVED_DTYPE, () if scalar else p.shape) for n, scalar in state}
                for i, p in enumerate(part)
            },
            "param_groups": [{**group, "params": list(range(len(part)))}],
        }

    parts = [partition_state(part) for part in _zero1_partitions(params, world)]
    serialized = [fmt.torch_save_bytes(part) for part in parts]
    if rank != 0:
        return {"zero1_partition_serialized_host": 11 * serialized[rank]}
    loaded, peak = 0, 0
    for r in range(1, world):
        peak = max(peak, loaded + 2 * serialized[r] + fmt.payload_bytes(parts[r]))
        loaded += fmt.payload_bytes(parts[r])
    return {"zero1_partitions_loaded_host": loaded, "zero1_partition_received_host": peak - loaded}


def predict_checkpoint(case: Case, strategy: Strategy) -> list[CheckpointPrediction]:
    """Every rank's checkpoint terms for the case's method (empty for ``checkpoint: none``)."""
    if case.checkpoint == "none":
        return []
    params, _ = _params(case)
    if case.checkpoint == "native":
        return _predict_native(case, strategy, params)
    save = _Save.of(case, strategy, params)
    rank_prediction = {"full": _full_rank, "sharded": _sharded_rank}.get(case.checkpoint, _dcp_rank)
    return [rank_prediction(save, rank) for rank in range(case.world_size)]


@dataclass(kw_only=True)
class _Save:
    """What every rank's terms of one save read: the case, its parameters, and what the strategy's
    state dict gathers."""

    case: Case
    params: list[_Param]
    world: int
    sharded: bool  # the parameters are sharded at rest
    regathers: bool  # FSDP1: state dicts built from gathered flat parameters, a unit at a time
    zero1: bool  # ZeroRedundancyOptimizer: the optimizer state consolidated on rank 0
    on_gpu: bool
    full_graph: Any  # the full state dict's structure
    full_payload: int
    largest_unit: int  # bytes of the largest unit's parameters
    gather_transient: int  # what FSDP2's gathering adds while it runs
    freed_grad: int  # FSDP1's sharded flat gradients, freed before a state dict gathers
    dcp_files: (
        tuple[list[tuple[int, int]], int] | None
    )  # DCP: each rank's (bytes, payload), .metadata's bytes
    local: dict[tuple[Any, ...], tuple[int, int, int, int]] = field(default_factory=dict)  # ranks alike once

    @classmethod
    def of(cls, case: Case, strategy: Strategy, params: list[_Param]) -> _Save:
        world = case.world_size
        sharded = strategy.sharding.params
        # FSDP1 builds its full and its sharded state dicts from gathered flat parameters, a unit at a time
        # (``_fsdp1_gather_terms``)
        checkpointing = strategy.checkpointing
        regathers = checkpointing.gathers == "flat_parameters" and sharded
        zero1 = checkpointing.optimizer_consolidation == "to_rank0"  # ZeroRedundancyOptimizer
        full_graph = _state_graph(
            case,
            params,
            False,
            world,
            0,
            sharded,
            padded_views=False,
            gathered_padded=checkpointing.gathers == "padded_tensors",
        )
        unit_bytes: dict[int, int] = {}
        for p in params:
            unit_bytes[p.unit] = unit_bytes.get(p.unit, 0) + numel(p.shape) * 4
        largest_tensor = max((numel(p.shape) * 4 for p in params), default=0)
        # without use_orig_params the optimizer's zero_grad(set_to_none) frees the flat gradient itself
        orig_params = bool(case.strategy_args.get("use_orig_params", True))
        return cls(
            case=case,
            params=params,
            world=world,
            sharded=sharded,
            regathers=regathers,
            zero1=bool(zero1),
            on_gpu=case.device == "cuda",
            full_graph=full_graph,
            full_payload=fmt.payload_bytes(full_graph),
            largest_unit=max(unit_bytes.values(), default=0),
            # gloo's receive buffer of one DTensor's full tensor
            gather_transient=largest_tensor if sharded else 0,
            freed_grad=_fsdp1_freed_grad_bytes(params, world) if regathers and orig_params else 0,
            dcp_files=_dcp_bytes(case, params, sharded) if case.checkpoint in ("dcp", "dcp_async") else None,
        )

    def local_terms(self, rank: int) -> tuple[int, int, int, int]:
        """(local payload, its model part, the sharded file's payload and bytes) of a rank."""
        case, params, world, sharded = self.case, self.params, self.world, self.sharded
        key = (_rank_signature(params, world, rank, sharded), len(str(rank)))
        if key not in self.local:
            graph = _state_graph(case, params, True, world, rank, sharded, padded_views=True)
            unpadded = _state_graph(case, params, True, world, rank, sharded, padded_views=False)
            saved = fmt.torch_save_bytes(graph, SAVED_ARCHIVE) if case.checkpoint == "sharded" else 0
            self.local[key] = (
                fmt.payload_bytes(unpadded),
                fmt.payload_bytes(unpadded["model"]),
                fmt.payload_bytes(graph),
                saved,
            )
        return self.local[key]

    def fsdp1_gather_terms(self, rank: int, method: str) -> dict[str, int]:
        """FSDP1's host terms of gathering flat parameters on a CPU rank (none otherwise)."""
        if not self.regathers or self.on_gpu:
            return {}
        terms = _fsdp1_gather_terms(self.params, self.world, rank, method, self.case.checkpoint_optimizer)
        terms["fsdp1_flat_grad_freed_host"] = -self.freed_grad
        return terms


def _prediction(
    rank: int, nbytes: int, payload: int, terms: dict[str, int], device: int
) -> CheckpointPrediction:
    return CheckpointPrediction(
        rank=rank,
        bytes=nbytes,
        payload_bytes=payload,
        save_host_peak_bytes=sum(terms.values()),
        device_transient_bytes=device,
        terms=terms,
    )


def _full_rank(save: _Save, rank: int) -> CheckpointPrediction:
    """A full state dict, gathered and saved by rank 0."""
    case, sharded, on_gpu = save.case, save.sharded, save.on_gpu
    nbytes = fmt.torch_save_bytes(save.full_graph, SAVED_ARCHIVE) if rank == 0 else 0
    payload = save.full_payload if rank == 0 else 0
    # gathered shards are new memory; a whole tensor already on the host is its own entry
    held = save.full_payload if (sharded or on_gpu) else 0
    terms = {"full_state_dict_host": held if rank == 0 else 0}
    if save.regathers and not on_gpu:
        terms.update(save.fsdp1_gather_terms(rank, "full"))
    else:
        terms["gather_transient_host"] = 0 if on_gpu else save.gather_transient
    if save.zero1 and case.checkpoint_optimizer and not on_gpu:
        terms.update(_zero1_consolidation_terms(case, save.params, rank))
    if sharded and not save.regathers and rank != 0 and not on_gpu:
        # the other ranks drop each gathered tensor as soon as it is gathered (torch 2.13's
        # _state_dict_utils._iterate_state_dict: a rank not in ranks_only=(0,) returns None for
        # the leaf): the tensor being gathered is all they hold, beside gloo's receive buffer
        terms["other_rank_gathered_tensor_host"] = save.gather_transient
    device = save.largest_unit if (sharded and on_gpu) else 0
    return _prediction(rank, nbytes, payload, terms, device)


def _sharded_rank(save: _Save, rank: int) -> CheckpointPrediction:
    """Each rank's local state dict in its own torch.save archive."""
    local_payload, _, sharded_payload, sharded_bytes = save.local_terms(rank)
    terms = _sharded_host_terms(local_payload, save.on_gpu, save.regathers)
    terms.update(save.fsdp1_gather_terms(rank, "sharded"))
    return _prediction(rank, sharded_bytes, sharded_payload, terms, 0)


def _dcp_rank(save: _Save, rank: int) -> CheckpointPrediction:
    """DCP (``dcp``, ``dcp_async``): the rank's ``.distcp`` file, and rank 0's ``.metadata``."""
    case = save.case
    local_payload = save.local_terms(rank)[0]
    assert save.dcp_files is not None
    files, metadata = save.dcp_files
    nbytes, payload = files[rank]
    nbytes += metadata if rank == 0 else 0  # DCP's coordinator writes .metadata
    terms = {"dcp_staged_copy_host": local_payload if case.checkpoint == "dcp_async" else 0}
    if case.checkpoint == "dcp":
        terms.update(_sharded_host_terms(local_payload, save.on_gpu, save.regathers))
    terms.update(save.fsdp1_gather_terms(rank, "dcp"))
    return _prediction(rank, nbytes, payload, terms, 0)


def _predict_native(case: Case, strategy: Strategy, params: list[_Param]) -> list[CheckpointPrediction]:
    """The engine's own checkpoint (DeepSpeed's ``save_checkpoint``, ``predictors/deepspeed_checkpoint``).
    Host memory: on a CPU rank the state dicts are the engine's own tensors (views of its flat buffers and
    partitions), written where they are: nothing new; from a GPU every saved byte is a host copy."""
    from fsdpbench.predictors import deepspeed_checkpoint as ds

    flat = strategy.flat_buffers(case)
    if flat is None:
        raise ValueError(f"checkpoint=native: {strategy.name} has no engine checkpoint modelled")
    shapes = [(p.name, p.shape) for p in params]
    preds = []
    for rank in range(case.world_size):
        files = ds.native_files(case, shapes, flat.stage, rank, NATIVE_TAG)
        host = files.payload if case.device == "cuda" else 0
        preds.append(
            CheckpointPrediction(
                rank=rank,
                bytes=files.total,
                payload_bytes=files.payload,
                save_host_peak_bytes=host,
                device_transient_bytes=0,
                terms={"native_state_dict_host": host},
            )
        )
    return preds


def check_checkpoint(case: Case, strategy: Strategy) -> str | None:
    """Why the case's checkpoint phase cannot run (a sentence), or None: an emulated case, or files
    predicted larger than ``checkpoint_max_bytes``."""
    if case.checkpoint == "none":
        return None
    if case.emulate:
        return "checkpoint: an emulated rank runs alone with a fake process group; checkpoint a real case"
    try:
        total = sum(p.bytes for p in predict_checkpoint(case, strategy))
    except ValueError:
        return None  # shapes unknown: nothing to refuse on
    if total > case.checkpoint_max_bytes:
        return (
            f"checkpoint={case.checkpoint} would write {total:,} bytes (predicted), over "
            f"checkpoint_max_bytes={case.checkpoint_max_bytes:,}; raise it to run this case"
        )
    return None


def checkpoint_columns(case: Case, rows: Any) -> dict[str, list[Any]]:
    """The pred_ckpt_* columns beside each rank's measured checkpoint row (none without a checkpoint)."""
    from fsdpbench.core import schema
    from fsdpbench.core.numbers import relative_error
    from fsdpbench.strategies import get_strategy

    if case.checkpoint == "none" or schema.RANK not in rows:
        return {}
    try:
        preds = {p.rank: p for p in predict_checkpoint(case, get_strategy(case.strategy))}
    except ValueError:  # shapes or the format not modelled (e.g. DeepSpeed's bf16 files): no columns
        return {}
    out: dict[str, list[Any]] = {
        name: []
        for name in (
            schema.PRED_CKPT_BYTES,
            schema.PRED_CKPT_PAYLOAD_BYTES,
            schema.PRED_CKPT_HOST_PEAK,
            schema.PRED_CKPT_DEVICE_TRANSIENT,
            schema.PRED_CKPT_BYTES_ERR,
            schema.PRED_CKPT_HOST_PEAK_ERR,
        )
    }
    for i in range(len(rows)):
        row = rows.iloc[i]
        pred = preds.get(int(row[schema.RANK]))
        measured_bytes = row.get(schema.CKPT_BYTES)
        measured_host = row.get(schema.CKPT_SAVE_HOST_PEAK)
        out[schema.PRED_CKPT_BYTES].append(pred.bytes if pred else None)
        out[schema.PRED_CKPT_PAYLOAD_BYTES].append(pred.payload_bytes if pred else None)
        out[schema.PRED_CKPT_HOST_PEAK].append(pred.save_host_peak_bytes if pred else None)
        out[schema.PRED_CKPT_DEVICE_TRANSIENT].append(pred.device_transient_bytes if pred else None)
        out[schema.PRED_CKPT_BYTES_ERR].append(
            relative_error(pred.bytes, measured_bytes) if pred and measured_bytes else None
        )
        out[schema.PRED_CKPT_HOST_PEAK_ERR].append(
            relative_error(pred.save_host_peak_bytes, measured_host) if pred and measured_host else None
        )
    return out
