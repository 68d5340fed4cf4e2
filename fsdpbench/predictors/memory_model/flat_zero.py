"""DeepSpeed's ZeRO (stages 1-3) laid out as DeepSpeed allocates it: one rank's flat buffers, each a
named term from a knob (``FlatBufferZero``, resolved by the strategy) and a mechanism in DeepSpeed's
source (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py, partition_parameters.py; DeepSpeed 0.19).

Stages 1 and 2 (``DeepSpeedZeroOptimizer``):

- ``bit16_groups_flat``: the whole model in one flat buffer of the model's dtype, padded to a multiple of
  ``nccl_start_alignment_factor`` (2) × N elements; each parameter is a view of it (params);
- ``single_partition_of_fp32_groups``: this rank's fp32 master partition, ``len(flat) / N`` elements,
  and the torch optimizer's state of that one flat tensor (optim);
- the reduce bucket: ``torch.empty(reduce_bucket_size)`` in the reduction dtype, made by
  ``setup_buckets`` at each backward's start (two with ``overlap_comm``), dropped by
  ``_release_ipg_buffers`` at the end of backward (reduce_scatter);
- in ``step``: the fp32 gradient partition (``flatten(averaged_gradients)``, partition elements), freed
  after the update; the gradients live nowhere else after the step.

Stage 3 (``DeepSpeedZeroOptimizer_Stage3``):

- every parameter's partition ``ds_tensor``, ``ceil(numel / N)`` elements (the last ranks' zero-padded),
  gathered into ``fp16_partitioned_groups_flat`` (params); parameters of at most
  ``stage3_param_persistence_threshold`` elements also keep their whole data (``ds_persist``) (params);
- ``fp32_partitioned_groups_flat`` (the fp32 master of the partition) and its optimizer state (optim);
- ``grad_partitions_flat_buffer``: the fp32 gradient partition, allocated once, kept (grads);
- the reduce bucket: one ``torch.empty(reduce_bucket_size)``, made once and kept (reduce_scatter).

docs/memory-model.md ("DeepSpeed's ZeRO") lists each term with its knob and its place in DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpbench.models.facts import ModelFacts, ParamFact
from fsdpbench.predictors.memory_model.activations import ActivationProfile, BwdMoment, Stage
from fsdpbench.predictors.memory_model.precision import (
    STEP_TENSOR_BYTES,
    Precision,
    optimizer_has_step,
    optimizer_k,
)
from fsdpbench.predictors.memory_model.states import RankStates, storage_rounder
from fsdpbench.predictors.memory_model.timeline import (
    IN_BACKWARD_BYTES,
    LOSS_BYTES,
    Event,
    _backward,
    _forward,
    _Hooks,
    _Schedule,
    alloc_resident,
)
from fsdpbench.strategies.base import FlatBufferZero

NCCL_START_ALIGNMENT_FACTOR = 2  # stage_1_and_2.py: the flat buffer's partitions start 4-byte aligned
MASTER_BYTES = 4  # the master partition and its gradient are fp32 (master_weights_and_grads_dtype)
# alive through the update: ``scaled_global_grad_norm`` and ``_global_grad_norm``, fp32 scalars
# (``compute_grad_norm``, on by default)
GRAD_NORM_BYTES = 2 * 4


@dataclass(frozen=True, slots=True)
class FlatZeroStates:
    """One rank's DeepSpeed buffers (bytes, the device's storage rounding applied), each one term."""

    stage: int
    flat_params: int  # stage 1/2: bit16_groups_flat (the whole model); stage 3: the partition, flat
    flat_padding: int  # of flat_params: the alignment padding (stage 1/2) or the partitions' (stage 3)
    persistent_params: int  # stage 3: parameters under the persistence threshold, whole
    master: int  # the fp32 master partition
    optim_state: int  # the torch optimizer's state of the master partition (its step tensor included)
    grad_partition: int  # stage 3: grad_partitions_flat_buffer; stage 1/2: made in step, freed after it
    reduce_bucket: int  # one ipg bucket: reduce_bucket_size elements in the reduction dtype
    reduce_buckets: int  # the buckets backward holds (stage 1/2 with overlap_comm: two)
    reduce_elem: int  # bytes per element of the reduction dtype (the bucket's, its flattened copy's)
    params_in_partition: frozenset[str]  # stage 1/2: the parameters touching this rank's partition
    grads_in_partition: int  # stage 1/2: their gradients, whole, copied out of the bucket by the first
    # reduction that holds one of them, kept until the step
    update_temp: int  # the optimizer update's temporaries (one flat partition tensor)

    def rank_states(self) -> RankStates:
        """As the tracker's after-step snapshot files them: params, optim, grads (stage 3 only)."""
        return RankStates(
            params=self.flat_params - self.flat_padding + self.persistent_params,
            params_padding=self.flat_padding,
            grads=self.grad_partition if self.stage == 3 else 0,
            optim=self.master + self.optim_state,
            optim_temp=self.update_temp,
        )


