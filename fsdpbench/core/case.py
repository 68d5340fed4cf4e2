"""One fully specified configuration — the unit that fsdpbench runs, measures and predicts."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsdpbench.core.names import REFERENCE_STRATEGY
from fsdpbench.core.precision import Precision, get_precision, runnable_precisions

# the largest values a case accepts, from a scenario (pipeline/scenario.py) or a command line (predict)
MAX_BATCH_SIZE = 1_000_000
MAX_SEQ_LEN = 10_000_000
MAX_PREFETCH = 64
MAX_WORLD_SIZE = 4096
MAX_STEPS = 1_000_000
MAX_TEXT = 200  # one name or value (model, strategy, class names)

PRECISIONS = runnable_precisions()
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum", "adadelta")
WRAPS = ("none", "whole", "block", "size", "classes")
BACKWARD_PREFETCH_POLICIES = ("pre", "post", "none")


def wrap_text(wrap: Any, min_params: Any = None, classes: Any = None) -> str:
    """The wrap policy as a person reads it, with what tells two of a kind apart: ``size(1e+05)``
    (least parameters per unit), ``classes(Block)``; the other policies by name."""
    if wrap == "size" and min_params is not None and min_params == min_params:
        n = int(min_params)
        short = f"{n:.0e}".replace("e+0", "e").replace("e+", "e")  # 100000 → 1e5, exact ones only
        return f"size({short if n >= 10_000 and float(short) == n else n})"
    if wrap == "classes" and classes is not None and len(classes):
        names = classes.split(",") if isinstance(classes, str) else list(classes)
        return f"classes({','.join(str(n) for n in names)})"
    return str(wrap)


# how the checkpoint phase saves and loads (fsdpbench/engine/checkpoint.py); a strategy declares which it
# runs. "native": the engine's own checkpoint API (DeepSpeed's save_checkpoint/load_checkpoint)
CHECKPOINT_METHODS = ("none", "full", "sharded", "dcp", "dcp_async", "native")
# how fsdpbench tunes the host of CPU ranks (fsdpbench/hosttuning), each with what it does. Part of what is
# measured, so part of a case's id; never decided from the machine's load or from the environment
NO_HOST_TUNING, PIN, PIN_IDLE_LOOPS = "none", "pin", "pin-idle-loops"
HOST_TUNINGS = {
    NO_HOST_TUNING: "CPU ranks as the machine runs them (every thread where the scheduler puts it)",
    PIN: "each CPU rank's compute threads bound to cores of its own, where there is a core per thread",
    PIN_IDLE_LOOPS: "pinned, and gloo's loop threads under SCHED_IDLE, gloo's threads on the rank's cores",
}
# the same tunings in the scheduler's words, for gloo's threads (a CPU case's run prints its line)
GLOO_THREADS = {
    NO_HOST_TUNING: "gloo's and the compute threads under SCHED_OTHER (the kernel's fair scheduler), "
    "on any core, shared with the rest of the machine",
    PIN: "compute threads bound one per core of the rank's own; gloo's under SCHED_OTHER (the default "
    "group's on any core, a later group's on the rank's main core)",
    PIN_IDLE_LOOPS: "compute threads bound one per core of the rank's own; gloo's loop threads under "
    "SCHED_IDLE (a core only when no other thread wants it), all of gloo's on the rank's cores",
}
# how activation checkpointing treats the blocks (engine/knobs.py): "full" recomputes every block; "op" is
# torchtitan's selective op-level policy; "every:N" (N >= 2) recomputes every N-th block whole
AC_FULL, AC_OP, AC_EVERY = "full", "op", "every:"
AC_WORDS = ("false", "true", "none", AC_FULL, AC_OP, AC_EVERY + "N")
# how the optimizer's update runs: one parameter at a time, grouped torch._foreach_* ops, or fused kernels
OPTIMIZER_IMPLS = ("for-loop", "foreach", "fused")
# fields that do not change what is measured, so not part of a case id (resume finds the case again).
# The reference-interleaved blocks run after every other phase and record no loss, so switching them on
# changes no other column: a baseline's case ids stay valid (fsdpbench.engine.reference).
_NOT_IN_ID = (
    "scenario",
    "timeout_s",
    "time_blocks",
    "time_block_steps",
    "keep_checkpoints",
    "checkpoint_max_bytes",
)
# a case id names a directory and files: only these characters, and never '/', '..' alone or a leading '.'
_SAFE_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")
MAX_ID_CHARS = 200


# ---- what each field declares besides its type and default ----------------------------------------------
@dataclass(frozen=True, slots=True)
class Accepts:
    """What a scenario may set a case field to. ``pipeline/scenario.py`` builds its schema from these and
    checks strictly (a bool is not an int, a string is not a number); the bounds are pydantic's
    ``Field`` arguments of the same names. A dict field takes names to scalars (``model_args``)."""

    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    choices: tuple[str, ...] = ()  # a text field: one of these; a list field: or one of these words
    items: Accepts | None = None  # a list field (a tuple of the case): what each item may be
    one_item: bool = False  # a list field: one item alone stands for the list of it
    pattern: str | None = None  # a flag: or a word matching this (activation_checkpointing: op)

    def bounds(self) -> dict[str, float]:
        """The bounds that are set, as keyword arguments of pydantic's ``Field``."""
        names = ("gt", "ge", "le", "min_length", "max_length", "pattern")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class Section(enum.Enum):
    """The part of a case a field belongs to (as torchtitan's job config groups its options); the value
    is the section's name in docs and in the scenario's error messages."""

    MODEL = "model"
    PARALLELISM = "parallelism"
    FSDP1 = "fsdp1"
    TRAINING = "training"
    PROTOCOL = "protocol"
    CHECKPOINT = "checkpoint"
    EMULATION = "emulation"
    HOST = "host"

    @property
    def doc(self) -> str:
        return _SECTION_DOCS[self]


