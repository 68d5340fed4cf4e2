"""What the memory model needs to know about a model: every parameter's shape, which wrap unit owns
it, and whether autocast casts it. Read from the parameter shapes a family declares (decoder, MLP: a
70B decoder answers in microseconds, and torch is not imported), from a cached meta-device build for
anything else.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any

from fsdpbench.models import resolve_model


@dataclass(frozen=True, slots=True)
class ParamFact:
    name: str
    shape: tuple[int, ...]
    unit: int  # index into ModelFacts.units (forward order; the root unit is last)
    autocast: bool = False  # weight of an op that autocast runs in 16 bits (Linear, Conv)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """Parameters (in ``model.parameters()`` order) and wrap units (root last), or only a count."""

    model: str | None
    args: tuple[tuple[str, Any], ...]
    n_params: int
    params: tuple[ParamFact, ...] | None  # None: only the count is known (``--params N``)
    units: tuple[str, ...] = ("<root>",)

    @property
    def known(self) -> bool:
        return self.params is not None

    @property
    def root(self) -> int:
        return len(self.units) - 1

    @classmethod
    def from_count(cls, n_params: int) -> ModelFacts:
        return cls(model=None, args=(), n_params=int(n_params), params=None)


def get_model_facts(
    model: str,
    args: dict[str, Any] | None = None,
    *,
    wrap: str = "none",
    wrap_min_params: int = 100_000,
    wrap_classes: tuple[str, ...] = (),
) -> ModelFacts:
    """Facts for a registered model (family or preset) under a wrap policy; cached."""
    mdef, full = resolve_model(model, args)
    key = json.dumps(full, sort_keys=True, default=str)
    return _facts(mdef.name, key, wrap, wrap_min_params, tuple(wrap_classes), model)


@functools.lru_cache(maxsize=256)
def _facts(
    family: str, args_key: str, wrap: str, min_params: int, classes: tuple[str, ...], name: str
) -> ModelFacts:
    args = json.loads(args_key)
    mdef, _ = resolve_model(family)
    per_block = wrap == "block" or (wrap == "classes" and classes == mdef.block_class_names)
    if mdef.param_shapes is not None and (per_block or wrap in ("none", "whole")):
        shapes, n_blocks = mdef.param_shapes(args)
        if per_block:
            units = tuple(f"block{i}" for i in range(n_blocks)) + ("<root>",)
            params = tuple(
                ParamFact(p.name, p.shape, p.block if p.block >= 0 else n_blocks, p.autocast) for p in shapes
            )
        else:
            units = ("<root>",)
            params = tuple(ParamFact(p.name, p.shape, 0, p.autocast) for p in shapes)
    else:
        params, units = _from_meta_build(name, args, wrap, min_params, classes)
    items = tuple(sorted(args.items()))
    return ModelFacts(
        model=name, args=items, n_params=sum(p.numel for p in params), params=params, units=units
    )


def _from_meta_build(
    name: str, args: dict[str, Any], wrap: str, min_params: int, classes: tuple[str, ...]
) -> tuple[tuple[ParamFact, ...], tuple[str, ...]]:
    from torch import nn

    from fsdpbench.core.case import Case
    from fsdpbench.models import build_model
    from fsdpbench.models.wrap import get_wrap_units

    model = build_model(name, args, device="meta")
    case = Case(model=name, model_args=args, wrap=wrap, wrap_min_params=min_params, wrap_classes=classes)
    units = get_wrap_units(model, case)
    owner: dict[int, int] = {}
    for i, unit in enumerate([*units, model]):  # post-order: the innermost unit claims first
        for p in unit.parameters():
            owner.setdefault(id(p), i)
    autocast_ids = {
        id(p)
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))
        for p in m.parameters(recurse=False)
    }
    names = {id(m): n for n, m in model.named_modules()}
    params = tuple(
        ParamFact(n, tuple(p.shape), owner[id(p)], id(p) in autocast_ids)
        for n, p in model.named_parameters()
        if p.requires_grad
    )
    return params, tuple(names.get(id(u), f"unit{i}") for i, u in enumerate(units)) + ("<root>",)
