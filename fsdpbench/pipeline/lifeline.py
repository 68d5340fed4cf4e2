"""Processes that die with their parent: rank processes and the fork server never outlive the
orchestrator, whatever happens to it (SIGKILL included, when no Python cleanup can run).

Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set in the fork server (parent: the orchestrator) and
in every rank (parent: the fork server). Elsewhere, and as a second line on Linux, a rank runs a
watchdog thread that exits when the orchestrator's pid is gone.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import sys
import threading
import time
from pathlib import Path

from fsdpbench.core.rundir import open_log

PR_SET_PDEATHSIG = 1
ORCHESTRATOR_PID_ENV = "FSDPBENCH_ORCHESTRATOR_PID"
# in a case directory: every rank launched into it holds a shared lock on this file while it lives
ALIVE_FILE = ".ranks.alive"
_held: list[int] = []  # the lock's descriptor, open for the life of the rank


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; True where it could."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return True  # a parent that died before this call is caught by watch_orchestrator


def send_output_to(path: str, root: str | Path | None = None) -> None:
    """Point this process's file descriptors 1 and 2 at ``path`` (appended to): where the C++ libraries
    (gloo, c10d, kineto) write, past Python's sys.stdout, so their lines are the run's record, not the
    user's terminal. A log beneath ``root`` (a run directory) is opened by ``rundir.open_log``: no link
    planted at it, or on the way to it, is appended through."""
    if root is None:  # /dev/null (the fork server's), or a path outside any run
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    else:
        fd = open_log(Path(path), Path(root))
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True  # no /proc (not Linux): kill(0) said it exists


def watch_orchestrator(interval_s: float = 1.0) -> None:
    """Exit this process (no cleanup: its results are on disk) once the orchestrator is gone."""
    pid = int(os.environ.get(ORCHESTRATOR_PID_ENV, "0") or 0)
    if pid <= 0:
        return  # launched by torchrun/srun: their agent owns our lifetime

    def watch() -> None:
        while pid_alive(pid):
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="fsdpbench-lifeline", daemon=True).start()


def hold_while_alive(case_dir: Path) -> None:
    """In a rank: hold a shared lock on the case directory's ALIVE_FILE until this process ends (the
    kernel drops it then, however the process ends)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(Path(case_dir) / ALIVE_FILE, flags, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    _held.append(fd)


def held_by_a_live_rank(case_dir: Path) -> bool:
    """Whether a live process holds the case directory's ALIVE_FILE lock: a rank of it still runs.
    The lock, not a pid read back from a rank file: a file from disk may name any process (a pid
    reused since, or one a stranger wrote), and such a process must not keep a case from running."""
    try:
        fd = os.open(Path(case_dir) / ALIVE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # no such file (no rank ever ran here), or a link: nothing holds it
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