def flat_zero_states(
    facts: ModelFacts,
    engine: FlatBufferZero,
    precision: Precision,
    optimizer: str,
    *,
    world_size: int,
    rank: int,
    device: str = "cpu",
    update_temporaries: int = 0,
) -> FlatZeroStates:
    """This rank's DeepSpeed buffers for a model whose parameter shapes are known."""
    if facts.params is None:
        raise ValueError("DeepSpeed's flat buffers need the model's parameters (--model)")
    rnd = storage_rounder(device)
    n = world_size
    elem = precision.unsharded_bytes  # DeepSpeed keeps the model in its compute dtype (fp32, bf16, fp16)
    numels = [p.numel for p in facts.params]
    if engine.stage in (1, 2):
        alignment = NCCL_START_ALIGNMENT_FACTOR * n
        flat_numel = -(-sum(numels) // alignment) * alignment
        partition = flat_numel // n
        flat, padding, persistent = rnd(flat_numel * elem), (flat_numel - sum(numels)) * elem, 0
        buckets = 2 if engine.overlap_comm and engine.contiguous_gradients else 1
        in_partition = _params_in_partition(facts.params, partition, rank)
    else:
        parts = [-(-x // n) for x in numels]
        partition = sum(parts)
        local = sum(max(0, min(part, x - rank * part)) for part, x in zip(parts, numels))
        flat, padding = rnd(partition * elem), (partition - local) * elem
        persistent = sum(rnd(x * elem) for x in numels if x <= engine.param_persistence_threshold)
        buckets, in_partition = 1, frozenset()
    k = optimizer_k(optimizer, precision)
    n_state = max(1, k // 4) if k else 0
    step = STEP_TENSOR_BYTES if k and optimizer_has_step(optimizer) and device == "cpu" else 0
    return FlatZeroStates(
        stage=engine.stage,
        flat_params=flat,
        flat_padding=padding,
        persistent_params=persistent,
        master=rnd(partition * MASTER_BYTES),
        optim_state=n_state * rnd(partition * k // n_state) + step if k else 0,
        grad_partition=rnd(partition * MASTER_BYTES),
        reduce_bucket=rnd(engine.reduce_bucket_size * elem),
        reduce_buckets=buckets if engine.contiguous_gradients else 0,
        reduce_elem=elem,
        params_in_partition=in_partition,
        grads_in_partition=rnd(sum(p.numel for p in facts.params if p.name in in_partition) * elem),
        update_temp=update_temporaries * rnd(partition * MASTER_BYTES),
    )


def _params_in_partition(params: tuple[ParamFact, ...], partition: int, rank: int) -> frozenset[str]:
    """The parameters that touch this rank's partition of the flat buffer (``params_in_partition``,
    in ``model.parameters()`` order: ``round_robin_gradients`` is off by default)."""
    lo, hi, offset, out = rank * partition, (rank + 1) * partition, 0, set()
    for p in params:
        if offset < hi and offset + p.numel > lo:
            out.add(p.name)
        offset += p.numel
    return frozenset(out)


class _EngineHooks(_Hooks):
    """What both engines' backward does with each gradient as it arrives: the engine's hook copies it
    into the reduce bucket (immediately, or stage 1 at the epilogue), reducing the bucket first when it
    would overflow. Until the copy, a gradient autograd just made is alive beside its op's temporaries.

    The activation profile records a few moments per stage; a bucket reduced when a gradient arrives is
    charged with the saved activations and temporaries of the moment the profile first has that gradient
    at (the reduction happens between that moment and the one before: docs/memory-model.md says what
    this granularity costs). The loss and its seed gradient stay alive until backward returns."""

    holds_loss_in_backward = True  # until the engine's epilogue (``free_loss``)

    immediate: bool  # the hook copies each gradient into the bucket as it arrives

    def __init__(
        self, schedule: _Schedule, facts: ModelFacts, zs: FlatZeroStates, engine: FlatBufferZero, elem: int
    ) -> None:
        self.schedule = schedule
        self.zs = zs
        self.engine = engine
        self.elem = elem
        self.numel = {p.name: p.numel for p in facts.params or ()}  # in model.parameters() order
        self.seen: set[str] = set()
        self.arrived: list[str] = []  # gradients new at the coming moment
        self.in_flight = False
        self.loss_alive = False

    def grads_ready(self, names: tuple[str, ...]) -> None:
        self._land()
        for name in names:
            if name not in self.seen:  # a stage's later moments repeat the gradients done so far
                self.seen.add(name)
                self.arrived.append(name)

    def pre_backward(self, stage: Stage, step: BwdMoment) -> None:
        transient = {"activations": step.saved_left_bytes, "temp": step.temp_bytes}
        for name in self.arrived:
            self._arrive(name, transient)
        if self.immediate and self.arrived:
            largest = max(self.numel[x] for x in self.arrived) * self.elem
            self.schedule.alloc("gradient before its copy", "temp", largest)
            self.in_flight = True
        self.arrived = []

    def _land(self) -> None:
        """The moment recorded: the gradients it saw arrive are in the bucket now."""
        if self.in_flight:
            self.in_flight = False
            self.schedule.free("gradient before its copy")

    def _arrive(self, name: str, transient: dict[str, int]) -> None: ...

    def post_backward(self, stage: Stage, *, first_stage: bool) -> None:
        self._land()
        if not self.loss_alive:
            self.loss_alive = True
            self.schedule.alloc("loss and seed gradient", "activations", IN_BACKWARD_BYTES)

    def free_loss(self) -> None:
        self._land()
        if self.loss_alive:
            self.schedule.free("loss and seed gradient")


class _Stage12Hooks(_EngineHooks):
    """DeepSpeedZeroOptimizer's backward: ``setup_buckets`` at the first gradient; stage 2 (and stage 1
    with ``overlap_comm``) copies each gradient into the bucket as it arrives, stage 1 keeps
    ``param.grad`` until the epilogue copies them in; a full bucket, and the epilogue, reduce it:
    ``allreduce_bucket`` flattens the bucket's gradients (a copy of its elements), then
    ``copy_grads_in_partition`` moves this rank's gradients into ``grads_in_partition`` (made once);
    ``_release_ipg_buffers`` and ``_clear_param_grad_only`` drop the bucket at the end of backward."""

    def __init__(
        self, schedule: _Schedule, facts: ModelFacts, zs: FlatZeroStates, engine: FlatBufferZero, elem: int
    ) -> None:
        super().__init__(schedule, facts, zs, engine, elem)
        self.immediate = zs.stage == 2 or engine.overlap_comm  # gradients into the bucket as they come
        self.held: list[str] = []  # stage 1: param.grad kept until the epilogue
        self.bucket_elements = 0
        self.in_bucket: list[str] = []
        self.partition_buffer = False
        self.started = False

    def _arrive(self, name: str, transient: dict[str, int]) -> None:
        if not self.started:  # process_gradients → setup_buckets, at the first gradient
            self.started = True
            for i in range(self.zs.reduce_buckets):
                self.schedule.alloc(f"reduce bucket {i}", "reduce_scatter", self.zs.reduce_bucket)
        if self.immediate:
            self._into_bucket(name, transient)
        else:
            self.held.append(name)
            self.schedule.alloc(f"grad {name}", "grads_unsharded_in_bwd", self.numel[name] * self.elem)

    def _into_bucket(self, name: str, transient: dict[str, int]) -> None:
        n = self.numel[name]
        if self.bucket_elements + n > self.engine.reduce_bucket_size:
            self._reduce(f"backward: reduce bucket before {name}", transient)
        self.bucket_elements += n
        self.in_bucket.append(name)
        if name in self.held:  # its storage is replaced by a view of the bucket
            self.held.remove(name)
            self.schedule.free(f"grad {name}")

    def _reduce(self, label: str, transient: dict[str, int]) -> None:
        if not self.bucket_elements:
            return
        if self.engine.reduce_scatter and self.engine.contiguous_gradients:
            flat = self.bucket_elements * self.zs.reduce_elem
            self.schedule.record(label, **{**transient, "temp": transient.get("temp", 0) + flat})
        mine = self.zs.params_in_partition.intersection(self.in_bucket)
        if mine and not self.partition_buffer:  # copy_grads_in_partition, for this rank's gradients
            self.partition_buffer = True
            self.schedule.alloc("grads in partition", "grads_unsharded_in_bwd", self.zs.grads_in_partition)
        self.bucket_elements = 0
        self.in_bucket = []

    def end_backward(self) -> None:
        self._land()
        # reduce_gradients: the epilogue copies stage 1's gradients in, in the flat buffer's order
        for name in [x for x in self.numel if x in self.held]:
            self._into_bucket(name, {})
        self._reduce("backward: epilogue reduces the bucket", {})
        if self.started:
            for i in range(self.zs.reduce_buckets):
                self.schedule.free(f"reduce bucket {i}")
        self.free_loss()


class _Stage3Hooks(_EngineHooks):
    """DeepSpeedZeroOptimizer_Stage3's hooks on every module (its own parameters, not its children's).

    Forward: a module's pre-forward all-gathers its parameters not yet gathered, waits for them, then
    prefetches the next parameters of the recorded trace (``stage3_prefetch_bucket_size`` elements, at
    most ``stage3_max_live_parameters`` gathered in all) in one coalesced all-gather: a flat buffer of
    N × their partitions (``_all_gather_dtype``), turned into whole parameters (``torch.cat`` of the
    partitions) when the first of them is waited for, freed once the last of them has been fetched.
    A parameter used again within ``stage3_max_reuse_distance`` elements is kept gathered (the
    default keeps every one from forward to its backward). Parameters under the persistence threshold are
    never gathered. The tracker files what forward gathers as activations.

    Backward: each gradient is copied into the bucket as it arrives; a full bucket, and the epilogue,
    reduce it (``reduce_scatter_coalesced``: a padded, interleaved copy of the bucket's gradients, N ×
    their partitions; gloo reduces a staging copy of it), then ``partition_grads`` copies this rank's
    part into ``grad_partitions_flat_buffer``. A module's parameters are released after its backward."""

    def __init__(
        self,
        schedule: _Schedule,
        facts: ModelFacts,
        zs: FlatZeroStates,
        engine: FlatBufferZero,
        elem: int,
        *,
        world_size: int,
        gloo: bool,
    ) -> None:
        super().__init__(schedule, facts, zs, engine, elem)
        self.immediate = True  # __add_grad_to_ipg_bucket, from the gradient's hook
        self.n = world_size
        self.gloo = gloo
        self.gathered_kind = {
            name for name, x in self.numel.items() if x > engine.param_persistence_threshold
        }  # partitioned: gathered for use
        self.queue = [p.name for p in facts.params or () if p.name in self.gathered_kind]  # the trace
        self.issued: dict[str, int] = {}  # parameter → its all-gather batch
        self.batches: list[list[str]] = []
        self.pending: dict[int, set[str]] = {}  # batch → parameters not yet fetched (its flat alive)
        self.whole: set[str] = set()  # gathered, whole
        self.available = 0  # elements gathered or in flight
        self.bucket_elements = 0
        self.bucket_partitions = 0  # elements of the bucket's gradients, padded to N partitions each

    # ---- forward ------------------------------------------------------------------------------------
    def _issue(self, names: list[str]) -> None:
        if not names:
            return
        b = len(self.batches)
        self.batches.append(names)
        self.pending[b] = set(names)
        for name in names:
            self.issued[name] = b
            self.available += self.numel[name]
        flat = self.n * sum(-(-self.numel[x] // self.n) for x in names) * self.elem
        self.schedule.alloc(f"all-gather flat {b}", "activations", flat)

    def _prefetch(self) -> None:
        limit = min(self.engine.max_live_parameters - self.available, self.engine.prefetch_bucket_size)
        batch: list[str] = []
        numel = 0
        while self.queue and numel < limit:
            name = self.queue.pop(0)
            if name not in self.issued:
                batch.append(name)
                numel += self.numel[name]
        self._issue(batch)

    def _fetch(self, names: list[str]) -> None:
        """A module's pre-forward: gather what is missing, wait, then prefetch what follows."""
        names = [x for x in names if x in self.gathered_kind]
        self._issue([x for x in names if x not in self.issued])
        for name in names:
            b = self.issued[name]
            if not any(x in self.whole for x in self.batches[b]):  # the first wait splits the whole batch
                for x in self.batches[b]:
                    self.whole.add(x)
                    self.schedule.alloc(f"gathered {x}", "activations", self.numel[x] * self.elem)
            self.pending[b].discard(name)
            if not self.pending[b]:
                self.schedule.free(f"all-gather flat {b}")
        self.queue = [x for x in self.queue if x not in names]
        self._prefetch()

    def start_forward(self) -> None:
        self._prefetch()  # the root module's pre-forward (the root holds no parameters of its own)

    def pre_forward(self, stage: Stage) -> None:
        modules = _modules(stage.params)
        if stage.in_model is not None:
            modules = modules[:-1]  # the output projection is fetched inside the model (in_model)
        for names in modules:
            self._fetch(names)

    def in_model(self, stage: Stage) -> None:
        kept, logits = stage.in_model or (0, 0)
        self.schedule.record(f"forward: {stage.name} (before its last module's all-gather)", activations=kept)
        self._fetch(_modules(stage.params)[-1])
        self.schedule.record(f"forward: {stage.name} (in the model)", activations=kept, fwd_temp=logits)

    # ---- backward -----------------------------------------------------------------------------------
    def _arrive(self, name: str, transient: dict[str, int]) -> None:
        n = self.numel[name]
        if self.bucket_elements + n > self.engine.reduce_bucket_size and self.bucket_elements:
            self._reduce(f"backward: reduce bucket before {name}", transient)
        self.bucket_elements += n
        self.bucket_partitions += self.n * -(-n // self.n)

    def _reduce(self, label: str, transient: dict[str, int]) -> None:
        if not self.bucket_elements:
            return
        interleaved = self.bucket_partitions * self.elem * (2 if self.gloo else 1)
        self.schedule.record(label, **{**transient, "temp": transient.get("temp", 0) + interleaved})
        self.bucket_elements = self.bucket_partitions = 0

    def post_backward(self, stage: Stage, *, first_stage: bool) -> None:
        super().post_backward(stage, first_stage=first_stage)
        for name in stage.params:
            if name in self.whole:
                self.whole.discard(name)
                self.schedule.free(f"gathered {name}")

    def end_backward(self) -> None:
        self._land()
        self._reduce("backward: epilogue reduces the bucket", {})
        for name in sorted(self.whole):
            self.schedule.free(f"gathered {name}")
        self.whole.clear()
        self.free_loss()


def _modules(names: tuple[str, ...]) -> list[list[str]]:
    """A stage's parameters grouped by the module that holds them, in order."""
    out: dict[str, list[str]] = {}
    for name in names:
        out.setdefault(name.rpartition(".")[0], []).append(name)
    return list(out.values())


def _stage3_step(schedule: _Schedule, zs: FlatZeroStates, persistent_flat: int) -> None:
    """``step``: the update on the master partition, then the persistent parameters all-gathered again
    (a flat buffer of N × their partitions while their whole copies are replaced one by one)."""
    schedule.record("optimizer step", activations=LOSS_BYTES, optim_temp=zs.update_temp)
    if persistent_flat:
        schedule.record("optimizer step: persistent parameters all-gathered", activations=persistent_flat)


def _stage12_step(schedule: _Schedule, zs: FlatZeroStates, *, partition_buffer: bool) -> None:
    """``step``: the gradient norms, then the gradient partition flattened to fp32
    (``flatten(averaged_gradients)``) while ``grads_in_partition`` is alive, freed with it before the
    update."""
    schedule.alloc("gradient norms", "step_temp", GRAD_NORM_BYTES)
    schedule.alloc("fp32 gradient partition", "step_temp", zs.grad_partition)
    schedule.record("optimizer step: flat gradient partition", activations=LOSS_BYTES)
    if partition_buffer:
        schedule.free("grads in partition")
    schedule.record("optimizer step", activations=LOSS_BYTES, optim_temp=zs.update_temp)
    schedule.free("fp32 gradient partition")
    schedule.free("gradient norms")


def flat_zero_schedule(
    facts: ModelFacts,
    zs: FlatZeroStates,
    profile: ActivationProfile,
    engine: FlatBufferZero,
    elem: int,
    *,
    world_size: int,
    backend: str,
) -> list[Event]:
    """The events of one DeepSpeed ZeRO step, as the tracker files them."""
    schedule = _Schedule()
    alloc_resident(schedule, zs.rank_states(), profile)
    if zs.stage == 3:
        # resident from the engine's construction: the gradient partition and the bucket
        schedule.alloc("gradient partition", "grads", zs.grad_partition)
        schedule.alloc("reduce bucket", "reduce_scatter", zs.reduce_bucket * zs.reduce_buckets)
        hooks: _Hooks = _Stage3Hooks(
            schedule, facts, zs, engine, elem, world_size=world_size, gloo=backend == "gloo"
        )
    else:
        hooks = stage12 = _Stage12Hooks(schedule, facts, zs, engine, elem)
    _forward(schedule, profile.stages, hooks)
    _backward(schedule, profile.stages, hooks)
    hooks.end_backward()
    if zs.stage == 3:
        persistent = [p.numel for p in facts.params or () if p.numel <= engine.param_persistence_threshold]
        _stage3_step(schedule, zs, world_size * sum(-(-x // world_size) for x in persistent) * elem)
    else:
        _stage12_step(schedule, zs, partition_buffer=stage12.partition_buffer)
    return schedule.events


__all__ = ["FlatZeroStates", "flat_zero_schedule", "flat_zero_states"]
