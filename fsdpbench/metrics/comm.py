"""Communication volume per step, rank and collective kind, from a profiler trace; and the analytic volume.

Kinds: all_gather, reduce_scatter, all_reduce, broadcast, other.

**Bytes.** S ("payload_bytes") is the size of the full, unsharded tensor: the
all-gather output, the reduce-scatter input, the all-reduced or broadcast
tensor. "sent_bytes" is what each rank sends under the ring algorithm, the
nccl-tests convention for bus bandwidth, N the group size:

    all_reduce                2(N-1)/N · S
    all_gather, reduce_scatter (N-1)/N · S
    broadcast                  (N-1)/N · S   (see below)
    other                           S      (upper bound; alltoall, send/recv, ...)

A broadcast puts (N-1)·S on the wire whatever the algorithm (every non-root
rank must receive S), but who sends it depends on the algorithm: gloo's root
sends all of it, NCCL's ring pipeline has N-1 ranks forward S each. We report
the per-rank mean, (N-1)/N · S, so that it is independent of root and
algorithm and sums correctly over ranks. (nccl-tests' busbw factor for
broadcast is 1: that is the rate on the busiest link, not bytes per rank.)

"backend_sent_bytes" is the same under the algorithm the backend really runs.
It differs from sent_bytes in one place: gloo has no reduce-scatter, it clones
the input, all-reduces the full tensor and keeps its chunk
(``ProcessGroupGloo::reduce_scatter_tensor_coalesced``; the trace shows a
``gloo:all_reduce`` of the full input under each ``c10d::_reduce_scatter_base_``),
so on gloo a reduce-scatter costs 2(N-1)/N · S.

**Where the numbers come from.** Two sources in torch 2.13's traces:

* NCCL: ``record_param_comms`` events carry "Collective name", "dtype",
  "In msg nelems", "Out msg nelems", "Group size" (the fields torch's own
  profiler tests and trace validator require; not run on a GPU here);
  S = max(in, out) elements. ``wait`` records are skipped, and kernels that
  carry a copy of these args are not counted twice.
* gloo (inspected on real 2-rank runs of DDP, ZeroRedundancyOptimizer, FSDP2
  and FSDP1): there is no ``record_param_comms``. The issuing thread records a
  ``c10d::<op>`` cpu_op with "Input Dims" and "Input type" (when the profiler
  runs with ``record_shapes=True``, which is required): ``c10d::allreduce_`` (TensorList; DDP's
  buckets), ``c10d::broadcast_`` (TensorList; ZeroRedundancyOptimizer),
  ``c10d::_allgather_base_`` / ``c10d::_reduce_scatter_base_`` (output, input;
  FSDP2), ``c10d::allgather_`` (FSDP1 on gloo, output list not recorded) and
  the coalesced variants. S comes from the dims; the dtype from "Input type",
  or for TensorList arguments (whose type is not recorded) from the matching
  ``gloo:<op>`` event on the gloo thread, which has the same dims and a type.
  The group size comes from the dims where output/input differ by N
  (``_allgather_base_``, ``_reduce_scatter_base_``, ``*_into_tensor_coalesced_``,
  ``reduce_scatter_tensor_coalesced_``); otherwise it is ``group_size``
  (default: the world size in the trace's "distributedInfo"). This is wrong for
  all-reduces and list all-gathers over a subgroup, e.g. HSDP's replicate
  group: pass ``group_size`` there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdpbench.core.numbers import numel
from fsdpbench.metrics.trace import Trace

if TYPE_CHECKING:
    import pandas as pd

    from fsdpbench.strategies.base import Sharding

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "other")

# Element size by the names the profiler uses: C++ type names in "Input type"
# (gloo/c10d events) and ScalarType names in record_param_comms' "dtype".
DTYPE_BYTES: dict[str, int] = {
    "float": 4,
    "double": 8,
    "c10::half": 2,
    "c10::bfloat16": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
    "c10::complex<float>": 8,
    "c10::complex<double>": 16,
    "short unsigned int": 2,
    "unsigned int": 4,
    "long unsigned int": 8,
    "c10::float8_e4m3fn": 1,
    "c10::float8_e5m2": 1,
    "c10::float8_e4m3fnuz": 1,
    "c10::float8_e5m2fnuz": 1,
    # ScalarType names (record_param_comms)
    "half": 2,
    "bfloat16": 2,
    "long": 8,
    "short": 2,
    "char": 1,
    "byte": 1,
    "complexfloat": 8,
    "complexdouble": 16,
    "complexhalf": 4,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}


def dtype_bytes(name: str) -> int | None:
    """Bytes per element of a dtype as the profiler names it, or None if unknown."""
    return DTYPE_BYTES.get(name.strip().lower())


def collective_kind(name: str) -> str:
    """Kind of a c10d op or NCCL "Collective name" (e.g. c10d::_allgather_base_ -> all_gather)."""
    key = name.lower().replace("c10d::", "").replace("_", "")
    if "allreduce" in key:
        return "all_reduce"
    if "reducescatter" in key:
        return "reduce_scatter"
    if "allgather" in key:
        return "all_gather"
    if "broadcast" in key:
        return "broadcast"
    return "other"


def sent_bytes_per_rank(kind: str, payload_bytes: float, group_size: int) -> float:
    """Bytes one rank sends for one collective of ``kind`` on S bytes (convention above)."""
    n = int(group_size)
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * payload_bytes
    if kind in ("all_gather", "reduce_scatter", "broadcast"):
        return (n - 1) / n * payload_bytes
    if kind == "other":
        return float(payload_bytes)
    raise ValueError(f"unknown collective kind {kind!r}; allowed: {KINDS}")


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    """One collective call as seen in a trace."""

    name: str
    kind: str
    ts_us: float
    numel: int  # elements of S, the full tensor
    dtype: str
    elem_bytes: int
    group_size: int
    source: str  # "record_param_comms" or "c10d"
    backend_kind: str  # what the backend really runs (gloo: reduce_scatter -> all_reduce)
    dur_us: float | None = None  # gloo: the span of the gloo:* work this call ran (None: not in the trace)

    @property
    def payload_bytes(self) -> int:
        """S in bytes."""
        return self.numel * self.elem_bytes

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sends under the ring convention for ``kind``."""
        return sent_bytes_per_rank(self.kind, self.payload_bytes, self.group_size)

    @property
    def backend_sent_bytes(self) -> float:
        """Bytes this rank sends under the algorithm the backend runs."""
        return sent_bytes_per_rank(self.backend_kind, self.payload_bytes, self.group_size)


