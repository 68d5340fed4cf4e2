"""A run directory's boundaries: one run at a time (a lock), and nothing written or deleted outside it."""

from __future__ import annotations

import os
import re
from pathlib import Path

LOCK_NAME = ".lock"
CHECKPOINT_DIR = "checkpoint"  # under the case directory (the checkpoint phase writes there)
NATIVE_TAG = "native"  # the tag the engine's own checkpoint (DeepSpeed's) is saved under: its subdirectory
_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


class RunDirError(OSError):
    """The run directory cannot be used (busy, or a path would leave it); the message is one line."""


def write_atomically(path: Path, data: bytes) -> None:
    """The one way fsdpbench writes a file in a run directory: a new temporary file beside ``path``
    (whatever had that name, a symbolic link included, is removed first, and the file is created with
    ``O_EXCL | O_NOFOLLOW``, so no link planted there is ever written through), then renamed over
    ``path`` (a rename replaces a link at ``path`` itself, never its target). On any failure the
    temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_inside(path: Path, root: Path) -> Path:
    """``path`` itself, after checking that it resolves inside ``root`` (symbolic links followed)."""
    resolved, base = Path(path).resolve(), Path(root).resolve()
    if resolved != base and base not in resolved.parents:
        raise RunDirError(f"{path} is outside {root}; refusing to write or delete there")
    return Path(path)


def check_component(name: str) -> str:
    """A name used as one file or directory name (a case id): the safe alphabet, no '..' or '/'."""
    if not _COMPONENT.fullmatch(name) or ".." in name or len(name) > 240:
        raise RunDirError(f"{name[:80]!r} is not a safe file name")
    return name


class RunLock:
    """An exclusive ``flock`` on RUN_DIR/.lock, held for the whole run. The kernel drops it when the
    process dies (SIGKILL included), so a stale lock never blocks a later ``--resume``."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        try:  # O_NOFOLLOW: a link named .lock would make the PID overwrite whatever it points at
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            kind = "a symbolic link" if self.path.is_symlink() else exc.strerror
            raise RunDirError(f"{self.path}: {kind}; refusing to use it as the run's lock") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunDirError(
                f"{self.path.parent} is in use by another fsdpbench run (pid {holder}); "
                "wait for it to finish or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (deleting it would race)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
