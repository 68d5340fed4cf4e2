"""Signals that stop a run: SIGINT (a terminal's Ctrl-C), SIGTERM (a scheduler, ``kill``), SIGHUP (a
closed terminal). The orchestrator turns the first into ``Interrupted`` and stops its case's ranks
itself; the processes it starts ignore SIGINT (``ignore_sigint``), so that a Ctrl-C, which a
terminal sends to the whole foreground process group, is answered once, by the orchestrator, and an
interrupted case is never stored as a rank's failure."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP: stop the case's ranks, keep what is stored, exit 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def ignore_sigint() -> None:
    """In a process the orchestrator starts (the fork server, and so every rank; the gloo probe; the
    traced predictor): Ctrl-C is the orchestrator's to answer, which then stops this process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """The first SIGINT, SIGTERM or SIGHUP raises Interrupted (a KeyboardInterrupt) in the main thread;
    any later one is ignored, so that a Ctrl-C pressed again while the ranks are stopped and run.json is
    written cannot break that off, and, once interrupted, the process stays deaf to them until it has
    exited (a KeyboardInterrupt in multiprocessing's exit hooks would print a traceback after the
    resume line).

    SIGINT too, explicitly: a process started with SIGINT ignored (a background job of a script, or of
    a parent that ignored it) inherits that, and Python then installs no KeyboardInterrupt handler, so
    Ctrl-C sent to its process group would leave the orchestrator waiting."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        received.append(signum)
        if len(received) == 1:
            raise Interrupted(signum)

    old = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, signal.SIG_IGN if received else previous)


def launcher_signal(exc: BaseException) -> Interrupted:
    """torch's launcher turns the signals it handles while it starts or stops ranks into its own
    SignalException (an Exception, which a case's error handling would take for the case's failure);
    give it back as the interrupt it is."""
    return Interrupted(int(getattr(exc, "sigval", signal.SIGINT)))