# -- shapes in "Input Dims" ---------------------------------------------------
def _is_list_of_shapes(dims: Any) -> bool:
    return isinstance(dims, list) and bool(dims) and all(isinstance(d, list) for d in dims)


def _arg_numel(dims: Any, type_name: str) -> int | None:
    """Elements of one recorded argument: a Tensor's shape or a TensorList's shapes; None if unrecorded."""
    if type_name == "TensorList" or _is_list_of_shapes(dims):
        return sum(numel(s) for s in dims) if isinstance(dims, list) else None
    if isinstance(dims, list) and type_name and dtype_bytes(type_name) is not None:
        return numel(dims)
    return None


# -- NCCL: record_param_comms ---------------------------------------------------
def _records_from_param_comms(events: list[dict[str, Any]]) -> list[CollectiveRecord]:
    records = []
    for e in events:
        args = e.get("args") or {}
        coll = str(args.get("Collective name", ""))
        if e.get("name") != "record_param_comms" or not coll or coll == "wait":
            continue
        kind = collective_kind(coll)
        numel = max(int(args.get("In msg nelems", 0) or 0), int(args.get("Out msg nelems", 0) or 0))
        if coll == "barrier":
            numel = 0
        dtype = str(args.get("dtype", ""))
        records.append(
            CollectiveRecord(
                name=coll,
                kind=kind,
                ts_us=float(e.get("ts", 0.0)),
                numel=numel,
                dtype=dtype,
                elem_bytes=dtype_bytes(dtype) or 0,
                group_size=int(args.get("Group size", 1) or 1),
                source="record_param_comms",
                backend_kind=kind,
            )
        )
    return records


