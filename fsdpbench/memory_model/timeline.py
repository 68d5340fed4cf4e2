"""When the peak happens: walk one training step (forward, backward, optimizer step) stage by stage
and add up what is alive at each moment, by category, as PyTorch's memory trackers count it.

The step is the worker's: batch → forward → loss → backward → optimizer.step → zero_grad(set_to_none),
after a warm-up, so optimizer state exists and gradients start freed. What is alive:

- always: resident params (+ padding) and optimizer state; the batch;
- activations saved up to the current stage (``activations.py``), gradient temporaries of the stage;
- replicated gradients (DDP/ZeRO-1) as they are produced, and DDP's gradient buckets: a bucket is
  allocated at construction but PyTorch's tracker only counts it from the first time backward copies a
  gradient into it (it is device memory from the start: see ``untracked_bytes``);
- FSDP: the root unit's parameters stay unsharded through forward and backward (resharded between:
  the loss runs outside the root module); a unit is all-gathered (all-gather output, then copied out to
  its unsharded parameters) at its pre-forward/pre-backward; forward prefetch keeps the next
  ``prefetch`` units' all-gather outputs in flight, backward prefetch the previous ``max(1, prefetch)``
  (FSDP2 prefetches one unit in backward implicitly); a unit's unsharded gradients live until its
  post-backward, whose reduce-scatter input is held until the next unit's post-backward; the root's
  post-backward runs last. ZeRO-2 (``params_unsharded_fwd_to_bwd``) keeps every unit unsharded from its
  forward until its post-backward;
- optimizer step: all gradients plus the update's temporaries for one parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdpbench.memory_model.activations import ActivationProfile, Stage
from fsdpbench.memory_model.facts import ModelFacts
from fsdpbench.memory_model.states import RankStates
from fsdpbench.strategies.base import Sharding

CATEGORIES = (
    "params",
    "padding",
    "optim",
    "grads",
    "params_unsharded",
    "grads_unsharded",
    "grads_unsharded_in_bwd",
    "all_gather",
    "reduce_scatter",
    "ddp_buckets",
    "activations",
    "inputs",
    "temp",
    "fwd_temp",
    "optim_temp",
)
LOSS_BYTES = 4  # the fp32 loss scalar the step still references while the optimizer runs


@dataclass(slots=True)
class Moment:
    label: str
    bytes: dict[str, int] = field(default_factory=dict)
    untracked_bytes: int = 0  # allocated but not (yet) counted by the tracker: DDP buckets not yet touched

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def walk_step(
    facts: ModelFacts,
    states: RankStates,
    profile: ActivationProfile,
    sharding: Sharding,
    *,
    prefetch: int,
    shard_group: int = 1,
    replicas: int = 1,
    backend: str = "nccl",
) -> list[Moment]:
    """Every moment of one step with its bytes by category."""
    unit_of = {p.name: p.unit for p in facts.params or ()}
    fsdp = bool(states.unit_unsharded)
    base = {"params": states.params, "padding": states.params_padding, "optim": states.optim}
    stages = profile.stages
    moments: list[Moment] = []
    total_buckets = sum(b for b, _ in states.buckets)

    # units in the order forward first uses them (the root, holding whatever no block claimed, first)
    root = facts.root
    fwd_units: list[int] = []
    for st in stages:
        for u in sorted({unit_of[n] for n in st.params if n in unit_of} - {root}):
            if u not in fwd_units:
                fwd_units.append(u)
    has_root = root in states.unit_unsharded
    U = states.unit_unsharded
    AG = states.unit_all_gather
    keep_fwd_bwd = sharding.params_unsharded_fwd_to_bwd
    hold_all_gather = shard_group > 1
    hold_all_reduce = replicas > 1 and any(
        states.unit_reduce_output.get(u) != states.unit_sharded_grads.get(u)
        for u in states.unit_reduce_output
    )
    gloo_copy = backend == "gloo" and shard_group > 1  # FSDP2 skips the collective on one rank

    def moment(label: str, **parts: int) -> Moment:
        m = Moment(label, dict(base))
        for k, v in parts.items():
            if v:
                m.bytes[k] = m.bytes.get(k, 0) + v
        return m

    # ---- forward ------------------------------------------------------------------------------------
    # In forward FSDP2 keeps each unit's all-gather output until the *next* unit's copy-out has returned
    # (``comm_ctx.all_gather_state``, when the shard group has more than one rank); explicit prefetch
    # keeps the next ``prefetch`` units' outputs in flight.
    saved = 0
    held = 0
    unsharded_fwd = U.get(root, 0) if fsdp and has_root else 0  # root unsharded at its pre-forward
    if unsharded_fwd:
        moments.append(
            moment(
                f"forward: all-gather {facts.units[root]}",
                inputs=profile.inputs_bytes,
                params_unsharded=U[root],
                all_gather=AG[root],
            )
        )
        held = AG[root] if hold_all_gather else 0
    seen: list[int] = []
    ahead: list[int] = []
    for st in stages:
        for u in sorted({unit_of[n] for n in st.params if n in unit_of} - {root}):
            if not fsdp or u in seen:
                continue
            seen.append(u)
            i = fwd_units.index(u)
            prefetched = fwd_units[i + 1 : i + prefetch]  # issued by the previous unit
            earlier = sum(U[v] for v in seen[:-1]) if keep_fwd_bwd else 0
            # copy-out of unit u: the previous output (held), u's output and u's unsharded params alive
            moments.append(
                moment(
                    f"forward: all-gather {facts.units[u]}",
                    inputs=profile.inputs_bytes,
                    activations=saved,
                    params_unsharded=unsharded_fwd + earlier + U[u],
                    all_gather=held + AG[u] + sum(AG[v] for v in prefetched),
                )
            )
            held = AG[u] if hold_all_gather else 0
            ahead = fwd_units[i + 1 : i + 1 + prefetch]
        if fsdp and st is stages[-1] and st.in_model is not None:
            # the output projection inside the root's forward: the last all-gather output still held
            kept, extra = st.in_model
            in_flight = unsharded_fwd + (sum(U[v] for v in seen) if keep_fwd_bwd else 0)
            moments.append(
                moment(
                    f"forward: {st.name} (in the model)",
                    inputs=profile.inputs_bytes,
                    activations=saved + kept,
                    fwd_temp=extra,
                    params_unsharded=in_flight,
                    all_gather=held,
                )
            )
        saved += st.saved_bytes
        in_flight = all_gather = 0
        if fsdp:
            if st is stages[-1] and not keep_fwd_bwd:
                pass  # the loss runs after the root's post-forward: everything resharded, outputs freed
            elif keep_fwd_bwd:  # (the root's post-forward frees the held all-gather output before the loss)
                in_flight = unsharded_fwd + sum(U[v] for v in seen)
                all_gather = 0 if st is stages[-1] else held + sum(AG[v] for v in ahead)
            else:
                units_here = {unit_of[n] for n in st.params if n in unit_of} - {root}
                in_flight = unsharded_fwd + sum(U[v] for v in units_here)
                all_gather = held + sum(AG[v] for v in ahead)
        moments.append(
            moment(
                f"forward: {st.name}",
                inputs=profile.inputs_bytes,
                activations=saved,
                fwd_temp=st.fwd_extra_bytes,
                params_unsharded=in_flight,
                all_gather=all_gather,
            )
        )
        moments[-1].untracked_bytes = total_buckets  # DDP buckets: allocated, not yet seen by the tracker

    # ---- backward -----------------------------------------------------------------------------------
    bwd_units = [root] + list(reversed(fwd_units)) if fsdp else []
    depth = max(1, prefetch)
    grads_done: set[str] = set()
    reduced: list[int] = []  # units whose post-backward ran (sharded grads exist)
    rs_held = 0  # the last reduce-scatter input, held until the next post-backward
    unsharded_bwd: list[int] = list(seen) if keep_fwd_bwd else []
    if keep_fwd_bwd and has_root:
        unsharded_bwd.append(root)
    last_grad = {p.unit: states.unsharded_grad_by_param.get(p.name, 0) for p in facts.params or ()}
    started: set[int] = set(unsharded_bwd)  # units whose pre-backward ran (prefetch targets the others)
    pending: dict[int, set[str]] = {u: set() for u in bwd_units}
    for st in stages:
        for n in st.params:
            if unit_of.get(n) in pending:
                pending[unit_of[n]].add(n)
    # running sums (a 70B model has ~700 parameters and ~500 moments)
    run = {"ug": 0, "grads": 0, "all_reduce": 0, "ddp_grads": 0}
    ug_by_unit: dict[int, int] = {}
    bucket_of = {n: i for i, (_, names) in enumerate(states.buckets) for n in names}
    touched: set[int] = set()

    def add_grads(names: tuple[str, ...]) -> None:
        for n in names:
            if n in grads_done:
                continue
            grads_done.add(n)
            if fsdp:
                b = states.unsharded_grad_by_param.get(n, 0)
                ug_by_unit[unit_of.get(n, -1)] = ug_by_unit.get(unit_of.get(n, -1), 0) + b
                run["ug"] += b
            else:
                run["ddp_grads"] += states.grad_bytes_by_param.get(n, 0)
                if n in bucket_of:
                    touched.add(bucket_of[n])

    def mark_reduced(u: int) -> None:
        reduced.append(u)
        run["ug"] -= ug_by_unit.get(u, 0)
        run["grads"] += states.unit_sharded_grads.get(u, 0)
        run["all_reduce"] += states.unit_reduce_output.get(u, 0) if hold_all_reduce else 0

    def fsdp_parts(current: set[int], post_backward: int | None = None) -> dict[str, int]:
        """Unsharded params, prefetched all-gathers, unsharded grads, sharded grads, held RS input.

        Unsharded gradients are ``grads_unsharded_in_bwd`` until their unit's post-backward starts (the
        tracker files them as temporaries until then), ``grads_unsharded`` from then on."""
        if not fsdp:
            return {}
        labelled = ug_by_unit.get(post_backward, 0) if post_backward is not None else 0
        live = set(unsharded_bwd) | current
        ahead = [] if keep_fwd_bwd else [u for u in bwd_units if u not in started][:depth]
        # HSDP keeps each unit's all-reduce input until the end of backward; with a reduce dtype other
        # than the gradient's it is a buffer of its own (``FSDPParamGroup._all_reduce_state``)
        return {
            "params_unsharded": sum(U.get(u, 0) for u in live),
            "all_gather": sum(AG.get(u, 0) for u in ahead),
            "grads_unsharded": labelled,
            "grads_unsharded_in_bwd": run["ug"] - labelled,
            "grads": run["grads"],
            "reduce_scatter": rs_held + run["all_reduce"],
        }

    def ddp_parts() -> tuple[dict[str, int], int]:
        if fsdp:
            return {}, 0
        used = sum(states.buckets[i][0] for i in touched)
        return {"grads": run["ddp_grads"], "ddp_buckets": used}, total_buckets - used

    saved_before = [0]
    for st in stages:
        saved_before.append(saved_before[-1] + st.saved_bytes)
    for j in range(len(stages) - 1, -1, -1):
        st: Stage = stages[j]
        before = saved_before[j]
        units_here = {unit_of[n] for n in st.params if n in unit_of}
        for bm in st.bwd:
            add_grads(bm.grads_done)
            label = f"backward: {st.name} ({bm.label})"
            if fsdp and (bm.pre_backward or bm.grads_done):
                for u in sorted(units_here - started):
                    # pre-backward: copy-out of u's all-gather output into its unsharded parameters
                    started.add(u)
                    unsharded_bwd.append(u)
                    earlier = [v for v in bwd_units if v not in started][: depth - 1]  # prefetched before
                    parts = {
                        **fsdp_parts(set()),
                        "all_gather": AG.get(u, 0) + sum(AG.get(v, 0) for v in earlier),
                    }
                    moments.append(
                        moment(
                            f"backward: all-gather {facts.units[u]}",
                            inputs=profile.inputs_bytes,
                            activations=before + bm.saved_left_bytes,
                            temp=bm.temp_bytes,
                            **parts,
                        )
                    )
            if fsdp and units_here <= started:
                parts = fsdp_parts(units_here)
            elif fsdp:  # before the stage's pre-backward hook (the loss backward): nothing prefetched yet
                parts = {k: v for k, v in fsdp_parts(set()).items() if k != "all_gather"}
            else:
                parts, untracked = ddp_parts()
            m = moment(
                label,
                inputs=profile.inputs_bytes,
                activations=before + bm.saved_left_bytes,
                temp=bm.temp_bytes,
                **parts,
            )
            if not fsdp:
                m.untracked_bytes = untracked
            moments.append(m)
        if fsdp:
            # post-backward of every unit whose parameters all have gradients now (the root runs last)
            for u in [u for u in units_here if u != root or j == 0]:
                pending[u] -= grads_done
                if pending[u]:
                    continue
                if u in unsharded_bwd:
                    unsharded_bwd.remove(u)  # reshard
                rs_held = states.unit_reduce_scatter.get(u, 0)  # previous input freed, this one allocated
                # copy-in: u's unsharded gradients are copied into the reduce-scatter input
                moments.append(
                    moment(
                        f"backward: reduce-scatter copy-in {facts.units[u]}",
                        inputs=profile.inputs_bytes,
                        activations=before,
                        **fsdp_parts(set(), post_backward=u),
                    )
                )
                mark_reduced(u)
                # the collective: unsharded grads freed, the sharded output allocated; gloo stages a
                # flattened copy of the input (ProcessGroupGloo's reduce_scatter reduces a copy)
                # FSDPMemTracker's post-backward wrapper keeps its loop variable, the unit's last
                # parameter's unsharded gradient, alive until post-backward returns (a tracker artifact)
                parts = fsdp_parts(set())
                parts["grads_unsharded"] += last_grad.get(u, 0)
                cast = states.unit_reduce_output.get(u, 0) != states.unit_sharded_grads.get(u, 0)
                op = dict(parts, reduce_scatter=parts["reduce_scatter"] + (rs_held if gloo_copy else 0))
                if cast:  # the output is in the reduce dtype until cast to the gradient dtype
                    op["grads"] -= states.unit_sharded_grads.get(u, 0)
                    op["reduce_scatter"] += 0 if hold_all_reduce else states.unit_reduce_output.get(u, 0)
                moments.append(
                    moment(
                        f"backward: reduce-scatter {facts.units[u]}",
                        inputs=profile.inputs_bytes,
                        activations=before,
                        **op,
                    )
                )
                if cast:
                    moments.append(
                        moment(
                            f"backward: reduce-scatter {facts.units[u]} (cast)",
                            inputs=profile.inputs_bytes,
                            activations=before,
                            **dict(
                                parts,
                                reduce_scatter=parts["reduce_scatter"]
                                + (0 if hold_all_reduce else states.unit_reduce_output.get(u, 0)),
                            ),
                        )
                    )

    # ---- optimizer step -----------------------------------------------------------------------------
    grads_all = states.grads + states.grads_padding
    buckets = total_buckets
    moments.append(
        moment(
            "optimizer step",
            inputs=profile.inputs_bytes,
            activations=LOSS_BYTES,
            grads=grads_all,
            ddp_buckets=buckets,
            optim_temp=states.optim_temp,
        )
    )
    return moments
