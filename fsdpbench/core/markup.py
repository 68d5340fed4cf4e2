"""Text from outside as rich prints it: the one escaping rule for everything fsdpbench prints through
rich. A case id, a hostname, an error (gloo's ``[/pytorch/…]``), a path or a planted ``[/bold]`` is
shown literally, never parsed as markup. Torch- and pandas-free: every command imports it."""

from __future__ import annotations


def escape(text: object) -> str:
    """``text`` with rich's markup escaped, so that rich prints it as it is."""
    from rich.markup import escape as rich_escape

    return rich_escape(str(text))
