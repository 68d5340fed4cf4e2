"""Numbers: units, a shape's elements, and numbers read from results (present, finite or not, and how far a
prediction is from a measurement)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

MiB = 1 << 20


def numel(shape: Iterable[int]) -> int:
    """Elements of a tensor of ``shape`` (1 for a scalar's empty shape)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def is_number(value: Any) -> bool:
    """A value that reads as a number and is not NaN (None, text and NaN are not)."""
    try:
        return not math.isnan(float(value))
    except (TypeError, ValueError):
        return False


def number(value: Any) -> float | None:
    """``value`` as a float, or None when it is not a number."""
    return float(value) if is_number(value) else None


def relative_error(pred: Any, measured: Any) -> float | None:
    """(pred − measured) / measured; None when either is missing, not a number, or measured is 0."""
    if pred is None or not is_number(pred) or not is_number(measured) or not float(measured):
        return None
    return (pred - float(measured)) / float(measured)
