"""One fully specified configuration — the unit that fsdpbench runs, measures and predicts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from fsdpbench.precision import Precision, get_precision, runnable_precisions
from fsdpbench.schema import (
    CASE_ID,
    EMULATE_RANKS,
    GLOBAL_BATCH_SIZE,
    MODE,
    MODEL_ARGS,
    STRATEGY_ARGS,
    TIMED_STEPS,
    WRAP_CLASSES,
)
from fsdpbench.strategies.names import REFERENCE_STRATEGY

# the largest values a case accepts, from a scenario (pipeline/scenario.py) or a command line (predict)
MAX_BATCH_SIZE = 1_000_000
MAX_SEQ_LEN = 10_000_000
MAX_PREFETCH = 64

PRECISIONS = runnable_precisions()
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum", "adadelta")
WRAPS = ("none", "whole", "block", "size", "classes")
BACKWARD_PREFETCH_POLICIES = ("pre", "post", "none")
# how the checkpoint phase saves and loads (fsdpbench/engine/checkpoint.py); a strategy declares which it
# runs. "native": the engine's own checkpoint API (DeepSpeed's save_checkpoint/load_checkpoint)
CHECKPOINT_METHODS = ("none", "full", "sharded", "dcp", "dcp_async", "native")
# fields that do not change what is measured, so not part of a case id (resume finds the case again).
# The reference-interleaved blocks run after every other phase and record no loss, so switching them on
# changes no other column: a baseline's case ids stay valid (fsdpbench.metrics.reference).
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


_JSON_FIELDS = (MODEL_ARGS, STRATEGY_ARGS)  # dicts, stored as JSON text


@dataclass(kw_only=True, slots=True)
class Case:
    """Everything one run of one configuration needs; plain data, JSON-serialisable."""

    scenario: str = "adhoc"
    model: str = "decoder-tiny"
    model_args: dict[str, Any] = field(default_factory=dict)
    strategy: str = REFERENCE_STRATEGY
    strategy_args: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    shard_size: int | None = None  # HSDP: ranks per shard group (replicas = world_size / shard_size)
    wrap: str = "block"
    wrap_min_params: int = 100_000
    wrap_classes: tuple[str, ...] = ()
    prefetch: int = 0
    precision: str = "fp32"
    optimizer: str = "adamw"
    lr: float = 1e-3
    batch_size: int = 4
    seq_len: int = 64
    warmup_steps: int = 2
    steps: int = 5
    memory_steps: int = 1
    profile_steps: int = 1
    seed: int = 0
    backend: str = "gloo"
    device: str = "cpu"
    timeout_s: float = 120.0
    activation_checkpointing: bool = False
    compile: bool = False
    cpu_offload: bool = False
    backward_prefetch: str = "pre"  # FSDP1 BackwardPrefetch
    forward_prefetch: bool = False  # FSDP1
    limit_all_gathers: bool = True  # FSDP1
    nvml_interval_s: float = 0.01
    bare_steps: int = 0  # >0: also time a bare loop of this many steps (the harness-overhead check)
    time_blocks: int = 0  # >0: this many blocks of steps, each step paired with a fixed reference workload
    time_block_steps: int = 3  # steps (and reference steps) per block: one step-time ratio sample per block
    # run these ranks one at a time, each alone on one device with a fake process group of world_size
    # (collectives are no-ops, every allocation is real): see fsdpbench/predictors/emulate.py
    emulate: bool = False
    emulate_ranks: tuple[int, ...] = (0,)
    # after every other phase: save, load into a freshly built model and optimizer, one more step
    checkpoint: str = "none"  # one of CHECKPOINT_METHODS
    checkpoint_optimizer: bool = True  # save the optimizer state beside the model
    keep_checkpoints: bool = False  # leave the files in the case directory (default: removed once measured)
    checkpoint_max_bytes: int = 4 * 2**30  # refuse a case whose predicted files are larger than this
    # the CUDA caching allocator's settings for the rank processes, PYTORCH_CUDA_ALLOC_CONF's syntax
    # (fsdpbench/predictors/memory_model/allocator.py parses and models them; "" = torch's defaults)
    alloc_conf: str = ""

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
        model = self.model + "".join(
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
                ("ac", self.activation_checkpointing),
                ("compile", self.compile),
                ("offload", self.cpu_offload),
            )
            if on
        ]
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
        readable = "_".join(parts)[:MAX_ID_CHARS]
        return readable + "_" + digest

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    # ---- the case as the configuration columns of its result rows, and back (the one place) ----------
    def to_columns(self) -> dict[str, Any]:
        """The configuration columns of the case's rows (fsdpbench/schema.py declares each)."""
        d = self.to_dict()
        for name in _JSON_FIELDS:
            d[name] = json.dumps(d[name], sort_keys=True)
        d[WRAP_CLASSES] = ",".join(d[WRAP_CLASSES])
        d[EMULATE_RANKS] = ",".join(map(str, d[EMULATE_RANKS]))
        d[MODE] = self.mode  # emulated: one rank alone with a fake process group (predictors/emulate.py)
        d[CASE_ID] = self.case_id
        d[GLOBAL_BATCH_SIZE] = self.global_batch_size
        d[TIMED_STEPS] = d.pop("steps")
        return d

    @classmethod
    def from_columns(cls, row: Any) -> Case:
        """The case of a result row (a mapping or a pandas row, as read back from Parquet)."""
        data: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            col = TIMED_STEPS if f.name == "steps" else f.name
            if col not in row:
                continue
            value = row[col]
            value = value.item() if hasattr(value, "item") else value
            if f.name in _JSON_FIELDS and isinstance(value, str):
                value = json.loads(value or "{}")
            elif f.name == WRAP_CLASSES:
                value = tuple(v for v in str(value or "").split(",") if v)
            elif f.name == EMULATE_RANKS:
                value = tuple(int(v) for v in str(value or "0").split(",") if v)
            elif isinstance(value, float) and math.isnan(value):
                value = None
            elif isinstance(value, float) and value.is_integer() and "int" in str(f.type):
                value = int(value)  # an int column with missing values comes back from Parquet as floats
            data[f.name] = value
        return cls(**data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Case:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown Case fields: {sorted(unknown)}")
        data = dict(data)
        for name in ("wrap_classes", "emulate_ranks"):
            if name in data:
                data[name] = tuple(data[name])
        return cls(**data)

    def replace(self, **changes: Any) -> Case:
        return dataclasses.replace(self, **changes)


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
