"""The time gate's clocks: work CPU time leaves gloo's loop threads out; the machine's load in shares."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest

from fsdpbench.metrics.cpu_clock import GLOO_LOOP_THREAD, LoadReading, MachineLoad, WorkClock, thread_cpu_s

linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread CPU clocks and names: Linux"
)
PR_SET_NAME = 15  # prctl(2): the calling thread's name, as gloo's loop thread names itself


def burn(cpu_s: float) -> None:
    """Spin this thread until it has used ``cpu_s`` of CPU time."""
    start = time.thread_time()
    while time.thread_time() - start < cpu_s:
        pass


@linux
def test_work_clock_leaves_out_a_thread_named_as_gloo_names_its_loop():
    named, go, done, release = (threading.Event() for _ in range(4))
    native_ids: list[int] = []

    def loop() -> None:
        ctypes.CDLL(None).prctl(PR_SET_NAME, GLOO_LOOP_THREAD.encode())
        native_ids.append(threading.get_native_id())
        named.set()
        go.wait()
        burn(0.2)  # what a spinning loop thread adds to the process's CPU time
        done.set()
        release.wait()  # alive while it is read, as a group's loop thread is for the group's life

    thread = threading.Thread(target=loop)
    thread.start()
    named.wait()
    clock = WorkClock()
    # this one among them: a gloo group that an earlier test in this process made has its own loop thread
    (tid,) = native_ids
    assert tid in clock.loops
    process0, work0, spin0 = time.process_time(), clock(), clock.spin()
    go.set()
    done.wait()  # this thread sleeps meanwhile: its CPU time barely moves
    process1, work1, spin1 = time.process_time(), clock(), clock.spin()
    spin_thread = thread_cpu_s(tid)
    release.set()
    thread.join()
    assert process1 - process0 >= 0.2  # the process's CPU time has the spin in it
    assert spin1 - spin0 >= 0.2 and spin_thread >= 0.2
    assert work1 - work0 < 0.1  # the work clock has not


def test_machine_load_is_a_share_of_the_cores():
    load = MachineLoad()
    load.cores = 2
    start = LoadReading(wall_s=10.0, machine_busy_s=100.0, own_s=5.0)
    end = LoadReading(wall_s=12.0, machine_busy_s=103.0, own_s=5.5)  # 2 s of 2 cores: 4 core-s
    busy, own = load.shares(start, end)
    assert busy == pytest.approx(3.0 / 4) and own == pytest.approx(0.5 / 4)
    unknown = LoadReading(wall_s=12.0, machine_busy_s=None, own_s=5.5)  # not Linux: not read
    assert load.shares(start, unknown) == (None, pytest.approx(0.5 / 4))


@linux
def test_machine_load_reads_proc_stat():
    reading = MachineLoad().read()
    assert reading.machine_busy_s is not None and reading.machine_busy_s > 0
