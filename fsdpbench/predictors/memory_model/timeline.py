"""When the peak happens: one training step as a schedule of events (buffers allocated and freed, by
category, and the moments worth recording), and an accountant that walks the schedule keeping the live
bytes per category, as PyTorch's memory trackers count them.

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

The activation profile works at stage granularity (a decoder block, the head): a moment at the end of a
stage's forward sees every unit the stage uses unsharded, even where the wrap policy cuts a block into
several units whose forwards end one after another.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fsdpbench.models.facts import ModelFacts
from fsdpbench.predictors.memory_model.activations import ActivationProfile, BwdMoment, Stage
from fsdpbench.predictors.memory_model.states import RankStates
from fsdpbench.strategies.base import KEPT_ALL, KEPT_LAST, KEPT_NONE, Sharding

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
    "step_temp",  # an engine's own step, outside the torch optimizer's (DeepSpeed's flat gradient partition)
)
RESIDENT_CATEGORIES = ("params", "padding", "optim")  # in every moment's bytes, zero or not
UNTRACKED = "untracked"  # device memory the tracker does not count yet: DDP buckets backward has not written
LOSS_BYTES = 4  # the fp32 loss scalar the step still references while the optimizer runs
# alive until backward returns: the loss and the seed gradient ``loss.backward()`` makes
IN_BACKWARD, IN_BACKWARD_BYTES = "loss and its seed gradient", 2 * LOSS_BYTES


@dataclass(slots=True)
class Moment:
    label: str
    bytes: dict[str, int] = field(default_factory=dict)
    untracked_bytes: int = 0  # allocated but not (yet) counted by the tracker: DDP buckets not yet touched

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclass(frozen=True, slots=True)
class Alloc:
    """A buffer of ``nbytes`` in ``category`` comes alive under ``name`` (a later ``Free`` names it)."""

    name: str
    category: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Free:
    """The buffer allocated under ``name`` is freed."""

    name: str


@dataclass(frozen=True, slots=True)
class Record:
    """A moment worth recording: what is alive now, plus bytes alive only at this instant, by category
    (a stage's gradient temporaries, its saved activations while its backward consumes them)."""

    label: str
    transient: tuple[tuple[str, int], ...] = ()


Event = Alloc | Free | Record


class Accountant:
    """Walks a schedule: live bytes per category as buffers come and go, a ``Moment`` at every ``Record``."""

    def __init__(self) -> None:
        self.buffers: dict[str, tuple[str, int]] = {}
        self.live = dict.fromkeys((*CATEGORIES, UNTRACKED), 0)
        self.moments: list[Moment] = []

    def apply(self, event: Event) -> None:
        if isinstance(event, Alloc):
            if event.name in self.buffers:
                raise ValueError(f"buffer {event.name!r} allocated twice")
            self.buffers[event.name] = (event.category, event.nbytes)
            self.live[event.category] += event.nbytes
        elif isinstance(event, Free):
            category, nbytes = self.buffers.pop(event.name)
            self.live[category] -= nbytes
        else:
            self.moments.append(self.moment(event))

    def moment(self, record: Record) -> Moment:
        live = dict(self.live)
        for category, nbytes in record.transient:
            live[category] += nbytes
        tracked = {c: live[c] for c in CATEGORIES if live[c] or c in RESIDENT_CATEGORIES}
        return Moment(record.label, tracked, live[UNTRACKED])


def account(events: Iterable[Event]) -> list[Moment]:
    """Every recorded moment of a schedule, with its live bytes by category."""
    accountant = Accountant()
    for event in events:
        accountant.apply(event)
    return accountant.moments


@dataclass(frozen=True, slots=True)
class StepConfig:
    """What the schedule depends on besides the model, its states and its activations."""

    prefetch: int = 0
    shard_group: int = 1  # ranks a unit is all-gathered over
    replicas: int = 1  # HSDP: shard groups a gradient is all-reduced over
    backend: str = "nccl"
    kept_after_forward: str = KEPT_NONE  # units not resharded after forward (``Strategy.kept_after_forward``)


def step_schedule(
    facts: ModelFacts,
    states: RankStates,
    profile: ActivationProfile,
    sharding: Sharding,
    config: StepConfig,
) -> list[Event]:
    """The events of one step: resident states and batch, forward, backward, optimizer step."""
    schedule = _Schedule()
    alloc_resident(schedule, states, profile)
    if states.unit_unsharded:
        hooks: _Hooks = _FsdpHooks(schedule, facts, states, sharding, config, profile.stages)
    else:
        hooks = _ReplicatedHooks(schedule, states)
    _forward(schedule, profile.stages, hooks)
    _backward(schedule, profile.stages, hooks, seed_bytes=2 * profile.scalar_bytes)
    hooks.end_backward()
    # the optimizer reads the gradients as the resident states hold them, padding included
    schedule.alloc("gradients", "grads", states.grads + states.grads_padding)
    if states.clip_temp:
        schedule.record("gradient clipping", activations=LOSS_BYTES, temp=states.clip_temp)
    schedule.record("optimizer step", activations=LOSS_BYTES, optim_temp=states.optim_temp)
    return schedule.events


def alloc_resident(schedule: _Schedule, states: RankStates, profile: ActivationProfile) -> None:
    """What every step starts with: the resident parameters (and padding), optimizer state, the batch."""
    schedule.alloc("params", "params", states.params)
    schedule.alloc("padding", "padding", states.params_padding)
    schedule.alloc("optimizer state", "optim", states.optim)
    schedule.alloc("batch", "inputs", profile.inputs_bytes)


def _forward(schedule: _Schedule, stages: tuple[Stage, ...], hooks: _Hooks) -> None:
    hooks.start_forward()
    for stage in stages:
        hooks.pre_forward(stage)
        last = stage is stages[-1]
        if last and stage.in_model is not None:
            hooks.in_model(stage)
        schedule.alloc(f"saved {stage.name}", "activations", stage.saved_bytes)
        hooks.post_forward(stage, last=last)
        schedule.record(f"forward: {stage.name}", fwd_temp=stage.fwd_extra_bytes)


def _backward(
    schedule: _Schedule, stages: tuple[Stage, ...], hooks: _Hooks, *, seed_bytes: int = IN_BACKWARD_BYTES
) -> None:
    hooks.start_backward()
    own_seed = len(stages) > 1 and not hooks.holds_loss_in_backward
    for j, stage in reversed(list(enumerate(stages))):
        if own_seed and stage is stages[-2]:  # the last stage's own moments count them
            schedule.alloc(IN_BACKWARD, "activations", seed_bytes)
        # its backward consumes what the stage saved: each moment says how much is left (saved_left_bytes)
        schedule.free(f"saved {stage.name}")
        for step in stage.bwd:
            hooks.grads_ready(step.grads_done)
            hooks.pre_backward(stage, step)
            schedule.record(f"backward: {stage.name} ({step.label})", **_backward_transient(step))
        hooks.post_backward(stage, first_stage=j == 0)
    if own_seed:
        schedule.free(IN_BACKWARD)


def _backward_transient(step: BwdMoment) -> dict[str, int]:
    return {"activations": step.saved_left_bytes, "temp": step.temp_bytes}


class _Schedule:
    """The events of a step, in order, as the hooks generate them."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def alloc(self, name: str, category: str, nbytes: int) -> None:
        self.events.append(Alloc(name, category, nbytes))

    def free(self, name: str) -> None:
        self.events.append(Free(name))

    def record(self, label: str, **transient: int) -> None:
        self.events.append(Record(label, tuple((c, b) for c, b in transient.items() if b)))


class _Hooks:
    """What a strategy adds to the step at each point of it; the base adds nothing."""

    holds_loss_in_backward = False  # the hooks place the loss and its seed gradient themselves

    def start_forward(self) -> None: ...

    def pre_forward(self, stage: Stage) -> None: ...

    def in_model(self, stage: Stage) -> None: ...

    def post_forward(self, stage: Stage, *, last: bool) -> None: ...

    def start_backward(self) -> None: ...

    def grads_ready(self, names: tuple[str, ...]) -> None: ...

    def pre_backward(self, stage: Stage, step: BwdMoment) -> None: ...

    def post_backward(self, stage: Stage, *, first_stage: bool) -> None: ...

    def end_backward(self) -> None: ...


class _ReplicatedHooks(_Hooks):
    """Parameters whole on every rank (DDP, ZeRO-1, any strategy without per-unit gathers): gradients as
    backward produces them, each DDP bucket counted from the first gradient written into it."""

    def __init__(self, schedule: _Schedule, states: RankStates) -> None:
        self.schedule = schedule
        self.states = states
        self.grad_buffers: set[str] = set()
        self.bucket_of = {n: i for i, (_, names) in enumerate(states.buckets) for n in names}
        self.written: set[int] = set()
        for i, (nbytes, _) in enumerate(states.buckets):
            schedule.alloc(f"ddp bucket {i}", UNTRACKED, nbytes)

    def grads_ready(self, names: tuple[str, ...]) -> None:
        for name in names:
            if f"grad {name}" in self.grad_buffers:
                continue
            self.grad_buffers.add(f"grad {name}")
            self.schedule.alloc(f"grad {name}", "grads", self.states.grad_bytes_by_param.get(name, 0))
            if name in self.bucket_of:
                self._write_bucket(self.bucket_of[name])

    def _write_bucket(self, i: int) -> None:
        if i not in self.written:
            self.written.add(i)
            self.schedule.free(f"ddp bucket {i}")
            self.schedule.alloc(f"ddp bucket {i} (written)", "ddp_buckets", self.states.buckets[i][0])

    def end_backward(self) -> None:
        """The optimizer reads the gradients as resident states; every bucket has been written."""
        for name in self.grad_buffers:
            self.schedule.free(name)
        for i in range(len(self.states.buckets)):
            self._write_bucket(i)


class _FsdpHooks(_Hooks):
    """FSDP2's hooks on every wrap unit: all-gather and copy-out at pre-forward/pre-backward (with
    prefetch), reshard at post-forward (not ZeRO-2), reduce-scatter at post-backward.

    The units alive are held as sets (unsharded parameters, all-gather outputs); a hook states the set it
    leaves and ``_set_unsharded``/``_set_gathered`` turn the difference into allocations and frees."""

    def __init__(
        self,
        schedule: _Schedule,
        facts: ModelFacts,
        states: RankStates,
        sharding: Sharding,
        config: StepConfig,
        stages: tuple[Stage, ...],
    ) -> None:
        self.schedule = schedule
        self.facts = facts
        self.states = states
        self.prefetch = config.prefetch
        self.unit_of = {p.name: p.unit for p in facts.params or ()}
        root = facts.root
        self.root_units = {root} if root in states.unit_unsharded else set()
        # ZeRO-2: no unit reshards after forward; torchtitan's rule: every unit but the last does
        self.keep_unsharded = config.kept_after_forward == KEPT_ALL
        self.keep_last = config.kept_after_forward == KEPT_LAST
        # FSDP2 keeps a unit's all-gather output until the next unit's copy-out has returned
        # (``comm_ctx.all_gather_state``) when the shard group has more than one rank
        self.hold_previous_gather = config.shard_group > 1
        # HSDP keeps each unit's all-reduce input until the end of backward; with a reduce dtype other
        # than the gradient's it is a buffer of its own (``FSDPParamGroup._all_reduce_state``)
        self.hold_all_reduce = config.replicas > 1 and any(
            states.unit_reduce_output.get(u) != states.unit_sharded_grads.get(u)
            for u in states.unit_reduce_output
        )
        # gloo's reduce-scatter reduces a staging copy of its input; FSDP2 skips the collective on one rank
        self.gloo_staging = config.backend == "gloo" and config.shard_group > 1
        self.forward_order = _forward_order(stages, self.unit_of, root)  # the root (gathered first) left out
        self.last_unit = {self.forward_order[-1]} if self.keep_last and self.forward_order else set()
        self.backward_order = [root, *reversed(self.forward_order)]
        self.backward_depth = max(1, config.prefetch)
        # the unit's last parameter: FSDPMemTracker's post-backward wrapper keeps its unsharded
        # gradient (its loop variable) alive until post-backward returns (a tracker artifact)
        self.last_grad = {p.unit: states.unsharded_grad_by_param.get(p.name, 0) for p in facts.params or ()}
        # parameters without a gradient yet, per unit
        self.pending: dict[int, set[str]] = {u: set() for u in self.backward_order}
        for stage in stages:
            for name in stage.params:
                if self.unit_of.get(name) in self.pending:
                    self.pending[self.unit_of[name]].add(name)
        self.unsharded: set[int] = set()
        self.gathered: set[int] = set()  # all-gather outputs alive
        self.held_gather: set[int] = set()  # forward: the previous unit's output, until the next copy-out
        self.prefetched: list[int] = []  # forward: outputs issued ahead of their unit
        self.seen: list[int] = []  # units whose forward ran
        self.started: set[int] = set()  # units unsharded in backward (their pre-backward ran, or kept)
        self.prefetched_from: set[int] = set()  # units whose pre-backward ran
        self.grads_done: set[str] = set()
        self.unsharded_grads: dict[int, list[str]] = {}  # per unit: parameters whose unsharded grad exists
        self.reduced: list[int] = []  # units whose post-backward ran
        self.reduce_scatter_input: int | None = None  # the last one, held until the next post-backward

    # ---- the buffers a hook leaves alive ------------------------------------------------------------
    def _set_unsharded(self, units: set[int]) -> None:
        self._set(self.unsharded, units, "unsharded params", "params_unsharded", self.states.unit_unsharded)

    def _set_gathered(self, units: set[int]) -> None:
        self._set(self.gathered, units, "all-gather output", "all_gather", self.states.unit_all_gather)

    def _set(self, alive: set[int], units: set[int], what: str, category: str, sizes: dict[int, int]) -> None:
        for u in sorted(alive - units):
            self.schedule.free(f"{what} {u}")
        for u in sorted(units - alive):
            self.schedule.alloc(f"{what} {u}", category, sizes.get(u, 0))
        alive.clear()
        alive.update(units)

    def _units_of(self, stage: Stage) -> set[int]:
        return {self.unit_of[n] for n in stage.params if n in self.unit_of}

    def _name(self, unit: int) -> str:
        return self.facts.units[unit]

    # ---- forward ------------------------------------------------------------------------------------
    def start_forward(self) -> None:
        """The root's pre-forward: it stays unsharded through forward (resharded before the loss)."""
        root = self.facts.root
        if not (self.root_units and self.states.unit_unsharded[root]):
            return
        self._set_unsharded(self.root_units)
        self._set_gathered({root})
        self.schedule.record(f"forward: all-gather {self._name(root)}")
        self.held_gather = {root} if self.hold_previous_gather else set()
        self._set_gathered(self.held_gather)

    def pre_forward(self, stage: Stage) -> None:
        """Each unit the stage uses first: its copy-out, with the previous unit's output still held and
        the next ``prefetch`` units' outputs in flight (the first unit issues those before it too)."""
        new = sorted(self._units_of(stage) - {self.facts.root} - set(self.seen))
        for u in new:
            self.seen.append(u)
            i = self.forward_order.index(u)
            self._set_unsharded(self.root_units | self._kept() | {u})
            self._set_gathered(self.held_gather | {u, *self.forward_order[i + 1 : i + self.prefetch]})
            self.schedule.record(f"forward: all-gather {self._name(u)}")
            self.held_gather = {u} if self.hold_previous_gather else set()
            self.prefetched = self.forward_order[i + 1 : i + 1 + self.prefetch]
            self._set_gathered(self.held_gather | set(self.prefetched))

    def in_model(self, stage: Stage) -> None:
        """The output projection inside the root's forward: the last all-gather output still held."""
        self._set_unsharded(self.root_units | self._kept())
        self._set_gathered(self.held_gather)
        kept, logits = stage.in_model or (0, 0)
        self.schedule.record(f"forward: {stage.name} (in the model)", activations=kept, fwd_temp=logits)

    def post_forward(self, stage: Stage, *, last: bool) -> None:
        """What the stage's end sees: ZeRO-2 keeps every unit so far; the others the stage's own units.
        The loss runs after the root's post-forward: all resharded (ZeRO-2: the held output freed)."""
        if self.keep_unsharded:
            self._set_unsharded(self.root_units | set(self.seen))
        elif last:
            self._set_unsharded(self._kept())
        else:
            self._set_unsharded(self.root_units | self._kept() | (self._units_of(stage) - {self.facts.root}))
        self._set_gathered(set() if last else self.held_gather | set(self.prefetched))

    def _kept(self) -> set[int]:
        """The units whose forward ran that stay unsharded until their backward."""
        return set(self.seen) if self.keep_unsharded else self.last_unit & set(self.seen)

    # ---- backward -----------------------------------------------------------------------------------
    def start_backward(self) -> None:
        self.started = set(self.unsharded)  # ZeRO-2's units are still unsharded from forward

    def grads_ready(self, names: tuple[str, ...]) -> None:
        for name in names:
            if name in self.grads_done:
                continue
            self.grads_done.add(name)
            nbytes = self.states.unsharded_grad_by_param.get(name, 0)
            # the tracker files them as temporaries until their unit's post-backward starts
            self.schedule.alloc(f"unsharded grad {name}", "grads_unsharded_in_bwd", nbytes)
            self.unsharded_grads.setdefault(self.unit_of.get(name, -1), []).append(name)

    def pre_backward(self, stage: Stage, step: BwdMoment) -> None:
        """Each unit of the stage not yet unsharded, once its output gradient or a parameter gradient
        arrives: copy-out of its all-gather output, the next ``max(1, prefetch)`` units prefetched."""
        if not (step.pre_backward or step.grads_done):
            return
        if not self.keep_unsharded:  # a unit kept from forward: its pre-backward only prefetches
            for u in sorted((self._units_of(stage) & self.last_unit) - self.prefetched_from):
                self.prefetched_from.add(u)
                self._set_gathered(set(self._prefetched(u, self.backward_depth)))
        for u in sorted(self._units_of(stage) - self.started):
            self.started.add(u)
            self.prefetched_from.add(u)
            self._set_unsharded(self.unsharded | {u})
            self._set_gathered({u, *self._prefetched(u, self.backward_depth - 1)})
            self.schedule.record(f"backward: all-gather {self._name(u)}", **_backward_transient(step))
            self._set_gathered(
                set() if self.keep_unsharded else set(self._prefetched(u, self.backward_depth))
            )

    def _prefetched(self, unit: int, n: int) -> list[int]:
        """The all-gathers ``unit``'s pre-backward issues ahead: of the ``n`` units that follow it in backward
        order, those not unsharded already (a unit kept from forward takes its place and gathers nothing)."""
        i = self.backward_order.index(unit)
        return [u for u in self.backward_order[i + 1 : i + 1 + n] if u not in self.started]

    def post_backward(self, stage: Stage, *, first_stage: bool) -> None:
        """Every unit whose parameters all have gradients now reduce-scatters (the root's runs last)."""
        units = self._units_of(stage)
        for u in [u for u in units if u != self.facts.root or first_stage]:
            self.pending[u] -= self.grads_done
            if not self.pending[u]:
                self._reduce_scatter(u)

    def _reduce_scatter(self, u: int) -> None:
        """Reshard; copy-in of the unsharded gradients into the reduce-scatter input (the previous input
        freed); the collective: unsharded gradients freed, the sharded output allocated, cast to the
        gradient dtype where the reduce dtype differs."""
        states = self.states
        self._set_unsharded(self.unsharded - {u})
        if self.reduce_scatter_input is not None:
            self.schedule.free(f"reduce-scatter input {self.reduce_scatter_input}")
        self.reduce_scatter_input = u
        self.schedule.alloc(
            f"reduce-scatter input {u}", "reduce_scatter", states.unit_reduce_scatter.get(u, 0)
        )
        grads = self.unsharded_grads.pop(u, [])
        for name in grads:
            self.schedule.free(f"unsharded grad {name}")
            self.schedule.alloc(
                f"unsharded grad {name}", "grads_unsharded", states.unsharded_grad_by_param.get(name, 0)
            )
        self.schedule.record(f"backward: reduce-scatter copy-in {self._name(u)}")
        for name in grads:
            self.schedule.free(f"unsharded grad {name}")
        self.reduced.append(u)
        output = states.unit_reduce_output.get(u, 0)
        cast = output != states.unit_sharded_grads.get(u, 0)
        if self.hold_all_reduce:
            self.schedule.alloc(f"all-reduce input {u}", "reduce_scatter", output)
        elif cast:
            self.schedule.alloc(f"reduce-scatter output {u}", "reduce_scatter", output)
        if not cast:
            self._alloc_sharded_grads(u)
        staging = states.unit_reduce_scatter.get(u, 0) if self.gloo_staging else 0
        label = f"backward: reduce-scatter {self._name(u)}"
        self.schedule.record(label, grads_unsharded=self.last_grad.get(u, 0), reduce_scatter=staging)
        if cast:
            self._alloc_sharded_grads(u)
            self.schedule.record(f"{label} (cast)", grads_unsharded=self.last_grad.get(u, 0))
            if not self.hold_all_reduce:
                self.schedule.free(f"reduce-scatter output {u}")

    def _alloc_sharded_grads(self, u: int) -> None:
        self.schedule.alloc(f"sharded grads {u}", "grads", self.states.unit_sharded_grads.get(u, 0))

    def end_backward(self) -> None:
        """Everything backward allocated is freed; the optimizer reads the gradients as resident states."""
        self._set_unsharded(set())
        self._set_gathered(set())
        if self.reduce_scatter_input is not None:
            self.schedule.free(f"reduce-scatter input {self.reduce_scatter_input}")
        for u in self.reduced:
            self.schedule.free(f"sharded grads {u}")
            if self.hold_all_reduce:
                self.schedule.free(f"all-reduce input {u}")
        for names in self.unsharded_grads.values():
            for name in names:
                self.schedule.free(f"unsharded grad {name}")


def _forward_order(stages: tuple[Stage, ...], unit_of: dict[str, int], root: int) -> list[int]:
    """Units in the order forward first uses them, the root excluded."""
    order: list[int] = []
    for stage in stages:
        for u in sorted({unit_of[n] for n in stage.params if n in unit_of} - {root}):
            if u not in order:
                order.append(u)
    return order
