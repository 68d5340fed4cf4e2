"""The model registry: a model is a builder, a synthetic-batch maker, a loss and its block classes.

Presets are named argument sets of a registered model (``decoder-tiny``, ``llama-7b``, …).
A family is declared in ``fsdpbench/models/families/<family>.py`` as plain data — its arguments,
presets, block class names and, where it can say so without building the model, every parameter's
shape — and names its torch side (``fsdpbench/models/<family>.py``: the modules, the batch, the loss)
by ``"module:attr"`` references that are imported when first called. So the registry, a scenario's
validation and the analytic memory model never import torch. A new model is one family file with one
``register_model`` call, its torch module, and one line in ``fsdpbench/models/families/__init__.py``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True, slots=True)
class TorchSide:
    """A callable of a family's torch side, named ``"module:attr"``: imported on its first call, so that
    declaring (and validating, and predicting) a model costs no ``import torch``."""

    path: str

    def resolve(self) -> Callable[..., Any]:
        return _resolve(self.path)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)


@functools.cache
def _resolve(path: str) -> Callable[..., Any]:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class ParamShape(NamedTuple):
    """One parameter as the analytic memory model sees it, declared without building the model."""

    name: str
    shape: tuple[int, ...]
    block: int  # index of the block (wrap unit) that owns it, in forward order; -1: the root
    autocast: bool = False  # weight of an op that autocast runs in 16 bits (Linear, Conv)


@dataclass(frozen=True, kw_only=True)
class ModelDef:
    """How to build, feed and score one family of models, and what the memory model needs of it."""

    name: str
    build: Callable[..., nn.Module]
    defaults: dict[str, Any]
    make_batch: Callable[[dict[str, Any], int, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    block_classes: Callable[[dict[str, Any]], tuple[type[nn.Module], ...]]
    # the class names of ``block_classes`` (the per-block wrap units), known without importing them
    block_class_names: tuple[str, ...]
    is_sequence: bool = False
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # constraints between arguments (e.g. heads divide the width): why a full argument set is invalid
    check_args: Callable[[dict[str, Any]], str | None] | None = None
    # every trainable parameter in ``model.parameters()`` order, and the number of blocks, from the
    # arguments alone (a 70B decoder in microseconds); None: the memory model builds it on the meta device
    param_shapes: Callable[[dict[str, Any]], tuple[tuple[ParamShape, ...], int]] | None = None


@dataclass(frozen=True)
class Preset:
    model: str
    args: dict[str, Any]
    description: str = ""


_MODELS: dict[str, ModelDef] = {}
_PRESETS: dict[str, Preset] = {}


def register_model(model: ModelDef) -> ModelDef:
    if model.name in _MODELS or model.name in _PRESETS:
        raise ValueError(f"model {model.name!r} is already registered")
    _MODELS[model.name] = model
    return model


def register_preset(name: str, model: str, description: str = "", **args: Any) -> None:
    if name in _MODELS or name in _PRESETS:
        raise ValueError(f"model preset {name!r} is already registered")
    _PRESETS[name] = Preset(model, args, description)


def model_names() -> list[str]:
    """Every name a scenario may use: families and presets."""
    return sorted(_MODELS) + sorted(_PRESETS)


def resolve_model(name: str, overrides: dict[str, Any] | None = None) -> tuple[ModelDef, dict[str, Any]]:
    """Look up a family or preset; return its definition and the full argument set."""
    if name in _PRESETS:
        preset = _PRESETS[name]
        mdef = _MODELS[preset.model]
        args = {**mdef.defaults, **preset.args}
    elif name in _MODELS:
        mdef = _MODELS[name]
        args = dict(mdef.defaults)
    else:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(model_names())}")
    unknown = set(overrides or {}) - set(mdef.defaults)
    if unknown:
        raise KeyError(
            f"model {name!r} has no argument(s) {sorted(unknown)}; allowed: {sorted(mdef.defaults)}"
        )
    args.update(overrides or {})
    return mdef, args


def check_model_args(name: str, overrides: dict[str, Any]) -> str | None:
    """Why these arguments cannot build the model (or None), decided without building it.

    Each argument must have its default's type (a bool is not an int); an integer argument whose
    default is a positive size (or None, 'derived') must be >= 1; then the model's own constraints."""
    try:
        mdef, args = resolve_model(name, overrides)
    except KeyError as exc:
        return str(exc.args[0])
    for key, value in overrides.items():
        problem = _check_arg(value, mdef.defaults[key])
        if problem:
            return f"{key}: {problem} (got {value!r:.60})"
    return mdef.check_args(args) if mdef.check_args else None


def _check_arg(value: Any, default: Any) -> str | None:
    """Why ``value`` cannot stand for a model argument whose default is ``default`` (None: it can)."""
    if value is None:
        return None if default is None else f"needs a value like its default {default!r}"
    if isinstance(default, bool) or isinstance(value, bool):
        if isinstance(value, bool) and isinstance(default, bool):
            return None
        return f"should be {'true or false' if isinstance(default, bool) else type(default).__name__}"
    if default is None or isinstance(default, int):
        return _check_int_arg(value, default)
    if isinstance(default, float):
        return _check_float_arg(value, default)
    if isinstance(default, str) and not isinstance(value, str):
        return "should be a string"
    return None


def _check_int_arg(value: Any, default: int | None) -> str | None:
    if not isinstance(value, int):
        return "should be an integer"
    return None if value >= 1 or (isinstance(default, int) and default < 1) else "should be at least 1"


def _check_float_arg(value: Any, default: float) -> str | None:
    if not isinstance(value, (int, float)) or value != value:
        return "should be a number"
    return None if value > 0 or default <= 0 else "should be greater than 0"


def build_model(
    name: str, overrides: dict[str, Any] | None = None, *, device: str | torch.device = "cpu"
) -> nn.Module:
    """Build a model (use device='meta' to get its structure without allocating)."""
    import torch

    mdef, args = resolve_model(name, overrides)
    with torch.device(device):
        return mdef.build(**args)


def count_params(name: str, overrides: dict[str, Any] | None = None) -> int:
    """Trainable parameter count (Ψ), from a meta-device build: no memory, any size."""
    model = build_model(name, overrides, device="meta")
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def make_global_batch(
    name: str, overrides: dict[str, Any] | None, global_batch: int, seq_len: int, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic global batch of one step: identical on every rank and in a 1-rank reference."""
    import torch

    mdef, args = resolve_model(name, overrides)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return mdef.make_batch(args, global_batch, seq_len, gen)
