"""What emulating one rank costs: llama-7b as rank 0 of 64 (ZeRO-3), one emulated step, on this machine.

    PYTHONPATH=$PWD python analysis/emulate_cost.py                         # CPU: batch 1, seq 64
    PYTHONPATH=$PWD python analysis/emulate_cost.py --device cuda --seq-len 2048 --precision bf16

Runs exactly one emulated step (``--tracked``: a second, memory-tracked one). Prints the case's wall
time (fresh process: build on meta, shard, materialise the shard, steps), the emulated step time
(compute only), the tracker's peak (live tensors), the process's RSS peak (whole case) and, on a GPU,
the allocator's peak. Not part of the unit suite: on a 2-core CPU it takes minutes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    from fsdpbench.core.case import Case
    from fsdpbench.core.schema import ALLOC_PEAK_ALLOCATED, SAMPLED_PEAK_CASE
    from fsdpbench.pipeline.launch import launch_case

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--tracked",
        action="store_true",
        help="also run the memory-tracked step (the tracker's peak by category): a second step",
    )
    args = parser.parse_args()
    # exactly one (timed) emulated step; with --tracked a second, memory-tracked one
    case = Case(
        model=args.model,
        strategy=args.strategy,
        world_size=args.world_size,
        precision=args.precision,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        device=args.device,
        backend="nccl" if args.device == "cuda" else "gloo",
        warmup_steps=0,
        steps=1,
        memory_steps=int(args.tracked),
        profile_steps=0,
        timeout_s=3600,
        emulate=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        outcome = launch_case(case, Path(tmp) / case.case_id)
        wall = time.perf_counter() - t0
    if outcome.status != "ok":
        raise SystemExit(f"{outcome.status}: {outcome.error}")
    rank = outcome.ranks[0]  # a RankResult: the worker's typed record of the emulated rank
    columns = rank.to_columns()
    setup = rank.setup
    step_ms = rank.step_time_ms()
    if setup is None or step_ms is None:
        raise SystemExit(f"rank 0 recorded no setup or step time (phase {rank.phase})")
    gb = 1e9
    print(
        f"{case.case_id}: rank 0 of {case.world_size}, emulated on {args.device}, "
        f"{setup.threads} thread(s), batch {case.batch_size} x seq {case.seq_len}, {case.precision}"
    )
    print(
        f"  case wall time (fresh process, setup + {1 + int(args.tracked)} step(s)): {wall:.1f} s; "
        f"setup {setup.setup_s:.1f} s"
    )
    print(f"  emulated step time (compute only, 1 step, no warm-up): {step_ms / 1e3:.3f} s")
    if args.tracked and rank.memory is not None:
        peak = rank.memory.peak["total"]
        print(f"  tracker peak (live tensors, memory step): {peak / gb:.3f} GB ({peak:,} B)")
    rss = columns.get(SAMPLED_PEAK_CASE.of("rss")) or 0
    print(f"  RSS peak (process, whole case): {rss / gb:.2f} GB")
    if columns.get(ALLOC_PEAK_ALLOCATED):
        print(f"  CUDA allocator peak allocated: {columns[ALLOC_PEAK_ALLOCATED] / gb:.2f} GB")


if __name__ == "__main__":
    main()
