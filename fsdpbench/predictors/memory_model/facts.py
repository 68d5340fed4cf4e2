"""What the memory model needs to know about a model: every parameter's shape, which wrap unit owns
it, and whether autocast casts it. Derived analytically for the decoder and MLP families (a 70B
decoder answers in microseconds), from a cached meta-device build for anything else.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from torch import nn

from fsdpbench.models import resolve_model


@dataclass(frozen=True, slots=True)
class ParamFact:
    name: str
    shape: tuple[int, ...]
    unit: int  # index into ModelFacts.units (forward order; the root unit is last)
    autocast: bool = False  # weight of an op that autocast runs in 16 bits (Linear, Conv)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


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
    per_block = wrap == "block" or (wrap == "classes" and classes == _BLOCK_CLASS.get(family))
    if family in _ANALYTIC and (per_block or wrap in ("none", "whole")):
        params, n_blocks = _ANALYTIC[family](args)
        if per_block:
            units = tuple(f"block{i}" for i in range(n_blocks)) + ("<root>",)
            params = tuple(
                ParamFact(p.name, p.shape, p.unit if p.unit >= 0 else n_blocks, p.autocast) for p in params
            )
        else:
            units = ("<root>",)
            params = tuple(ParamFact(p.name, p.shape, 0, p.autocast) for p in params)
    else:
        params, units = _from_meta_build(name, args, wrap, min_params, classes)
    items = tuple(sorted(args.items()))
    return ModelFacts(
        model=name, args=items, n_params=sum(p.numel for p in params), params=params, units=units
    )


# ---- analytic parameter lists (unit = block index, -1 = root) ------------------------------------
def _decoder_params(a: dict[str, Any]) -> tuple[tuple[ParamFact, ...], int]:
    from fsdpbench.models.decoder import default_ffn_dim

    d, layers, heads, vocab = a["d_model"], a["n_layers"], a["n_heads"], a["vocab"]
    kv = a.get("n_kv_heads") or heads
    hd = d // heads
    ffn = a.get("ffn_dim") or default_ffn_dim(d)
    out = [ParamFact("tok_embeddings.weight", (vocab, d), -1)]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            ParamFact(p + "attention_norm.weight", (d,), i),
            ParamFact(p + "attention.wq.weight", (heads * hd, d), i, True),
            ParamFact(p + "attention.wk.weight", (kv * hd, d), i, True),
            ParamFact(p + "attention.wv.weight", (kv * hd, d), i, True),
            ParamFact(p + "attention.wo.weight", (d, heads * hd), i, True),
            ParamFact(p + "ffn_norm.weight", (d,), i),
            ParamFact(p + "feed_forward.w1.weight", (ffn, d), i, True),
            ParamFact(p + "feed_forward.w3.weight", (ffn, d), i, True),
            ParamFact(p + "feed_forward.w2.weight", (d, ffn), i, True),
        ]
    out += [ParamFact("norm.weight", (d,), -1), ParamFact("output.weight", (vocab, d), -1, True)]
    return tuple(out), layers


def _mlp_params(a: dict[str, Any]) -> tuple[tuple[ParamFact, ...], int]:
    w, depth, classes = a["width"], a["depth"], a["n_classes"]
    out = []
    for i in range(depth):
        out += [
            ParamFact(f"blocks.{i}.fc.weight", (w, w), i, True),
            ParamFact(f"blocks.{i}.fc.bias", (w,), i, True),
        ]
    out += [ParamFact("head.weight", (classes, w), -1, True), ParamFact("head.bias", (classes,), -1, True)]
    return tuple(out), depth


_ANALYTIC = {"decoder": _decoder_params, "mlp": _mlp_params}
_BLOCK_CLASS = {"decoder": ("TransformerBlock",), "mlp": ("MLPBlock",)}


def _from_meta_build(
    name: str, args: dict[str, Any], wrap: str, min_params: int, classes: tuple[str, ...]
) -> tuple[tuple[ParamFact, ...], tuple[str, ...]]:
    from fsdpbench.case import Case
    from fsdpbench.engine.wrap import get_wrap_units
    from fsdpbench.models import build_model

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
