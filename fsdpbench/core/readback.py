"""Files read back (baselines, run.json, rank files, scenarios, Parquet) are input from a stranger.

One reader and one number check for all of them:

- ``read_bounded``: at most ``limit`` bytes, counted by reading, never by ``stat`` (``/dev/zero``, a
  FIFO or ``/proc`` file reports size 0 and reads without end); a symbolic link refused where asked.
- ``read_json``: ``read_bounded`` + JSON, nesting and syntax errors as one line naming the file.
- ``finite_number``: a number from outside (CLI, YAML, JSON, Parquet) is an int or float, not a bool,
  finite once converted to float (``10**400`` is not), and within the bounds its field states.

Errors are ``ReadBackError`` (a ValueError): one line that names the file and the field.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


class ReadBackError(ValueError):
    """A file read back, or a value in one, is unusable; the message names the file and the field."""


def read_bounded(path: str | Path, limit: int, *, what: str, follow_links: bool = True) -> bytes:
    """The file's bytes, at most ``limit`` of them (one more is read to tell a file that is too long)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow_links and Path(path).is_symlink():
            raise ReadBackError(f"{path}: a symbolic link, not a {what}") from None
        raise ReadBackError(f"{path}: cannot read {what}: {exc.strerror}") from None
    chunks: list[bytes] = []
    size = 0
    try:
        with os.fdopen(fd, "rb") as file:
            while size <= limit:
                chunk = file.read(min(1 << 20, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except OSError as exc:  # a directory, a device that refuses reads
        raise ReadBackError(f"{path}: cannot read {what}: {exc.strerror}") from None
    if size > limit:
        raise ReadBackError(f"{path}: longer than {_size(limit)}; not a {what}")
    return b"".join(chunks)


def read_json(path: str | Path, limit: int, *, what: str, follow_links: bool = True) -> Any:
    """A JSON document of at most ``limit`` bytes; ReadBackError for anything that is not one."""
    data = read_bounded(path, limit, what=what, follow_links=follow_links)
    try:
        return json.loads(data)
    except RecursionError:
        raise ReadBackError(f"{path}: nested too deep to be a {what}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of more than 4300 digits
        raise ReadBackError(f"{path}: not JSON ({exc})") from None


def finite_number(value: Any, where: str, *, low: float | None = None, high: float | None = None) -> float:
    """``value`` as a finite float within [low, high]; ReadBackError naming ``where`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or hasattr(value, "shape"):
        raise ReadBackError(f"{where}: {_short(value)} is not a finite number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ReadBackError(f"{where}: {_short(value)} is not a finite number")
    if (low is not None and number < low) or (high is not None and number > high):
        bounds = (
            f"from {low:g} to {high:g}"
            if low is not None and high is not None
            else (f"≥ {low:g}" if low is not None else f"≤ {high:g}")
        )
        raise ReadBackError(f"{where}: {_short(value)} is out of range (must be {bounds})")
    return number


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + f"… ({len(text)} characters)"


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n:,} bytes"
