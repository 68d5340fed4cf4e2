"""Counts typed on a command line (``--repeat``, ``--world-size``, …): each within the bounds its
option states, checked before anything runs, as one line naming the option."""

from __future__ import annotations


def check_count(flag: str, value: int | None, low: int, high: int) -> None:
    """ValueError ``FLAG VALUE: must be from LOW to HIGH`` unless ``value`` is None or within them."""
    if value is not None and not low <= value <= high:
        raise ValueError(f"{flag} {value}: must be from {low:,} to {high:,}")