# -- gloo: c10d:: ops, dtype completed from gloo:* events -----------------------------
# op name -> (index of the recorded argument that gives S, how S follows from it):
#   "full": the argument is S; "shard": S = argument × N (the other list is not recorded);
#   "gather_out_in"/"scatter_out_in": (output, input) both recorded, N = larger / smaller;
#   "zero": no payload (barriers). The gloo:* event of an op carries its *input* dims.
_C10D_LAYOUT: dict[str, tuple[int, str]] = {
    "c10d::allreduce_": (0, "full"),
    "c10d::allreduce_coalesced_": (0, "full"),
    "c10d::broadcast_": (0, "full"),
    "c10d::_allgather_base_": (0, "gather_out_in"),
    "c10d::allgather_into_tensor_coalesced_": (0, "gather_out_in"),
    "c10d::allgather_": (1, "shard"),
    "c10d::allgather_coalesced_": (1, "shard"),
    "c10d::_reduce_scatter_base_": (1, "scatter_out_in"),
    "c10d::reduce_scatter_tensor_coalesced_": (1, "scatter_out_in"),
    "c10d::reduce_scatter_": (0, "shard"),
    "c10d::alltoall_base_": (1, "full"),
    "c10d::alltoall_": (1, "full"),
    "c10d::send": (0, "full"),
    "c10d::recv_": (0, "full"),
    "c10d::recv_any_source_": (0, "full"),
    "c10d::reduce_": (0, "full"),
    "c10d::gather_": (1, "full"),
    "c10d::scatter_": (0, "full"),
    "c10d::barrier": (0, "zero"),
    "c10d::monitored_barrier_": (0, "zero"),
}


def _nested_in_same_thread(events: list[dict[str, Any]]) -> set[int]:
    """Indices of events that start inside another event of the list on the same thread."""
    nested: set[int] = set()
    outer_end: dict[tuple[Any, Any], float] = {}
    order = sorted(range(len(events)), key=lambda i: (float(events[i]["ts"]), -float(events[i]["dur"])))
    for i in order:
        e = events[i]
        key = (e.get("pid"), e.get("tid"))
        start = float(e["ts"])
        if start < outer_end.get(key, float("-inf")):
            nested.add(i)
        else:
            outer_end[key] = start + float(e["dur"])
    return nested


def _backend_event_numel(e: dict[str, Any]) -> int:
    dims = (e.get("args") or {}).get("Input Dims") or []
    return sum(numel(s) for s in dims if isinstance(s, list))


def _backend_event_dtype(e: dict[str, Any]) -> str:
    types = (e.get("args") or {}).get("Input type") or []
    return next((str(t) for t in types if dtype_bytes(str(t)) is not None), "")


def _c10d_sizes(name: str, args: dict[str, Any], group_size: int) -> tuple[int, int, int, str]:
    """(numel of S, group size, numel of the gloo:* event's input, dtype or "") of one c10d op."""
    dims = args.get("Input Dims") or []
    types = [str(t) for t in (args.get("Input type") or [])]

    def numel_of(k: int) -> int:
        if k >= len(dims):
            return 0
        return _arg_numel(dims[k], types[k] if k < len(types) else "") or 0

    arg_index, relation = _C10D_LAYOUT.get(name, (0, "full"))
    arg = numel_of(arg_index)
    dtype = next((t for t in types if dtype_bytes(t) is not None), "")
    if relation == "zero":
        return 0, group_size, 0, dtype
    if relation == "shard":  # only the shard-sized list is recorded
        return arg * group_size, group_size, arg, dtype
    if relation in ("gather_out_in", "scatter_out_in"):
        out_numel, in_numel = numel_of(0), numel_of(1)
        small = in_numel if relation == "gather_out_in" else out_numel
        n = max(out_numel, in_numel) // small if small > 0 else group_size
        return arg, n, in_numel, dtype  # gloo works on the input: the shard, or the full RS input
    return arg, group_size, arg, dtype


