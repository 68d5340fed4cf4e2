"""Processes that die with their parent: rank processes and the fork server never outlive the
orchestrator, whatever happens to it (SIGKILL included, when no Python cleanup can run).

Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set in the fork server (parent: the orchestrator) and
in every rank (parent: the fork server). Elsewhere, and as a second line on Linux, a rank runs a
watchdog thread that exits when the orchestrator's pid is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
ORCHESTRATOR_PID_ENV = "FSDPBENCH_ORCHESTRATOR_PID"


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
