"""gloo's loop thread and a collective's slow mode on CPU ranks: the evidence behind ``idle_gloo_loops``.

    PYTHONPATH=$PWD python analysis/gloo_loop_spin.py                  # 3 process pairs per policy
    PYTHONPATH=$PWD python analysis/gloo_loop_spin.py --pairs 5 --policies as-is,idle

Two gloo processes, each bound as a fsdpbench CPU rank is (torch threads = cores ÷ 2, compute threads
pinned), per repetition: 2 ms of compute, then a burst of 8 queued 44 KB broadcasts issued at once and
waited for; then 8 × (2 ms of compute + a blocking 689 KB all-reduce) against the 8 computes alone.
Printed per process pair and loop-thread policy: the burst's time per collective and the all-reduce's
extra time (slowest rank; median, p10–p90, mean), and for the slowest and fastest burst of the as-is
pairs, each thread's CPU time and run-queue wait over the burst, from ``/proc/self/task/*/schedstat``.
In the slow bursts the loop thread (``gloo_tcp_loop``) runs for milliseconds while a worker thread
(``pt_gloo_runloop``) waits as long for a core: the loop spins on a pair's lock (docs/step-time-model.md,
"gloo's loop thread under SCHED_IDLE"). A running thread's schedstat can lag by up to a scheduler tick.
Not part of the unit suite: about 10 s per pair on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

BURST = 8
POLICIES = ("as-is", "idle", "nice19")


def _threads() -> dict[str, tuple[str, int, int]]:
    """tid → (name, ns on a CPU, ns runnable but waiting), this process's threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, _ = f.read().split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[tid] = (f.read().strip(), int(run), int(wait))
        except OSError:
            continue
    return out


def _set_loop_policy(policy: str) -> None:
    from fsdpbench.hosttuning.threads import GLOO_LOOP_THREAD, idle_gloo_loops

    if policy == "idle":
        idle_gloo_loops()
    elif policy == "nice19":
        for tid, (name, _, _) in _threads().items():
            if name == GLOO_LOOP_THREAD:
                os.setpriority(os.PRIO_PROCESS, int(tid), 19)


def _rank(rank: int, port: int, policy: str, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from fsdpbench.engine.intra_op import rank_threads
    from fsdpbench.hosttuning.threads import pin_compute_threads, rank_cores

    torch.set_num_threads(rank_threads(2))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    pin_compute_threads(rank_cores(rank, 2))
    _set_loop_policy(policy)
    a = torch.randn(128, 128)
    small = [torch.ones(11000) for _ in range(BURST)]  # 44 KB
    large = torch.ones(689 * 256)  # 689 KB

    def compute(ms: float) -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < ms / 1e3:
            a @ a

    bursts, extra, threads = [], [], []
    for _ in range(reps):
        dist.barrier()
        compute(2)
        before, t0 = _threads(), time.perf_counter()
        for h in [dist.broadcast(t, src=0, async_op=True) for t in small]:
            h.wait()
        bursts.append((time.perf_counter() - t0) / BURST * 1e6)
        after = _threads()
        threads.append(
            {
                f"{after[t][0]}:{t}": ((after[t][1] - before[t][1]) / 1e3, (after[t][2] - before[t][2]) / 1e3)
                for t in after
                if t in before
            }
        )
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(BURST):
            compute(2)
        alone = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(BURST):
            compute(2)
            dist.all_reduce(large)
        extra.append((time.perf_counter() - t0 - alone) / BURST * 1e6)
    gathered: list = [None, None]
    dist.all_gather_object(gathered, {"bursts": bursts, "extra": extra, "threads": threads})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _summary(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=10)
    middle, mean = statistics.median(xs), statistics.mean(xs)
    return f"median {middle:5.0f} (p10 {q[0]:5.0f}, p90 {q[-1]:5.0f}), mean {mean:5.0f} µs"


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--reps", type=int, default=16, help="repetitions per process pair (at least 2)")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"of {', '.join(POLICIES)}")
    args = parser.parse_args()
    policies = args.policies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            for policy in policies:  # alternated, so that the machine's moods fall on every policy
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                out = str(Path(tmp) / f"{policy}{pair}.json")
                mp.start_processes(
                    _rank, args=(port, policy, max(2, args.reps), out), nprocs=2, start_method="spawn"
                )
                ranks = json.loads(Path(out).read_text())
                bursts = [max(r) for r in zip(*(g["bursts"] for g in ranks))]
                extra = [max(r) for r in zip(*(g["extra"] for g in ranks))]
                print(
                    f"pair {pair} loop {policy:6s}  queued 44 KB broadcast: {_summary(bursts)}  |  "
                    f"689 KB all-reduce after 2 ms: {_summary(extra)}",
                    flush=True,
                )
                if policy != "as-is":
                    continue
                for label, i in (
                    ("fastest", bursts.index(min(bursts))),
                    ("slowest", bursts.index(max(bursts))),
                ):
                    print(
                        f"    {label} burst, {bursts[i]:.0f} µs per collective: per thread, CPU / run-queue"
                    )
                    for r, g in enumerate(ranks):
                        cells = [
                            f"{k.split(':')[0]} {run:.0f}/{wait:.0f} µs"
                            for k, (run, wait) in g["threads"][i].items()
                            if not k.startswith("python")
                        ]  # the main thread's figure lags a tick
                        print(f"      rank {r}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