def _records_from_c10d(
    trace: Trace, group_size: int, assumed_dtype: str, is_gloo: bool
) -> list[CollectiveRecord]:
    ops = _c10d_collective_ops(trace)
    nested = _nested_in_same_thread(ops)
    pairing = _BackendPairing(sorted(trace.gloo_work, key=lambda e: float(e["ts"])))
    records = []
    for i, e in sorted(enumerate(ops), key=lambda p: float(p[1]["ts"])):
        if i in nested:  # e.g. a c10d op issued from inside another one: count the outer call
            continue
        records.append(_record_of_c10d_op(e, group_size, assumed_dtype, is_gloo, pairing))
    return records


def _c10d_collective_ops(trace: Trace) -> list[dict[str, Any]]:
    """The trace's c10d:: CPU ops that are collectives (a known layout or a recognised kind)."""
    ops = [
        e for e in trace.events if e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith("c10d::")
    ]
    return [e for e in ops if e["name"] in _C10D_LAYOUT or collective_kind(e["name"]) != "other"]


class _BackendPairing:
    """The gloo:* events of a trace in start order, each paired with at most one c10d op."""

    def __init__(self, backend_events: list[dict[str, Any]]) -> None:
        self.events = backend_events
        self.used: set[int] = set()

    def take(self, op: dict[str, Any], backend_kind: str, backend_numel: int) -> dict[str, Any] | None:
        """The first unused gloo:* event of the same kind and size that starts after ``op``."""
        for j, b in enumerate(self.events):
            if j in self.used or float(b["ts"]) < float(op["ts"]):
                continue
            if collective_kind(str(b["name"])[len("gloo:") :]) != backend_kind:
                continue
            if backend_kind != "other" and _backend_event_numel(b) != backend_numel:
                continue
            self.used.add(j)
            return b
        return None


def _record_of_c10d_op(
    e: dict[str, Any], group_size: int, assumed_dtype: str, is_gloo: bool, pairing: _BackendPairing
) -> CollectiveRecord:
    name = str(e["name"])
    args = e.get("args") or {}
    if "Input Dims" not in args:
        raise ValueError(f"{name} at ts={e['ts']} has no 'Input Dims': profile with record_shapes=True")
    kind = collective_kind(name)
    # gloo has no reduce-scatter: it all-reduces the full input and keeps its chunk
    backend_kind = "all_reduce" if is_gloo and kind == "reduce_scatter" else kind
    numel, n, gloo_numel, dtype = _c10d_sizes(name, args, group_size)
    backend_event = pairing.take(e, backend_kind, gloo_numel)
    dur_us = None
    if backend_event is not None:
        dtype = dtype or _backend_event_dtype(backend_event)
        dur_us = float(backend_event["dur"])
    dtype = dtype or assumed_dtype
    return CollectiveRecord(
        name=name,
        kind=kind,
        ts_us=float(e["ts"]),
        numel=numel,
        dtype=dtype,
        elem_bytes=dtype_bytes(dtype) or 0,
        group_size=n,
        source="c10d",
        backend_kind=backend_kind,
        dur_us=dur_us,
    )


def collective_records(
    trace: Trace | dict[str, Any], group_size: int | None = None, assumed_dtype: str = "float"
) -> list[CollectiveRecord]:
    """Every collective in the trace, one record per call, from record_param_comms or else c10d:: ops;
    read once per trace and kept in it.

    ``group_size`` overrides N where the event does not give it (default: the
    trace's world size); ``assumed_dtype`` is used when neither the op nor a
    matching ``gloo:*`` event names the dtype (e.g. the work ran after the
    profiler stopped).
    """
    trace = Trace.of(trace)
    key = (group_size, assumed_dtype)
    if key not in trace.collective_records:
        trace.collective_records[key] = _read_records(trace, group_size, assumed_dtype)
    return list(trace.collective_records[key])


