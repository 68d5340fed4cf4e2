"""Wrap policies: which submodules become their own FSDP unit (all-gathered together).

``get_wrap_units`` returns the modules to wrap, children before parents (post-order), root
excluded: the root is always the last unit, holding whatever no other unit claimed.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from fsdpbench.core.case import Case
from fsdpbench.models import resolve_model


def _own_params(module: nn.Module, claimed: set[int]) -> int:
    return sum(p.numel() for p in module.parameters() if id(p) not in claimed)


def _post_order(module: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        for sub_name, sub in _post_order(child):
            yield (f"{name}.{sub_name}" if sub_name else name), sub
        yield name, child


def get_wrap_units(model: nn.Module, case: Case) -> list[nn.Module]:
    """Modules that become FSDP units for this case's wrap policy (root excluded)."""
    if case.wrap in ("none", "whole"):
        return []
    if case.wrap == "block":
        mdef, args = resolve_model(case.model, case.model_args)
        classes = mdef.block_classes(args)
        return [m for _, m in _post_order(model) if isinstance(m, classes)]
    if case.wrap == "classes":
        wanted = set(case.wrap_classes)
        return [m for _, m in _post_order(model) if type(m).__name__ in wanted]
    if case.wrap == "size":
        return _size_based(model, case.wrap_min_params)
    raise ValueError(f"unknown wrap policy {case.wrap!r}")


# FSDP1's size_based_auto_wrap_policy never wraps these: their forward is never called, so an
# FSDP unit on them would never all-gather (its children are still considered).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _size_based(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Like FSDP1's size_based_auto_wrap_policy: wrap a module once its unclaimed params ≥ min_params."""
    units: list[nn.Module] = []
    claimed: set[int] = set()
    for _, module in _post_order(model):
        if isinstance(module, _CONTAINERS):
            continue
        if _own_params(module, claimed) >= min_params:
            units.append(module)
            claimed.update(id(p) for p in module.parameters())
    return units
