"""A background thread that polls one memory reading (NVML, RSS, ...) and keeps the samples.

One class serves every polled source: the source only supplies ``read_fn``.
``read_fn`` returns either a number of bytes or a dict holding a ``"bytes"`` key
(other keys are kept as extra columns of :meth:`BackgroundSampler.to_frame`).

Usage::

    with BackgroundSampler(read_rss_bytes, interval_s=0.01, name="rss") as s:
        s.set_phase("forward"); ...; s.set_phase("backward"); ...
    s.peak_bytes, s.peak_bytes_by_phase(), s.to_frame()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from fsdpbench.core.schema import PHASE

if TYPE_CHECKING:
    import pandas as pd

MAX_ERRORS_KEPT = 20


class Sample(NamedTuple):
    """One reading: seconds since start, bytes, phase tag at the time of the reading."""

    t_s: float
    bytes: int
    phase: str


class BackgroundSampler:
    """Daemon thread sampling ``read_fn`` every ``interval_s`` seconds, tagged by phase."""

    def __init__(
        self,
        read_fn: Callable[[], int | dict[str, Any]],
        interval_s: float = 0.01,
        name: str = "sampler",
        *,
        close_fn: Callable[[], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.read_fn = read_fn
        self.interval_s = float(interval_s)
        self.name = name
        self._close_fn = close_fn
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples: list[Sample] = []
        self._extras: list[dict[str, Any]] = []
        self._phase = ""
        self._t0 = 0.0
        self.errors: list[str] = []
        self.error_count = 0

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> BackgroundSampler:
        """Take a first sample now and start the sampling thread."""
        if self._thread is not None:
            raise RuntimeError(f"sampler {self.name!r} already started")
        self._t0 = time.perf_counter()
        self._stop_event.clear()
        self.sample_now()
        self._thread = threading.Thread(target=self._run, name=f"fsdpbench-{self.name}-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> BackgroundSampler:
        """Stop the thread, take a last sample, and release the source (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return self
        self._stop_event.set()
        thread.join()
        self.sample_now()
        if self._close_fn is not None:
            try:
                self._close_fn()
            except Exception as exc:  # closing must not mask the measurement
                self._record_error(exc)
        return self

    def __enter__(self) -> BackgroundSampler:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """True while the sampling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def set_phase(self, phase: str) -> None:
        """Tag every later sample with ``phase``."""
        with self._lock:
            self._phase = phase

    # -- sampling ----------------------------------------------------------
    def sample_now(self) -> None:
        """Read once in the calling thread; an error is recorded, never raised."""
        t_s = time.perf_counter() - self._t0
        try:
            value = self.read_fn()
            if isinstance(value, dict):
                extra = {k: v for k, v in value.items() if k != "bytes"}
                value_bytes = int(value["bytes"])
            else:
                extra = {}
                value_bytes = int(value)
        except Exception as exc:  # a failing source is data, not a crash
            self._record_error(exc)
            return
        with self._lock:
            self._samples.append(Sample(t_s, value_bytes, self._phase))
            self._extras.append(extra)

    def _run(self) -> None:
        try:
            while not self._stop_event.wait(self.interval_s):
                self.sample_now()
        except BaseException as exc:  # noqa: BLE001 - the thread never raises
            self._record_error(exc)

    def _record_error(self, exc: BaseException) -> None:
        with self._lock:
            self.error_count += 1
            if len(self.errors) < MAX_ERRORS_KEPT:
                self.errors.append(f"{type(exc).__name__}: {exc}")

    # -- results -----------------------------------------------------------
    @property
    def samples(self) -> list[Sample]:
        """A copy of the samples so far, (t_s, bytes, phase)."""
        with self._lock:
            return list(self._samples)

    @property
    def peak_bytes(self) -> int | None:
        """Largest sampled value, or None when nothing was sampled."""
        samples = self.samples
        return max(s.bytes for s in samples) if samples else None

    def peak_bytes_by_phase(self) -> dict[str, int]:
        """Largest sampled value per phase tag."""
        peaks: dict[str, int] = {}
        for s in self.samples:
            if s.bytes > peaks.get(s.phase, -1):
                peaks[s.phase] = s.bytes
        return peaks

    def to_frame(self) -> pd.DataFrame:
        """Samples as a DataFrame with columns t_s, bytes, phase, source (+ dict extras)."""
        import pandas as pd

        with self._lock:
            rows = [
                {"t_s": s.t_s, "bytes": s.bytes, PHASE: s.phase, "source": self.name, **extra}
                for s, extra in zip(self._samples, self._extras)
            ]
        columns = ["t_s", "bytes", PHASE, "source"]
        frame = pd.DataFrame(rows)
        if frame.empty:
            dtypes = ["float64", "int64", "object", "object"]
            return pd.DataFrame({c: pd.Series(dtype=t) for c, t in zip(columns, dtypes)})
        extra_cols = [c for c in frame.columns if c not in columns]
        return frame[columns + extra_cols]
