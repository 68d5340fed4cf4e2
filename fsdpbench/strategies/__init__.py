"""Strategy registry. A new strategy is one file with a ``@register_strategy`` class, imported below;
a user's own plugs in from a scenario as ``module:Class``.
"""

from __future__ import annotations

import importlib

from fsdpbench.strategies.base import ApplyContext, Sharding, Strategy

_STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    if cls.name in _STRATEGIES:
        raise ValueError(f"strategy {cls.name!r} is already registered")
    _STRATEGIES[cls.name] = cls
    return cls


def strategy_names() -> list[str]:
    return list(_STRATEGIES)


def get_strategy(name: str) -> Strategy:
    """A registered strategy by name, or a plugin given as ``package.module:ClassName``."""
    if name in _STRATEGIES:
        return _STRATEGIES[name]()
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise KeyError(f"cannot load strategy plugin {name!r}: {exc}") from None
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise KeyError(f"strategy plugin {name!r} is not a fsdpbench.strategies.Strategy subclass")
        return cls()
    raise KeyError(f"unknown strategy {name!r}; known: {', '.join(_STRATEGIES)} (or module:Class)")


from fsdpbench.strategies import ddp, deepspeed_zero, fsdp1, fsdp2, zero1  # noqa: E402,F401  (registration)

__all__ = ["ApplyContext", "Sharding", "Strategy", "get_strategy", "register_strategy", "strategy_names"]
