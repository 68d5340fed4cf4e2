"""The model registry: a model is a builder, a synthetic-batch maker, a loss and its block classes.

Presets are named argument sets of a registered model (``decoder-tiny``, ``llama-7b``, …).
A family is declared in ``fsdpbench/models/families/<family>.py`` as plain data — its arguments,
presets, block class names and, where it can say so without building the model, every parameter's
shape — and names its torch side (``fsdpbench/models/<family>.py``: the modules, the batch, the loss)
by ``"module:attr"`` references that are imported when first called. So the registry, a scenario's
validation and the analytic memory model never import torch. A new model is one family file with one
``register_model`` call, its torch module, and one line in ``fsdpbench/models/families/__init__.py``.

A user's own model is named ``package.module:factory`` (a scenario's ``model``, allowed as plugin
strategies are): the factory takes keyword arguments with defaults (its ``model_args``) and returns an
``OwnModel`` — the module, its block classes, its loss and its batch maker. It runs, is emulated and is
traced as a registered model; the analytic memory model has no activation model for it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
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
    # a loss that depends on the arguments (a user's factory returns one per argument set); None: ``loss``
    loss_for_args: Callable[[dict[str, Any]], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] | None = (
        None
    )

    def get_loss(self, args: dict[str, Any]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The loss of the model built from ``args``."""
        return self.loss_for_args(args) if self.loss_for_args else self.loss


@dataclass(frozen=True, kw_only=True, slots=True)
class OwnModel:
    """What a user's model factory (``model: package.module:factory``) returns."""

    module: nn.Module
    # the per-block wrap units (FSDP units with ``wrap: block``, activation checkpointing, compile)
    block_classes: tuple[type[nn.Module], ...]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (model output, targets) → scalar
    # (samples, seq_len, generator) → (inputs, targets) with ``samples`` rows; fsdpbench calls it once per
    # sample (samples=1) with that sample's own generator, so every rank makes exactly its own samples
    make_batch: Callable[[int, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    is_sequence: bool = False  # throughput in tokens/s too


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
    """Look up a family, preset or own model (``module:factory``); its definition and full argument set."""
    if ":" in name and name not in _MODELS:
        mdef = _own_model(name)
        args = dict(mdef.defaults)
    elif name in _PRESETS:
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
    if is_own_model(name):  # its constraints are its factory's: called on the meta device
        try:
            _own_parts_for(name, args)
        except Exception as exc:  # noqa: BLE001 — the user's code: its error is the answer
            return f"model factory {name!r} failed with these arguments: {type(exc).__name__}: {exc}"
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


def is_own_model(name: str) -> bool:
    """A user's factory (``module:attr``) rather than a registered family or preset."""
    return ":" in name and name not in _MODELS and name not in _PRESETS


@functools.cache
def _own_model(path: str) -> ModelDef:
    """A user's factory as a model definition: its keyword arguments (each with a default) are its
    ``model_args``; the rest comes from the ``OwnModel`` it returns for an argument set, called on the
    meta device (nothing allocated) when the definition needs it without building the model."""
    try:
        factory = _resolve(path)
    except (ImportError, AttributeError) as exc:
        raise KeyError(f"cannot load model factory {path!r}: {exc}") from None
    if not callable(factory):
        raise KeyError(f"model factory {path!r} is not callable")
    defaults: dict[str, Any] = {}
    for param in inspect.signature(factory).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.default is param.empty:
            raise KeyError(
                f"model factory {path!r}: argument {param.name!r} needs a default (its model_args)"
            )
        if not (param.default is None or isinstance(param.default, (bool, int, float, str))):
            raise KeyError(
                f"model factory {path!r}: argument {param.name!r} has a default of type "
                f"{type(param.default).__name__}; model_args are numbers, strings, booleans or None"
            )
        defaults[param.name] = param.default
    try:
        parts = _own_parts(path, json.dumps(defaults, sort_keys=True))
    except Exception as exc:  # noqa: BLE001 — the user's code: its error is the answer, on one line
        raise KeyError(
            f"model factory {path!r} failed with its defaults: {type(exc).__name__}: {exc}"
        ) from None
    return ModelDef(
        name=path,
        build=lambda **args: _check_own(path, factory(**args)).module,
        defaults=defaults,
        make_batch=lambda args, batch, seq_len, gen: _own_parts_for(path, args).make_batch(
            batch, seq_len, gen
        ),
        loss=parts.loss,
        loss_for_args=lambda args: _own_parts_for(path, args).loss,
        block_classes=lambda args: tuple(_own_parts_for(path, args).block_classes),
        block_class_names=tuple(cls.__name__ for cls in parts.block_classes),
        is_sequence=parts.is_sequence,
        description=(inspect.getdoc(factory) or "").partition("\n")[0] or f"own model {path}",
    )


def _own_parts_for(path: str, args: dict[str, Any]) -> OwnModel:
    return _own_parts(path, json.dumps(args, sort_keys=True))


@functools.lru_cache(maxsize=32)
def _own_parts(path: str, args_key: str) -> OwnModel:
    import torch

    with torch.device("meta"):
        return _check_own(path, _resolve(path)(**json.loads(args_key)))


def _check_own(path: str, parts: Any) -> OwnModel:
    if not isinstance(parts, OwnModel):
        raise TypeError(
            f"model factory {path!r} returned {type(parts).__name__}, not fsdpbench.models.OwnModel"
        )
    return parts


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


SEED_STRIDE = 1_000_003  # odd, prime: (seed, step, sample) never collide for the sizes a case takes


def sample_seed(seed: int, step: int, index: int) -> int:
    """The generator seed of one sample of one step: a pure function of (seed, step, sample index), so
    any rank makes exactly its own samples, and the same global batch whatever the world size."""
    return ((seed * SEED_STRIDE + step) * SEED_STRIDE + index) % 2**64


def make_samples(
    name: str,
    overrides: dict[str, Any] | None,
    first: int,
    count: int,
    seq_len: int,
    seed: int,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``first … first+count-1`` of a step's synthetic global batch, as a data loader hands a rank
    its own: each sample made from its own generator (``sample_seed``), then stacked. Nothing of the rest
    of the global batch is made."""
    import torch

    mdef, args = resolve_model(name, overrides)
    xs, ys = [], []
    for index in range(first, first + count):
        gen = torch.Generator().manual_seed(sample_seed(seed, step, index))
        x, y = mdef.make_batch(args, 1, seq_len, gen)
        xs.append(x)
        ys.append(y)
    # collated as a data loader collates: new tensors, even for one sample (whose inputs and targets may
    # be views of one storage, as the decoder's shifted tokens are)
    return torch.cat(xs), torch.cat(ys)


def make_global_batch(
    name: str, overrides: dict[str, Any] | None, global_batch: int, seq_len: int, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic global batch of one step (a 1-rank reference, the FLOP count): every rank's samples
    in rank order, identical to what the ranks make between them."""
    return make_samples(name, overrides, 0, global_batch, seq_len, seed, step)
