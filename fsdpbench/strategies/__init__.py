"""Strategy registry. A new strategy is one file with a ``Strategy`` subclass that declares what it is,
plus one line in ``BUILTIN``; a user's own plugs in from a scenario as ``module:Class``, or in-process
with ``register_strategy``.

No strategy module imports torch until a strategy is applied (``apply``, ``build_optimizer``): looking
one up and reading its declaration (the analytic memory model) is torch-free, and so is the case and
the regression gate, which read ``REFERENCE_STRATEGY`` from here (``names.py``: the case reads it
there, so that the case and the strategies' base, which reads the case, form no import circle).
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdpbench.strategies.base import Strategy

from fsdpbench.core.names import FULL_SHARD_STRATEGY, REFERENCE_STRATEGY

# every built-in strategy, one line each, in the order reports list them
BUILTIN = (
    "fsdpbench.strategies.ddp:DDP",
    "fsdpbench.strategies.zero1:Zero1",
    "fsdpbench.strategies.fsdp2:Zero2",
    "fsdpbench.strategies.fsdp2:Zero3",
    "fsdpbench.strategies.fsdp2:HSDP",
    "fsdpbench.strategies.fsdp1:FSDP1Full",
    "fsdpbench.strategies.fsdp1:FSDP1GradOp",
    "fsdpbench.strategies.fsdp1:FSDP1NoShard",
    "fsdpbench.strategies.fsdp1:FSDP1Hybrid",
    "fsdpbench.strategies.deepspeed_zero:DSZero1",
    "fsdpbench.strategies.deepspeed_zero:DSZero2",
    "fsdpbench.strategies.deepspeed_zero:DSZero3",
)

_PLUGINS: dict[str, type[Strategy]] = {}


def _load_class(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


@functools.cache
def _builtin() -> dict[str, type[Strategy]]:
    classes = [_load_class(path) for path in BUILTIN]
    return {cls.name: cls for cls in classes}


def registered() -> dict[str, type[Strategy]]:
    """Every registered strategy class by name: the built-ins in report order, then those registered here."""
    return {**_builtin(), **_PLUGINS}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Make ``cls`` known by its ``name`` in this process (reports and scenarios find it)."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    if cls.name in registered():
        raise ValueError(f"strategy {cls.name!r} is already registered")
    _PLUGINS[cls.name] = cls
    return cls


def find_strategy(name: str) -> type[Strategy] | None:
    """The class of a registered strategy, or of a ``module:Class`` plugin this process has already
    imported; else None. Imports no plugin: a report may read the results of code it must not run."""
    from fsdpbench.strategies.base import Strategy

    if name in registered():
        return registered()[name]
    module_name, _, attr = name.partition(":")
    cls = getattr(sys.modules.get(module_name), attr, None) if attr else None
    return cls if isinstance(cls, type) and issubclass(cls, Strategy) else None


def strategy_names() -> list[str]:
    return list(registered())


def get_strategy(name: str) -> Strategy:
    """A registered strategy by name, or a plugin given as ``package.module:ClassName``."""
    from fsdpbench.strategies.base import Strategy

    strategies = registered()
    if name in strategies:
        return strategies[name]()
    if ":" in name:
        try:
            cls = _load_class(name)
        except (ImportError, AttributeError) as exc:
            raise KeyError(f"cannot load strategy plugin {name!r}: {exc}") from None
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise KeyError(f"strategy plugin {name!r} is not a fsdpbench.strategies.Strategy subclass")
        return cls()
    raise KeyError(f"unknown strategy {name!r}; known: {', '.join(strategies)} (or module:Class)")


def __getattr__(name: str) -> Any:
    # the base classes, imported (with torch) when first asked for
    if name in ("ApplyContext", "Sharding", "Strategy"):
        from fsdpbench.strategies import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUILTIN",
    "FULL_SHARD_STRATEGY",
    "REFERENCE_STRATEGY",
    "ApplyContext",
    "Sharding",
    "Strategy",
    "find_strategy",
    "get_strategy",
    "register_strategy",
    "registered",
    "strategy_names",
]
