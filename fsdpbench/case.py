"""One fully specified configuration — the unit that fsdpbench runs, measures and predicts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from fsdpbench.precision import Precision, get_precision, runnable_precisions
from fsdpbench.strategies import REFERENCE_STRATEGY

PRECISIONS = runnable_precisions()
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum", "adadelta")
WRAPS = ("none", "whole", "block", "size", "classes")
BACKWARD_PREFETCH = ("pre", "post", "none")
# fields that do not change what is measured, so not part of a case id (resume finds the case again).
# The reference-interleaved blocks run after every other phase and record no loss, so switching them on
# changes no other column: a baseline's case ids stay valid (fsdpbench.metrics.reference).
_NOT_IN_ID = ("scenario", "timeout_s", "time_blocks", "time_block_steps")
# a case id names a directory and files: only these characters, and never '/', '..' alone or a leading '.'
_SAFE_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")
MAX_ID_CHARS = 200


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
        if self.alloc_conf:
            parts.append("alloc-" + safe_part(self.alloc_conf.replace(":", "-").replace(",", "_")))
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