def _read_records(trace: Trace, group_size: int | None, assumed_dtype: str) -> list[CollectiveRecord]:
    param_comms = [
        e
        for e in trace.events
        if e.get("name") == "record_param_comms" and "Collective name" in (e.get("args") or {})
    ]
    if param_comms:
        return _records_from_param_comms(param_comms)
    n = group_size if group_size is not None else trace.world_size
    is_gloo = "gloo" in (trace.backend or "") or bool(trace.gloo_work)
    return _records_from_c10d(trace, n, assumed_dtype, is_gloo)


def collectives_from_trace(
    trace: Trace | dict[str, Any], steps: int = 1, group_size: int | None = None
) -> pd.DataFrame:
    """Per collective kind, per step: count, payload_bytes (S summed), sent_bytes, backend_sent_bytes."""
    import pandas as pd

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    totals = {k: [0, 0, 0.0, 0.0] for k in KINDS}
    for r in collective_records(trace, group_size=group_size):
        t = totals[r.kind]
        t[0] += 1
        t[1] += r.payload_bytes
        t[2] += r.sent_bytes
        t[3] += r.backend_sent_bytes
    rows = [
        {
            "kind": k,
            "count": c / steps,
            "payload_bytes": p / steps,
            "sent_bytes": s / steps,
            "backend_sent_bytes": b / steps,
        }
        for k, (c, p, s, b) in totals.items()
    ]
    return pd.DataFrame(rows, columns=["kind", "count", "payload_bytes", "sent_bytes", "backend_sent_bytes"])


# -- analytic ------------------------------------------------------------------------
def analytic_comm_bytes(
    sharding: Sharding,
    param_bytes_total: int,
    world_size: int,
    *,
    grad_bytes_total: int | None = None,
    shard_size: int | None = None,
) -> dict[str, float]:
    """Bytes each rank sends per step, per collective kind, for a strategy's declared ``Sharding``: the sum
    over its ``collectives()``, phase by phase.

    P = param_bytes_total (bytes of the parameters as communicated), G =
    grad_bytes_total (default P; differs under mixed precision), N = the group
    the states are sharded over (the world, or the shard group of ``shard_size``),
    f = (N-1)/N:

    - the parameters are all-gathered ``param_gathers`` times: f·P each (FSDP with
      ``reshard_after_forward=True`` gathers in forward and again in backward, 2f·P;
      ZeRO-2 / ``reshard_after_forward=False`` once);
    - the gradients are all-reduced, 2f·G (DDP), or reduce-scattered, f·G (sharded gradients);
    - after the optimizer step, ``param_sync_after_step`` spreads the parameters each rank
      updated: torch's ZeroRedundancyOptimizer broadcasts them (``_sync_params``: one
      ``broadcast`` per parameter, or per bucket), P in total, f·P per rank. So ZeRO-1 sends
      1.5× DDP, unlike the ZeRO paper's P_os (reduce-scatter + all-gather, 1× DDP); ZeRO-3
      also sends 1.5× DDP;
    - over a shard group (HSDP: N_s = ``shard_size``, R = world_size/N_s replicas), each
      gradient shard (G/N_s) is then all-reduced across the replicas.
    """
    n = int(world_size)
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    p = float(param_bytes_total)
    g = float(grad_bytes_total if grad_bytes_total is not None else param_bytes_total)
    out = {k: 0.0 for k in KINDS}
    if sharding.over_shard_group:
        if shard_size is None or shard_size < 1 or n % shard_size:
            raise ValueError(f"sharding over a shard group needs shard_size dividing {n}, got {shard_size}")
        n = shard_size
    payload = {"params": p, "grads": g, "grad_shard": g / n}
    group = {"shard": n, "replicas": int(world_size) // n}
    for c in sharding.collectives():
        out[c.kind] += sent_bytes_per_rank(c.kind, payload[c.payload], group[c.group])
    return out