_SECTION_DOCS = {
    Section.MODEL: "the model, the data each rank trains on, and the seed of both",
    Section.PARALLELISM: "the strategy, its ranks and FSDP units, and where parameters live",
    Section.FSDP1: "knobs that only the FSDP1 strategies read",
    Section.TRAINING: "precision, optimizer, and what wraps the step (activation checkpointing, compile)",
    Section.PROTOCOL: "the phases a rank runs, how many steps each, the samplers and the time limit",
    Section.CHECKPOINT: "the checkpoint phase: method, what is saved, limits",
    Section.EMULATION: "ranks run alone on one device with a fake process group",
    Section.HOST: "the device, backend and allocator settings the case runs with, and how its host is tuned",
}


def case_field(
    default: Any = dataclasses.MISSING,
    *,
    section: Section | None = None,
    doc: str,
    accepts: Accepts | None,
    column: str | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A field of ``Case`` with what is derived from it: ``section`` is the part of the case it belongs
    to (required: ``field_section``); ``doc``, one line, is its column's doc in the results
    (fsdpbench/core/schema.py declares a column per field, named ``column`` or the field's name);
    ``accepts`` is what a scenario may set it to (None: a scenario cannot set it)."""
    metadata = {"section": section, "doc": doc, "accepts": accepts, "column": column}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def field_doc(f: dataclasses.Field[Any]) -> str:
    """The one-line doc a ``case_field`` declares; TypeError naming a field declared without one."""
    doc = f.metadata.get("doc")
    if not isinstance(doc, str) or not doc:
        raise TypeError(f"case field {f.name} has no doc: declare it with case_field(..., doc=...)")
    if "\n" in doc or "|" in doc:
        raise TypeError(f"case field {f.name}: its doc is one line of a table (no newline, no '|')")
    return doc


def field_section(f: dataclasses.Field[Any]) -> Section:
    """The section a ``case_field`` declares; TypeError naming a field declared without one."""
    section = f.metadata.get("section")
    if not isinstance(section, Section):
        raise TypeError(
            f"case field {f.name} has no section: declare it with case_field(..., section=Section.…)"
        )
    return section


def field_column(f: dataclasses.Field[Any]) -> str:
    """The name of the results column of a case field: its own, unless it declares another."""
    return f.metadata.get("column") or f.name


def field_accepts(f: dataclasses.Field[Any]) -> Accepts | None:
    """What a scenario may set a case field to; None where a scenario cannot set it."""
    field_doc(f)  # every field declares its doc and what a scenario may give it, together
    if "accepts" not in f.metadata:
        raise TypeError(f"case field {f.name}: declare what a scenario may set it to (accepts=...)")
    accepts: Accepts | None = f.metadata["accepts"]
    return accepts


_TEXT = Accepts(min_length=1, max_length=MAX_TEXT)  # a registry name, a class name
_FLAG = Accepts()  # true or false
_COUNT = Accepts(gt=0)  # 1 and up
_POSITIVE_STEPS = Accepts(gt=0, le=MAX_STEPS)
_STEPS = Accepts(ge=0, le=MAX_STEPS)  # 0: the phase does not run
_RANKS = Accepts(gt=0, le=MAX_WORLD_SIZE)
_SECONDS = Accepts(gt=0, le=7 * 24 * 3600)


@dataclass(kw_only=True, slots=True)
class Case:
    """Everything one run of one configuration needs; plain data, JSON-serialisable.

    Each field is declared once, here: its type, default, one-line doc and what a scenario may set it
    to. The scenario's schema (``pipeline/scenario.CaseFields``) and the configuration columns of the
    results (``schema.CASE_FIELD_COLUMNS``, ``schema.case_to_columns``/``case_from_columns``) are
    derived from these declarations."""

    scenario: str = case_field(
        "adhoc", section=Section.PROTOCOL, doc="the scenario's name", accepts=None
    )  # the file's name
    model: str = case_field(
        "decoder-tiny",
        section=Section.MODEL,
        doc="the model's registry name, or an own model's package.module:factory",
        accepts=_TEXT,
    )
    model_args: dict[str, Any] = case_field(
        factory=dict, section=Section.MODEL, doc="the model's arguments (JSON)", accepts=Accepts()
    )
    strategy: str = case_field(
        REFERENCE_STRATEGY,
        section=Section.PARALLELISM,
        doc="the strategy's registry name (ddp, zero1, zero2, zero3, hsdp, fsdp1_*, ds_zero*, plugins)",
        accepts=_TEXT,
    )
    strategy_args: dict[str, Any] = case_field(
        factory=dict, section=Section.PARALLELISM, doc="the strategy's arguments (JSON)", accepts=Accepts()
    )
    world_size: int = case_field(1, section=Section.PARALLELISM, doc="ranks of the case", accepts=_RANKS)
    # HSDP: ranks per shard group (replicas = world_size / shard_size)
    shard_size: int | None = case_field(
        None, section=Section.PARALLELISM, doc="HSDP: ranks per shard group", accepts=_RANKS
    )
    wrap: str = case_field(
        "block",
        section=Section.PARALLELISM,
        doc="how FSDP units are chosen (none, block, ...)",
        accepts=Accepts(choices=WRAPS),
    )
    wrap_min_params: int = case_field(
        100_000,
        section=Section.PARALLELISM,
        doc="size-based wrapping: least parameters per unit",
        accepts=_COUNT,
    )
    wrap_classes: tuple[str, ...] = case_field(
        (),
        section=Section.PARALLELISM,
        doc="module classes wrapped as units (comma-separated)",
        accepts=Accepts(items=_TEXT),
    )
    prefetch: int = case_field(
        0,
        section=Section.PARALLELISM,
        doc="FSDP2 explicit prefetch depth",
        accepts=Accepts(ge=0, le=MAX_PREFETCH),
    )
    precision: str = case_field(
        "fp32",
        section=Section.TRAINING,
        doc="mixed-precision policy name",
        accepts=Accepts(choices=PRECISIONS),
    )
    optimizer: str = case_field(
        "adamw", section=Section.TRAINING, doc="the optimizer's name", accepts=Accepts(choices=OPTIMIZERS)
    )
    lr: float = case_field(1e-3, section=Section.TRAINING, doc="learning rate", accepts=Accepts(gt=0, le=1e3))
    batch_size: int = case_field(
        4, section=Section.MODEL, doc="samples per rank per step", accepts=Accepts(gt=0, le=MAX_BATCH_SIZE)
    )
    seq_len: int = case_field(
        64,
        section=Section.MODEL,
        doc="tokens per sample (sequence models)",
        accepts=Accepts(gt=0, le=MAX_SEQ_LEN),
    )
    warmup_steps: int = case_field(
        2, section=Section.PROTOCOL, doc="untimed steps before the timed ones", accepts=_STEPS
    )
    steps: int = case_field(
        5, section=Section.PROTOCOL, doc="timed steps", accepts=_POSITIVE_STEPS, column="timed_steps"
    )
    memory_steps: int = case_field(1, section=Section.PROTOCOL, doc="memory-tracked steps", accepts=_STEPS)
    profile_steps: int = case_field(1, section=Section.PROTOCOL, doc="profiled steps", accepts=_STEPS)
    seed: int = case_field(
        0, section=Section.MODEL, doc="random seed of the model and data", accepts=Accepts(ge=0, le=2**63 - 1)
    )
    backend: str = case_field(
        "gloo",
        section=Section.HOST,
        doc="the process group's backend (gloo, nccl)",
        accepts=Accepts(choices=("auto", "gloo", "nccl")),
    )
    device: str = case_field(
        "cpu", section=Section.HOST, doc="cpu or cuda", accepts=Accepts(choices=("auto", "cpu", "cuda"))
    )
    timeout_s: float = case_field(
        120.0, section=Section.PROTOCOL, doc="the case's time limit (s)", accepts=_SECONDS
    )
    # a scenario gives one value (false, true, full, op, every:N): ``resolve_activation_checkpointing``
    # splits it into these two fields, so that ``true`` and ``full`` are one case with one id (a scenario
    # may also give the policy alone beside ``activation_checkpointing: true``)
    activation_checkpointing: bool = case_field(
        False,
        section=Section.TRAINING,
        doc="activation checkpointing applied (activation_checkpointing_policy: how)",
        accepts=Accepts(pattern=r"^(?:false|true|none|full|op|every:[1-9][0-9]{0,3})$"),
    )
    activation_checkpointing_policy: str = case_field(
        AC_FULL,
        section=Section.TRAINING,
        doc="full (every block recomputed), op (torchtitan's selective op policy), every:N (N-th blocks)",
        accepts=Accepts(pattern=r"^(?:full|op|every:[1-9][0-9]{0,3})$"),
    )
    optimizer_impl: str = case_field(
        "for-loop",
        section=Section.TRAINING,
        doc="the optimizer's update: for-loop (one parameter at a time), foreach or fused",
        accepts=Accepts(choices=OPTIMIZER_IMPLS),
    )
    max_norm: float | None = case_field(
        None,
        section=Section.TRAINING,
        doc="gradient clipping to this total norm (clip_grad_norm_); none: no clipping",
        accepts=Accepts(gt=0, le=1e9),
    )
    compile: bool = case_field(False, section=Section.TRAINING, doc="torch.compile applied", accepts=_FLAG)
    cpu_offload: bool = case_field(
        False,
        section=Section.PARALLELISM,
        doc="parameters (and optimizer state) offloaded to the host",
        accepts=_FLAG,
    )
    backward_prefetch: str = case_field(
        "pre",
        section=Section.FSDP1,
        doc="FSDP1 backward prefetch policy",
        accepts=Accepts(choices=BACKWARD_PREFETCH_POLICIES),
    )
    forward_prefetch: bool = case_field(
        False, section=Section.FSDP1, doc="FSDP1 forward prefetch", accepts=_FLAG
    )
    limit_all_gathers: bool = case_field(True, section=Section.FSDP1, doc="FSDP1 rate limiter", accepts=_FLAG)
    nvml_interval_s: float = case_field(
        0.01, section=Section.PROTOCOL, doc="the samplers' interval (s)", accepts=Accepts(ge=0.001, le=60)
    )
    # >0: also time a bare loop of this many steps (the harness-overhead check)
    bare_steps: int = case_field(
        0, section=Section.PROTOCOL, doc="steps of the bare loop (harness overhead); 0: none", accepts=_STEPS
    )
    # >0: this many blocks of steps, each step paired with a fixed reference workload
    time_blocks: int = case_field(
        0,
        section=Section.PROTOCOL,
        doc="blocks of steps paired with the reference step (CI time gate); 0: none",
        accepts=_STEPS,
    )
    # steps (and reference steps) per block: one step-time ratio sample per block
    time_block_steps: int = case_field(
        3, section=Section.PROTOCOL, doc="step/reference pairs per block", accepts=_POSITIVE_STEPS
    )
    # run these ranks one at a time, each alone on one device with a fake process group of world_size
    # (collectives are no-ops, every allocation is real): see fsdpbench/engine/emulate.py
    emulate: bool = case_field(
        False, section=Section.EMULATION, doc="emulation asked for (--emulate)", accepts=_FLAG
    )
    emulate_ranks: tuple[int, ...] = case_field(
        (0,),
        section=Section.EMULATION,
        doc="the ranks run alone under emulation (comma-separated)",
        accepts=Accepts(choices=("all",), items=Accepts(ge=0, le=MAX_WORLD_SIZE), one_item=True),
    )
    # after every other phase: save, load into a freshly built model and optimizer, one more step
    checkpoint: str = case_field(
        "none",
        section=Section.CHECKPOINT,
        doc="the checkpoint phase's method (none: no phase; docs/checkpointing.md)",
        accepts=Accepts(choices=CHECKPOINT_METHODS),
    )
    checkpoint_optimizer: bool = case_field(
        True, section=Section.CHECKPOINT, doc="the optimizer state saved and loaded too", accepts=_FLAG
    )
    # (default: removed once measured)
    keep_checkpoints: bool = case_field(
        False,
        section=Section.CHECKPOINT,
        doc="the checkpoint files kept in the case directory",
        accepts=_FLAG,
    )
    checkpoint_max_bytes: int = case_field(
        4 * 2**30,
        section=Section.CHECKPOINT,
        doc="a case whose files would exceed this is refused",
        accepts=Accepts(gt=0, le=2**50),
    )
    # fsdpbench/predictors/memory_model/allocator.py parses and models them; "" = torch's defaults
    alloc_conf: str = case_field(
        "",
        section=Section.HOST,
        doc="the CUDA caching allocator's settings (PYTORCH_CUDA_ALLOC_CONF syntax)",
        accepts=Accepts(max_length=MAX_TEXT),
    )
    # opt-in: by default fsdpbench measures the ranks as the machine runs them (HOST_TUNINGS)
    host_tuning: str = case_field(
        NO_HOST_TUNING,
        section=Section.HOST,
        doc="host tuning of CPU ranks: none, pin (compute threads bound to cores), pin-idle-loops "
        "(and gloo's loop threads under SCHED_IDLE); docs/step-time-model.md",
        accepts=Accepts(choices=tuple(HOST_TUNINGS)),
    )
    # the allocator's limit as torch.cuda.set_per_process_memory_fraction sets it (fsdpbench check's fits
    # boundary); the allocator model replays under the same limit
    memory_fraction: float = case_field(
        0.0,
        section=Section.HOST,
        doc="share of the GPU's memory the caching allocator may reserve (0: no limit)",
        accepts=Accepts(ge=0, le=1),
    )

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def precision_spec(self) -> Precision:
        """The typed record of ``precision``: bytes per copy and the dtypes to cast and reduce in."""
        return get_precision(self.precision)

    @property
    def shard_group_size(self) -> int:
        """Ranks per shard group of a shard-group (HSDP) strategy: ``shard_size``, by default 2
        (4 ranks are 2 replicas × 2 shards)."""
        return self.shard_size or min(2, self.world_size)

    @property
    def mode(self) -> str:
        """'emulated' (one rank at a time, fake process group) or 'real' (every rank, real collectives)."""
        return "emulated" if self.emulate else "real"

    @property
    def devices_needed(self) -> int:
        """Devices this case occupies at once: an emulated rank runs alone on one device."""
        return 1 if self.emulate else self.world_size

    @property
    def case_id(self) -> str:
        """Readable, stable id: key axes plus a short hash of every field."""
        # only fields that differ from the defaults: a new field (with a default) keeps old ids valid
        fields = {k: v for k, v in self.to_dict().items() if k not in _NOT_IN_ID and v != _DEFAULTS.get(k)}
        digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:6]
        model = self.model.replace(":", ".") + "".join(
            f"-{safe_part(k)}{safe_part(str(v))}" for k, v in sorted(self.model_args.items())
        )
        parts = [safe_part(self.strategy.replace(":", ".")), f"n{self.world_size}", safe_part(model, 120)]
        if self.shard_size:
            parts.append(f"s{self.shard_size}")
        parts += [self.wrap, f"pf{self.prefetch}", self.precision, f"b{self.batch_size}"]
        # knobs, named only when switched from their defaults (ids of plain cases do not change)
        parts += [
            name
            for name, on in (
                (_ac_part(self.activation_checkpointing_policy), self.activation_checkpointing),
                ("compile", self.compile),
                ("offload", self.cpu_offload),
            )
            if on
        ]
        if self.optimizer_impl != _DEFAULTS["optimizer_impl"]:
            parts.append(self.optimizer_impl)
        if self.max_norm is not None:
            parts.append(f"clip{self.max_norm:g}")
        if self.backward_prefetch != _DEFAULTS["backward_prefetch"]:
            parts.append(f"bwd-{self.backward_prefetch}")
        if self.forward_prefetch:
            parts.append("fwdpf")
        if self.emulate:
            parts.append("emulated")
        if self.checkpoint != "none":
            parts.append(f"ckpt-{self.checkpoint}" + ("" if self.checkpoint_optimizer else "-model"))
        if self.alloc_conf:
            parts.append("alloc-" + safe_part(self.alloc_conf.replace(":", "-").replace(",", "_")))
        if self.host_tuning != NO_HOST_TUNING:
            parts.append("host-" + self.host_tuning)
        readable = "_".join(parts)[:MAX_ID_CHARS]
        return readable + "_" + digest

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Case:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown Case fields: {sorted(unknown)}")
        data = dict(data)
        for name in _TUPLE_FIELDS:  # a list in JSON
            if name in data:
                data[name] = tuple(data[name])
        return cls(**data)

    def replace(self, **changes: Any) -> Case:
        return dataclasses.replace(self, **changes)

    @classmethod
    def sections(cls) -> dict[Section, tuple[str, ...]]:
        """Every section's field names, in the order of ``Section`` and of declaration."""
        return {section: names for section, names in _SECTIONS.items() if names}

    @classmethod
    def section_of(cls, name: str) -> Section:
        """The section of the field ``name`` (KeyError: not a field of Case)."""
        return _SECTION_OF[name]


def resolve_activation_checkpointing(value: bool | str) -> tuple[bool, str]:
    """A scenario's or a command line's ``activation_checkpointing`` as the case's two fields (on, policy);
    ValueError naming the allowed values. ``true`` and ``every:1`` are ``full``."""
    if isinstance(value, bool):
        return value, AC_FULL
    word = str(value).strip().lower()
    if word in ("false", "none"):
        return False, AC_FULL
    if word in ("true", AC_FULL):
        return True, AC_FULL
    if word == AC_OP:
        return True, AC_OP
    every = ac_every(word)
    if every is not None:
        return True, AC_FULL if every == 1 else f"{AC_EVERY}{every}"
    raise ValueError(f"{value!r} is not one of {', '.join(AC_WORDS)} (N a whole number of blocks, 1 to 9999)")


def ac_every(policy: str) -> int | None:
    """N of an ``every:N`` policy; None for any other policy."""
    if not policy.startswith(AC_EVERY):
        return None
    digits = policy[len(AC_EVERY) :]
    return int(digits) if digits.isdigit() and 1 <= int(digits) <= 9999 else None


def _ac_part(policy: str) -> str:
    """The case id's name of the checkpointing knob: ``ac`` for full (the ids of such cases never change)."""
    return "ac" if policy == AC_FULL else "ac-" + policy.replace(":", "")


def safe_part(text: str, max_chars: int = 64) -> str:
    """``text`` itself where it is made of the safe alphabet (so ids of plain cases never change),
    else a short hash of it: a value cannot put '/', '..' or markup into a path."""
    if _SAFE_PART.fullmatch(text) and len(text) <= max_chars and ".." not in text:
        return text
    return "h" + hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value


_DEFAULTS = Case().to_dict()
# checked on import: a field declared without a section is a TypeError naming it
_SECTION_OF = {f.name: field_section(f) for f in dataclasses.fields(Case)}
_SECTIONS = {section: tuple(n for n, s in _SECTION_OF.items() if s is section) for section in Section}
_TUPLE_FIELDS = tuple(
    name for name, hint in typing.get_type_hints(Case).items() if typing.get_origin(hint) is tuple
)
