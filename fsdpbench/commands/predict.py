"""``fsdpbench predict``: per-rank memory for any model size and world size, before owning the hardware.

    fsdpbench predict --params 7.5e9 --world-size 64 --strategy zero1,zero2,zero3 \\
        --precision mixed --optimizer adam
    fsdpbench predict --model llama-7b --world-size 64 --strategy zero3 --precision bf16 --batch-size 2 \\
        --seq-len 4096 --device-memory 80GiB              # fits? largest batch? fewest GPUs?
    fsdpbench predict --model llama-7b --world-size 64 --strategy zero3 --method traced   # fake-tensor trace
    fsdpbench predict --model decoder-small --world-size 4 --strategy ddp,zero3 --device cpu --json
    fsdpbench predict --model decoder --model-args d_model=4096,n_layers=32,n_heads=32,n_kv_heads=8 \\
        --world-size 8 --strategy zero3 --precision bf16                   # any shape of a family
    fsdpbench predict --model llama-7b --world-size 8 --strategy zero3 --checkpoint full --host-memory 64GiB

Analytic (default): the memory model (instant, any size). Traced: the real strategy code on fake
tensors and a fake process group in this process (seconds to a minute; nothing allocated). Precision
``mixed`` is the ZeRO paper's accounting (b_p = b_g = 2, K = 12); ``bf16``/``fp16`` are what FSDP2's
MixedPrecisionPolicy keeps (fp32 shards, 16-bit unsharded copies in flight); ``fp32`` is plain fp32.
Sizes print in GB (1e9 bytes, as the ZeRO paper) unless ``--units GiB``. See docs/memory-model.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from collections.abc import Callable, Generator
from typing import Any

from rich.console import Console
from rich.table import Table

from fsdpbench.commands import running
from fsdpbench.core.markup import escape
from fsdpbench.core.schema import MODEL_COMM, MODEL_COMPUTE, MODEL_EXPOSED_COMM, MODEL_LINK, MODEL_STEP_TIME
from fsdpbench.predictors.memory_model import NO_ACTIVATION_MODEL, NO_PEAK_TERM
from fsdpbench.strategies import FULL_SHARD_STRATEGY, get_strategy

ROWS = (  # (key, label) in print order; keys index MemoryPrediction terms or its peak breakdown
    ("params", "params (resident shard or replica)"),
    ("padding", "FSDP padding (params + grads)"),
    ("grads", "grads (resident, after backward)"),
    ("optim", "optimizer state"),
    ("model_states", "model states (ZeRO accounting)"),
    ("resting", "model states at rest (after optimizer step)"),
    ("params_unsharded", "· unsharded params in flight"),
    ("grads_unsharded", "· unsharded grads (their unit in post-backward)"),
    ("grads_unsharded_in_bwd", "· unsharded grads (their unit still in backward)"),
    ("all_gather", "· all-gather buffers"),
    ("reduce_scatter", "· reduce-scatter buffers"),
    ("ddp_buckets", "· DDP gradient buckets"),
    ("activations", "· activations"),
    ("inputs", "· batch"),
    ("fwd_temp", "· forward temporaries (logits while the loss runs)"),
    ("temp", "· backward temporaries (gradients of activations)"),
    ("optim_temp", "· optimizer update temporaries"),
    ("step_temp", "· engine step temporaries (DeepSpeed: flat gradients, norms)"),
    ("peak", "peak: live tensors (tracker view)"),
    ("untracked", "+ allocated, not yet seen by trackers"),
    ("context", "+ CUDA context / NCCL allowance"),
    ("host", "states kept on the host (CPU offload), not on the device"),
    ("device_peak", "peak on the device"),
)


TERMINAL_COLUMNS = 80  # the lines printed outside rich's tables are wrapped to fit (rich wraps its own)

# --method → which predictors run; "emulated" prints the measurement beside the (instant) analytic figure
METHODS = {
    "analytic": ("analytic",),
    "traced": ("traced",),
    "both": ("analytic", "traced"),
    "emulated": ("analytic", "emulated"),
    "all": ("analytic", "traced", "emulated"),
}


# cli.py ends the command without the interpreter's teardown: it writes nothing but its output
EXIT_AT_ONCE = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fsdpbench.core.case import OPTIMIZER_IMPLS, OPTIMIZERS, WRAPS
    from fsdpbench.predictors.memory_model import PRECISIONS

    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--model",
        help="model preset or family (fsdpbench's registry), e.g. llama3-8b, or your own factory "
        "package.module:build (docs/scenarios.md)",
    )
    what.add_argument("--params", type=float, help="only a parameter count Ψ (model states only), e.g. 7.5e9")
    running.add_model_args_argument(parser)
    running.add_strategy_args_argument(parser)
    parser.add_argument("--world-size", type=int, required=True, help="ranks (GPUs)")
    running.add_strategies_argument(parser, "--strategy", FULL_SHARD_STRATEGY)
    parser.add_argument("--shard-size", type=int, help="HSDP ranks per shard group (default: 2)")
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=list(PRECISIONS),
        help="fp32 | bf16 | fp16 | *-lowreduce | mixed (ZeRO accounting) (default: fp32)",
    )
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="(default: adamw)")
    parser.add_argument("--batch-size", type=int, default=1, help="per-rank batch (default: 1)")
    parser.add_argument("--seq-len", type=int, default=2048, help="sequence length (default: 2048)")
    parser.add_argument("--wrap", default="block", choices=WRAPS, help="FSDP wrap units (default: block)")
    parser.add_argument("--prefetch", type=int, default=0, help="FSDP2 explicit prefetch depth (default: 0)")
    parser.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        default=False,
        metavar="POLICY",
        help="checkpoint blocks: full (the bare flag: every block), op (torchtitan's selective op policy) "
        "or every:N (every N-th block)",
    )
    parser.add_argument(
        "--optimizer-impl",
        default="for-loop",
        choices=OPTIMIZER_IMPLS,
        help="the optimizer's update (default: for-loop; torch's default on CUDA is foreach)",
    )
    parser.add_argument(
        "--max-norm", type=float, default=None, help="gradient clipping to this total norm (default: none)"
    )
    parser.add_argument(
        "--cpu-offload",
        action="store_true",
        help="FSDP CPU offload: sharded params, grads and optimizer state in host memory",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cuda (nccl, 512-byte blocks, context allowance) or cpu (gloo) (default: cuda)",
    )
    parser.add_argument("--rank", type=int, default=0, help="which rank (ZeRO-1's partition differs by rank)")
    parser.add_argument(
        "--method",
        default="analytic",
        choices=METHODS,
        help="analytic (formula); traced (fake tensors); both; emulated (one real rank alone on "
        "this machine's device with a fake process group, printed beside analytic); all",
    )
    parser.add_argument(
        "--device-memory", help="device memory per rank, e.g. 80GiB: fits? largest batch? fewest ranks?"
    )
    parser.add_argument(
        "--max-world-size", type=int, default=65536, help="search limit for the smallest world size"
    )
    parser.add_argument(
        "--context-allowance",
        default="1GiB",
        help="the analytic table's flat CUDA context + NCCL allowance (default: 1GiB); --device-memory on "
        "cuda uses the allocator model's sourced terms instead (--context-bytes, --nccl-channels)",
    )
    parser.add_argument(
        "--alloc-conf",
        default="",
        help="the CUDA caching allocator's settings for --device-memory, PYTORCH_CUDA_ALLOC_CONF syntax, "
        "e.g. expandable_segments:True (default: torch's defaults)",
    )
    parser.add_argument(
        "--context-bytes",
        help="NVML's CUDA context term (default: measured on the reference H100, or --calibration's)",
    )
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help="NVML's measured terms (context, cuDNN, NCCL library) of your GPU, as `fsdpbench check` "
        "writes them (calibration.json); default: the reference H100's",
    )
    parser.add_argument(
        "--nccl-channels", type=int, help="NCCL channels per communicator (default: 16, an assumption)"
    )
    parser.add_argument(
        "--units",
        choices=("GB", "GiB"),
        help="GB = 1e9 bytes, GiB = 2^30 (default: the unit --device-memory was given in, else GB)",
    )
    parser.add_argument(
        "--link",
        help="with --method emulated/all: also the modelled N-rank step time on this link (a preset: "
        "nvlink4, nvlink5, ib-ndr400, roce-200, pcie4, or alpha_us=A,busbw_GBps=B): the emulated "
        "rank's compute + α–β time of its collectives (docs/step-time-model.md)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="strategies predicted at once when they trace, each in a process of its own (default: one "
        "per strategy, up to two per CPU this process may use; 1: one after the other); the answers do "
        "not depend on it",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of tables")
    from fsdpbench.core.case import CHECKPOINT_METHODS

    parser.add_argument(
        "--checkpoint",
        default="none",
        choices=CHECKPOINT_METHODS,
        help="also predict a checkpoint of this method: bytes on disk per rank, rank 0's host peak, the "
        "device transient (default: none)",
    )
    parser.add_argument(
        "--checkpoint-model-only", action="store_true", help="checkpoint the model without the optimizer"
    )
    parser.add_argument("--host-memory", help="host memory of rank 0's node, e.g. 64GiB: does its save fit?")


def main(args: argparse.Namespace) -> int:
    from fsdpbench.predictors.memory_model.search import parse_bytes

    err = Console(stderr=True, soft_wrap=True)  # an error is one line, never wrapped
    try:
        cases = _build_cases(args)
        device_memory = parse_bytes(args.device_memory) if args.device_memory else None
        args.units = args.units or _units_asked(args.device_memory)
        args.context_bytes = parse_bytes(args.context_bytes) if args.context_bytes else None
        args.calibration_terms = _calibration(args.calibration)
        host_memory = parse_bytes(args.host_memory) if args.host_memory else None
        context = parse_bytes(args.context_allowance)
        args.step_link = _model_link(args.link)
    except (KeyError, ValueError) as exc:
        err.print(f"[red]error:[/] {escape(str(exc.args[0] if exc.args else exc))}", highlight=False)
        return 2
    results = []
    answers = _predicted(args, cases, device_memory, context)
    try:
        for case, answer in zip(cases, answers, strict=True):
            try:
                results.append(answer())
            except PREDICT_ERRORS as exc:
                err.print(f"[red]error:[/] {escape(case.strategy)}: {escape(str(exc))}", highlight=False)
                return 2
    finally:
        answers.close()  # the cases not yet started are not started
    if args.checkpoint != "none":
        if args.params is not None:
            err.print(
                "[red]error:[/] --checkpoint needs --model (the saved tensors' shapes)", highlight=False
            )
            return 2
        for res in results:
            res["checkpoint"] = _checkpoint_record(res["case"], host_memory)
            res["json"].append(res["checkpoint"])
    if args.json:
        print(json.dumps([r for res in results for r in res["json"]], indent=2))
    else:
        shown_notes: set[str] = set()
        for res in results:
            _print_table(args, res, shown_notes)
            if "checkpoint" in res:
                _print_checkpoint(res["checkpoint"], args.units)
    return 0


def _predicted(
    args: argparse.Namespace, cases: list[Any], device_memory: int | None, context: int
) -> Generator[Callable[[], dict[str, Any]], None, None]:
    """Each case's prediction, as a call that returns it or raises its error, in the order of ``cases``.
    Cases that trace (the allocator model's searches, the traced method) are independent of each other,
    so up to ``--jobs`` of them are predicted at once, each in a process of its own; the answers are the
    same either way (the traces keep no state between cases)."""
    jobs = _jobs(args.jobs, len(cases))
    traces = "traced" in METHODS[args.method] or (device_memory is not None and args.params is None)
    if jobs <= 1 or not traces or "emulated" in METHODS[args.method]:  # emulation runs real ranks
        for case in cases:
            yield functools.partial(_predict_one, args, case, device_memory, context)
        return
    import multiprocessing

    from fsdpbench.predictors.traced import import_trace_modules

    # forked after the imports a trace needs (~1 s of a 2-core CPU's time, once instead of per process)
    import_trace_modules()
    method = "fork" if sys.platform.startswith("linux") else "spawn"  # macOS's frameworks break on fork
    pool = multiprocessing.get_context(method).Pool(jobs, _predicting_process, (os.getpid(),))
    finished = False
    try:
        pending = [pool.apply_async(_predict_apart, (args, case, device_memory, context)) for case in cases]
        for result in pending:
            yield functools.partial(_answer, result)
        finished = True
    finally:
        if finished:
            pool.close()
        else:  # interrupted, or an error ended the command: the other cases are not waited for
            pool.terminate()
        pool.join()


def _jobs(asked: int, cases: int) -> int:
    """Processes predicting at once: as asked, else one per case where the command may use more than one
    CPU, up to two per CPU. Cases take unequal times (a strategy traced whole, one with searches), so a
    process per case lets the OS share the CPUs until the last one ends, where as many processes as CPUs
    would leave a CPU idle behind the longest (llama-7b, four strategies, 2 CPUs: 16.5 s against 19.3 s)."""
    if asked:
        return min(asked, cases)
    cpus = len(_usable_cpus())
    return 1 if cpus <= 1 else min(cases, 2 * cpus)


def _predicting_process(command_pid: int) -> None:
    """A predicting process dies with the command (SIGKILL included, on Linux) and leaves Ctrl-C to it,
    which ends the processes (no traceback from each). It computes nothing (fake tensors), so torch's
    intra-op threads, which a forked process must not inherit in use, stay at one."""
    import signal

    import torch

    from fsdpbench.pipeline.lifeline import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    if os.getppid() != command_pid:  # the command died before it could be told
        os._exit(1)
    torch.set_num_threads(1)


def _predict_apart(
    args: argparse.Namespace, case: Any, device_memory: int | None, context: int
) -> dict[str, Any] | PredictError:
    """``_predict_one`` in a process of its own: an error the command reports comes back as its message
    (an exception need not survive pickling: torch's often hold C++ objects)."""
    try:
        return _predict_one(args, case, device_memory, context)
    except PREDICT_ERRORS as exc:
        return PredictError(str(exc))


class PredictError(RuntimeError):
    """An error of one case's prediction, made in another process."""


def _answer(pending: Any) -> dict[str, Any]:
    result = pending.get()
    if isinstance(result, PredictError):
        raise result
    return result


def _usable_cpus() -> set[int]:
    """The CPUs this process may run on (all of them where the OS has no affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def _checkpoint_record(case: Any, host_memory: int | None) -> dict[str, Any]:
    """The checkpoint terms of every rank (modelled), and whether rank 0's host memory holds the save."""
    from fsdpbench.predictors.checkpoint import predict_checkpoint
    from fsdpbench.strategies import get_strategy

    strategy = get_strategy(case.strategy)
    reason = strategy.check(case)
    if reason:
        return {"strategy": case.strategy, "checkpoint": case.checkpoint, "not_applicable": reason}
    try:
        preds = predict_checkpoint(case, strategy)
    except ValueError as exc:  # a layout not modelled (e.g. DeepSpeed's bf16 files)
        return {"strategy": case.strategy, "checkpoint": case.checkpoint, "not_applicable": str(exc)}
    rank0 = preds[0]
    rec: dict[str, Any] = {
        "strategy": case.strategy,
        "checkpoint": case.checkpoint,
        "source": "analytic (modelled)",
        "bytes_on_disk_total": sum(p.bytes for p in preds),
        "ranks": [vars(p) for p in preds],
    }
    if host_memory is not None:
        rec.update(host_memory_bytes=host_memory, rank0_host_fits=rank0.save_host_peak_bytes <= host_memory)
    return rec


def _print_checkpoint(rec: dict[str, Any], units: str) -> None:
    console = Console()
    if "not_applicable" in rec:
        console.print(f"  checkpoint={rec['checkpoint']}: {escape(rec['not_applicable'])}", highlight=False)
        return
    table = Table(title=f"checkpoint={rec['checkpoint']} (analytic, modelled; {units})", title_justify="left")
    # not a column: the table's headings
    for heading in ("rank", "bytes on disk", "payload", "host memory the save adds", "device transient"):
        table.add_column(heading, justify="right")
    ranks = rec["ranks"]
    shown = ranks if len(ranks) <= 4 else [*ranks[:2], ranks[-1]]
    for p in shown:
        cells = (p["bytes"], p["payload_bytes"], p["save_host_peak_bytes"], p["device_transient_bytes"])
        # not a column: the prediction's field
        table.add_row(str(p["rank"]), *(_fmt(x, units) for x in cells))
    console.print(table)
    terms = ", ".join(f"{k} {_fmt(v, units)}" for k, v in ranks[0]["terms"].items() if v)
    console.print(
        f"  rank 0's host terms: {terms or 'none'}; in all on disk {_fmt(rec['bytes_on_disk_total'], units)}"
    )
    if "rank0_host_fits" in rec:
        need, have = _fmt(ranks[0]["save_host_peak_bytes"], units), _fmt(rec["host_memory_bytes"], units)
        verdict = "fits" if rec["rank0_host_fits"] else "does NOT fit"
        console.print(
            f"  rank 0's host memory: the save adds {need} of {have} {units}: {verdict}", highlight=False
        )


# the case fields set by the flags of the same name
CASE_FLAGS = (
    "world_size",
    "shard_size",
    "precision",
    "optimizer",
    "batch_size",
    "seq_len",
    "wrap",
    "prefetch",
    "cpu_offload",
    "device",
    "optimizer_impl",
    "max_norm",
)


MAX_PARAMS = 1e15  # a thousand times the largest models trained today: a typo, not a model, past it


MAX_PREDICT_RANKS = 1 << 20  # a million ranks: the largest jobs are a tenth of it
MAX_NCCL_CHANNELS = 64  # NCCL's own maximum (NCCL_MAX_NCHANNELS)
MAX_JOBS = 256  # processes predicting at once
# what a case's prediction raises for bad input or what cannot be predicted: one line, exit 2
PREDICT_ERRORS = (KeyError, ValueError, NotImplementedError, RuntimeError)


def _check_numbers(args: argparse.Namespace) -> None:
    """The numeric options within the bounds a case accepts (fsdpbench/core/case.py), before anything runs."""
    from fsdpbench.commands.arguments import check_count
    from fsdpbench.core.case import MAX_BATCH_SIZE, MAX_PREFETCH, MAX_SEQ_LEN

    for flag, value, low, high in (
        ("--world-size", args.world_size, 1, MAX_PREDICT_RANKS),
        ("--batch-size", args.batch_size, 1, MAX_BATCH_SIZE),
        ("--seq-len", args.seq_len, 1, MAX_SEQ_LEN),
        ("--prefetch", args.prefetch, 0, MAX_PREFETCH),
        ("--rank", args.rank, 0, MAX_PREDICT_RANKS - 1),
        ("--shard-size", args.shard_size, 1, MAX_PREDICT_RANKS),
        ("--max-world-size", args.max_world_size, 1, MAX_PREDICT_RANKS),
        ("--nccl-channels", args.nccl_channels, 0, MAX_NCCL_CHANNELS),
        ("--jobs", args.jobs, 0, MAX_JOBS),
    ):
        check_count(flag, value, low, high)


def _check_args(args: argparse.Namespace) -> list[str]:
    """The flags checked before any case is built; returns the strategies named (ValueError naming a flag)."""
    from fsdpbench.models import model_names

    if args.model and ":" in args.model:  # an own model typed here is explicit, as a plugin strategy is
        from fsdpbench.pipeline.scenario import enable_plugin_imports

        enable_plugin_imports()
    elif args.model and args.model not in model_names():
        raise ValueError(
            f"--model {args.model}: unknown model; allowed: {', '.join(model_names())}, or module:factory"
        )
    if args.world_size < 1:
        raise ValueError(f"--world-size {args.world_size}: must be ≥ 1")
    if args.params is not None and not (math.isfinite(args.params) and 1 <= args.params <= MAX_PARAMS):
        raise ValueError(f"--params {args.params}: must be a parameter count from 1 to {MAX_PARAMS:.0e}")
    _check_numbers(args)
    if args.max_norm is not None and not (math.isfinite(args.max_norm) and args.max_norm > 0):
        raise ValueError(f"--max-norm {args.max_norm}: must be a positive number")
    if args.model_args and args.params is not None:
        raise ValueError(f"{running.MODEL_ARGS_FLAG}: needs --model (a parameter count has no arguments)")
    strategies = [s.strip() for s in args.strategy.split(",") if s.strip()]
    if not strategies:
        raise ValueError("--strategy: give at least one, e.g. zero1,zero2,zero3")
    if any(":" in s for s in strategies):  # a module:Class typed here is explicit: cwd is searched last
        from fsdpbench.pipeline.scenario import enable_plugin_imports

        enable_plugin_imports()
    return strategies


def _build_cases(args: argparse.Namespace) -> list:
    from fsdpbench.core.case import Case, resolve_activation_checkpointing
    from fsdpbench.strategies import get_strategy

    strategies = _check_args(args)
    # validated only when given: the schema it is checked by (pydantic) is not what an instant answer loads
    model_args = running.parse_model_args(args.model_args, args.model) if args.model_args else {}
    strategy_args = running.parse_strategy_args(args.strategy_args) if args.strategy_args else {}
    try:
        ac_on, ac_policy = resolve_activation_checkpointing(args.activation_checkpointing)
    except ValueError as exc:
        raise ValueError(f"--activation-checkpointing: {exc}") from None
    cases = []
    for name in strategies:
        strategy = get_strategy(name)  # KeyError names the allowed strategies
        case = Case(
            activation_checkpointing=ac_on,
            activation_checkpointing_policy=ac_policy,
            model=args.model or "decoder",
            model_args=model_args,
            strategy=name,
            strategy_args=strategy_args,
            backend="nccl" if args.device == "cuda" else "gloo",
            checkpoint=args.checkpoint,
            checkpoint_optimizer=not args.checkpoint_model_only,
            alloc_conf=_alloc_conf(args.alloc_conf),
            **{field: getattr(args, field) for field in CASE_FLAGS},
        )
        from fsdpbench.engine.knobs import check_knobs

        reason = strategy.check(case) or check_knobs(case, strategy)
        if reason:
            raise ValueError(f"--strategy {name}: {reason}")
        cases.append(case)
    return cases


def _predict_one(
    args: argparse.Namespace, case: Any, device_memory: int | None, context: int
) -> dict[str, Any]:
    from fsdpbench.predictors.memory_model import ModelFacts, predict_memory, resolve_shard_size
    from fsdpbench.predictors.memory_model.search import fit_report
    from fsdpbench.strategies import get_strategy

    facts = ModelFacts.from_count(int(args.params)) if args.params is not None else None

    def predict(c: Any) -> Any:
        return predict_memory(c, rank=min(args.rank, c.world_size - 1), facts=facts, context_bytes=context)

    if not 0 <= args.rank < case.world_size:
        raise ValueError(f"--rank {args.rank}: outside 0..{case.world_size - 1}")
    out: dict[str, Any] = {"case": case, "json": []}
    fit = None
    if device_memory is not None:
        shard = resolve_shard_size(case, get_strategy(case.strategy).sharding) or 1
        fit = fit_report(
            case, predict, device_memory, max_world_size=args.max_world_size, shard_multiple=shard
        )
    if device_memory is not None and case.device == "cuda" and facts is not None:
        out["notes"] = [
            "--device-memory without --model: the analytic model states + a flat allowance; "
            "the allocator model needs a model to trace"
        ]
    if device_memory is not None and case.device == "cuda" and facts is None:
        out["allocator"], out["allocator_trace"] = _allocator_answer(args, case, device_memory)
        fit = None  # the allocator model answers "fits?" on CUDA, not tracked bytes + an allowance
    out["fit"] = fit
    methods = METHODS[args.method]
    if "analytic" in methods:
        out["analytic"] = pred = predict(case)
        out["json"].append(_analytic_record(pred, fit))
        fallback = _traced_instead(pred, case)
        if fallback and "traced" not in methods:
            out["fallback"] = fallback
            methods = (*methods, "traced")
    if "emulated" in methods:
        _require_model("emulated", facts)
        _add_emulated(out, case, args.rank, device_memory, context, getattr(args, "step_link", None))
    if "traced" in methods:
        _require_model("traced", facts)
        _add_traced(out, case, args.rank)
    if "allocator" in out:
        out["json"].append(out["allocator"].to_dict())
    return out


def _add_traced(out: dict[str, Any], case: Any, rank: int) -> None:
    """The traced method's answer into ``out``; when it stands in for a missing analytic activation
    model (a fallback), a failed trace becomes a note instead of an error."""
    from fsdpbench.predictors.traced import estimate

    try:
        # the allocator model's trace of this case is the traced method's too: traced once
        out["traced"] = est = out.get("allocator_trace") or estimate(case, rank=rank)
        out["json"].append({**est.to_dict(), **({"fallback": out["fallback"]} if "fallback" in out else {})})
    except Exception as exc:  # noqa: BLE001 — asked for: the error is the answer; a fallback: a note
        if "fallback" not in out:
            raise
        why = out["fallback"].removesuffix(": traced instead")
        out["fallback"] = TRACE_FAILED.format(why=why, error=f"{type(exc).__name__}: {exc}")
        out["json"][-1]["notes"] = [*out["json"][-1].get("notes", ()), out["fallback"]]


# the line the output carries when the analytic column has no peak and the traced method stands in
TRACED_INSTEAD = "analytic activation model not available for {model}: traced instead"
NO_TERM_TRACED = "analytic model has no term for {gap}: traced instead"
TRACE_FAILED = "{why}, and tracing it failed on this machine ({error}): no peak"


def _traced_instead(pred: Any, case: Any) -> str | None:
    """The fallback line where the analytic prediction has no peak because fsdpbench has no activation
    model for the model or no term for the strategy's setting; None where it has one."""
    if NO_ACTIVATION_MODEL.format(model=case.model) in pred.notes:
        return TRACED_INSTEAD.format(model=case.model)
    gap = get_strategy(case.strategy).analytic_gap(case)
    return NO_TERM_TRACED.format(gap=gap) if gap is not None else None


def _analytic_gap_note(case: Any) -> str:
    """The analytic note that the fallback line says again (no activation model, or no term)."""
    gap = get_strategy(case.strategy).analytic_gap(case)
    return NO_ACTIVATION_MODEL.format(model=case.model) if gap is None else NO_PEAK_TERM.format(gap=gap)


_NEEDS_MODEL = {
    "emulated": "a parameter count alone cannot run",
    "traced": "a parameter count alone cannot be traced",
}


def _units_asked(device_memory: str | None) -> str:
    """The units to print in: those --device-memory was given in (binary or decimal), else GB."""
    text = (device_memory or "").strip()
    return "GiB" if text.lower().endswith(("kib", "mib", "gib", "tib")) else "GB"


def _alloc_conf(text: str) -> str:
    """--alloc-conf, checked by the allocator model's parser (a ValueError names the setting)."""
    if text:
        from fsdpbench.predictors.memory_model.allocator import parse_alloc_conf

        parse_alloc_conf(text)
    return text


def _allocator_answer(args: argparse.Namespace, case: Any, device_memory: int) -> Any:
    """--device-memory on CUDA: the step's allocation stream (traced) replayed through the caching
    allocator model under the limit, then the largest batch and the smallest world size that fit."""
    import sys

    from fsdpbench.predictors.device_fit import AllocatorAnswer, DeviceModel
    from fsdpbench.predictors.memory_model import recipe_note, resolve_shard_size
    from fsdpbench.strategies import get_strategy

    def progress(traced: Any) -> None:
        what = f"batch {traced.batch_size}, world size {traced.world_size}"
        what = "the case asked" if traced == case else what
        print(f"allocator model: tracing {what} ({case.strategy}) …", file=sys.stderr, flush=True)

    model = DeviceModel.for_case(
        case,
        rank=args.rank,
        context_bytes=args.context_bytes,
        nccl_channels=args.nccl_channels,
        on_trace=progress,
        calibration=args.calibration_terms,
    )
    memory = model.memory(case)
    found, tracked_agree = _disagreements(args, case, model, memory)
    if found:  # the models contradict each other: no search built on them, and a verdict only where
        # the live tensors alone (both agree on them) do not fit
        fit = model.fit(case, device_memory)
        decided = tracked_agree and not fit.fits and fit.needed_bytes is None  # by the tracked peak alone
        answer = AllocatorAnswer(
            memory,
            fit if decided else None,
            None,
            None,
            args.max_world_size,
            recipe_note(case),
            device_memory,
            found,
        )
        return answer, model.estimate(case)
    shard = resolve_shard_size(case, get_strategy(case.strategy).sharding) or 1
    answer = AllocatorAnswer(
        memory,
        model.fit(case, device_memory),
        largest_batch=model.largest_batch(case, device_memory),
        smallest_world_size=model.smallest_world_size(
            case, device_memory, max_world_size=args.max_world_size, multiple=shard
        ),
        max_world_size=args.max_world_size,
        recipe=recipe_note(case),
        device_memory_bytes=device_memory,
    )
    return answer, model.estimate(case)


def _disagreements(
    args: argparse.Namespace, case: Any, model: Any, memory: Any
) -> tuple[tuple[str, ...], bool]:
    """Where the analytic layers and the allocator model's (the traced stream) contradict each other, and
    whether the two tracked peaks agree all the same."""
    from fsdpbench.predictors.consistency import AGREEMENT, LayerFigures, disagreements, layer_figures

    traced = LayerFigures(
        "allocator model", memory.tracked_peak, memory.allocated_peak, memory.reserved_peak, memory.nvml_peak
    )
    analytic = layer_figures(case, "analytic", rank=args.rank, model=model)
    found = tuple(disagreements(analytic, traced, lambda n: _size(n, args.units)))
    return found, abs(analytic.tracked - traced.tracked) <= AGREEMENT * max(analytic.tracked, traced.tracked)


def _calibration(path: str | None) -> Any:
    """--calibration's file, checked (a ValueError names the file and the field)."""
    if not path:
        return None
    from fsdpbench.predictors.memory_model.nvml import Calibration

    return Calibration.read(path)


def _require_model(method: str, facts: Any) -> None:
    if facts is not None:
        raise ValueError(f"--method {method} needs --model ({_NEEDS_MODEL[method]})")


def _analytic_record(pred: Any, fit: Any) -> dict[str, Any]:
    """The analytic prediction as JSON, with the fit test's answers when --device-memory was given."""
    rec = pred.to_dict()
    if fit:
        rec.update(
            device_memory_bytes=fit.device_memory_bytes,
            fits=fit.fits,
            fit_complete=fit.complete,
            largest_batch=fit.largest_batch,
            smallest_world_size=fit.smallest_world_size,
        )
    return rec


def _model_link(spec: str | None) -> Any:
    """--link → a Link (a preset or explicit numbers; a probed gloo link needs a run directory); None."""
    if spec is None:
        return None
    from fsdpbench.predictors.comm_model import LINK_PRESETS, LinkError, parse_explicit_link

    if spec in LINK_PRESETS:
        return LINK_PRESETS[spec]
    if "=" not in spec:
        raise LinkError(
            f"--link {spec!r}: predict takes a preset ({', '.join(LINK_PRESETS)}) or alpha_us=A,busbw_GBps=B"
        )
    return parse_explicit_link(spec)


def _add_emulated(
    out: dict[str, Any], case: Any, rank: int, device_memory: int | None, context: int, link: Any = None
) -> None:
    """Emulate the rank; with --device-memory, "fits?" from its peak plus the stated allowance."""
    from fsdpbench.pipeline.emulated_rank import emulate_rank

    out["emulated"] = emu = emulate_rank(case, rank=rank, link=link)
    rec = emu.to_dict()
    if device_memory is not None:
        needed = emu.device_peak_bytes + (context if case.device == "cuda" else 0)
        out["emulated_fit"] = (needed, needed <= device_memory)
        rec.update(device_memory_bytes=device_memory, fits=needed <= device_memory, needed_bytes=needed)
    out["json"].append(rec)


# below one GB/GiB a size is named in the largest smaller unit it reaches (decimal or binary, as asked)
SMALLER_UNITS = {
    "GB": (("MB", 10**6), ("KB", 10**3), ("B", 1)),
    "GiB": (("MiB", 2**20), ("KiB", 2**10), ("B", 1)),
}


def _fmt(nbytes: int | None, units: str) -> str:
    """A size in ``units`` as a bare number (the unit is the table's), or below one unit with its own
    smaller unit, e.g. "256 KiB", never "0.000244"."""
    if nbytes is None:
        return "not estimated"
    x = nbytes / (1e9 if units == "GB" else 2**30)
    if x == 0:
        return "0"
    if abs(x) >= 1:
        return f"{x:,.1f}"
    name, scale = next((n, k) for n, k in SMALLER_UNITS[units] if abs(nbytes) >= k or k == 1)
    value = nbytes / scale
    return f"{value:.0f} {name}" if abs(value) >= 100 else f"{value:.3g} {name}"


def _size(nbytes: int | None, units: str) -> str:
    """A size with its unit: "12.5 GiB", "256 KiB"."""
    text = _fmt(nbytes, units)
    return text if " " in text else f"{text} {units}"


def _print_table(args: argparse.Namespace, res: dict[str, Any], shown_notes: set[str]) -> None:
    """One case's table and lines; a note already shown for an earlier case (``shown_notes``) is not
    repeated."""
    case, units = res["case"], args.units
    pred, est, emu = res.get("analytic"), res.get("traced"), res.get("emulated")
    size = f"Ψ = {args.params:.4g}" if args.params is not None else case.model
    title = (
        f"{case.strategy} — {size}, {case.world_size} ranks, {case.precision}, {case.optimizer}, "
        f"batch {case.batch_size} × seq {case.seq_len}, {case.device}, rank {args.rank} ({units})"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("term")
    for shown, heading in ((pred, "analytic"), (est, "traced (tracker)"), (emu, "emulated (measured)")):
        if shown:
            table.add_column(heading, justify="right")
    rows, skipped = _term_rows(pred, est, emu, units)
    for label, cells in rows:
        table.add_row(label, *cells)
    if skipped:
        table.add_row(
            "activations, unsharded units, buffers, peak",
            "needs --model" if args.params is not None else "use --method traced",
        )
    console = Console()
    console.print(table)
    _print_method_notes(console, res, skipped, shown_notes)
    if emu:
        _print_emulated(console, emu, res.get("emulated_fit"), units, args)
    if res.get("fit"):
        _print_fit(console, res["fit"], units, args.max_world_size)
    for note in res.get("notes", ()):
        if note not in shown_notes:
            shown_notes.add(note)
            console.print(f"  note: {escape(note)}", highlight=False)
    if res.get("allocator"):
        for line in res["allocator"].lines(lambda n: _size(n, units), width=TERMINAL_COLUMNS - 2):
            print(f"  {line}")  # not rich: wrapped by lines() so that a figure never breaks


def _print_method_notes(
    console: Console, res: dict[str, Any], skipped: list[str], shown_notes: set[str]
) -> None:
    """The fallback line, then the analytic and traced methods' notes not shown for an earlier case."""
    pred, est = res.get("analytic"), res.get("traced")
    if res.get("fallback"):
        console.print(f"  {escape(res['fallback'])}", highlight=False)
    for note in (pred.notes if pred else ()) + (est.notes if est else ()):
        if res.get("fallback") and note == _analytic_gap_note(res["case"]):
            continue  # the fallback line above says what happened instead
        if not (skipped and "need a model" in note) and note not in shown_notes:
            shown_notes.add(note)
            console.print(f"  note: {escape(note)}", highlight=False)


def _term_rows(pred: Any, est: Any, emu: Any, units: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """The table's (label, cells) per memory term, and the terms the analytic column could not give."""
    others = [_traced_rows(est)] if est else []
    others += [_emulated_rows(emu)] if emu else []
    rows, skipped = [], []
    for key, label in ROWS:
        if pred and not others and _analytic_value(pred, key) is None:
            skipped.append(label.lstrip("·+ "))
            continue
        cells = [_analytic_cell(pred, key, units, beside=bool(others))] if pred else []
        cells += ["—" if values.get(key) is None else _fmt(values[key], units) for values in others]
        if all(c in ("0", "—") for c in cells):
            continue
        if key == "peak" and pred and pred.peak_moment:
            label += f" — at {pred.peak_moment}"
        rows.append((label, cells))
    return rows, skipped


def _analytic_cell(pred: Any, key: str, units: str, *, beside: bool) -> str:
    """One analytic cell; resting states equal to the model states read "same" beside other columns."""
    if beside and key == "resting" and pred.resting_states_bytes == pred.model_states_bytes:
        return "same"
    return _fmt(_analytic_value(pred, key), units)


def _print_fit(console: Console, fit: Any, units: str, max_world_size: int) -> None:
    """The fit test's verdict: fits?, the largest batch and the smallest world size that fit."""
    mem, needed = _size(fit.device_memory_bytes, units), _fmt(fit.needed_bytes, units)
    if fit.complete:
        text = (
            f"{'fits' if fit.fits else 'does NOT fit'} in {mem} (needs {needed}); "
            f"largest per-rank batch that fits: {fit.largest_batch or 'none'}; smallest world size "
            f"that fits (powers of two ≤ {max_world_size}): {fit.smallest_world_size or 'none'}"
        )
    else:
        text = (
            f"{'model states fit' if fit.fits else 'model states alone do NOT fit'} in {mem} "
            f"(model states {needed}; activations not estimated without --model); smallest world size "
            f"where the model states fit: {fit.smallest_world_size or 'none'}"
        )
    console.print(f"  {escape(text)}", highlight=False)


def _analytic_value(pred: Any, key: str) -> int | None:
    direct = {
        "params": pred.params_bytes,
        "padding": pred.padding_bytes,
        "grads": pred.grads_bytes,
        "optim": pred.optim_bytes,
        "model_states": pred.model_states_bytes,
        "resting": pred.resting_states_bytes,
        "peak": pred.peak_bytes,
        "untracked": pred.untracked_bytes,
        "context": pred.context_bytes,
        "device_peak": pred.device_peak_bytes,
        "host": pred.host_bytes if pred.device == "cuda" else 0,
    }
    if key in direct:
        if key == "resting" and pred.resting_states_bytes == pred.model_states_bytes:
            return 0  # same as model states: not repeated
        return direct[key]
    return pred.peak_breakdown.get(key) if pred.peak_breakdown else None


def _emulated_rows(emu: Any) -> dict[str, int]:
    """The emulated rank's tracker, in the traced column's terms; on a GPU the device peak is the
    allocator's (peak reserved), on the CPU the tracker's."""
    rows = _traced_rows(emu)
    rows["device_peak"] = emu.device_peak_bytes
    return rows


def _print_emulated(console: Console, emu: Any, fit: tuple[int, bool] | None, units: str, args: Any) -> None:
    from fsdpbench.engine.emulate import EMULATION_LIMITS

    where = "cuda:0" if emu.device == "cuda" else "the CPU"
    console.print(
        f"  emulated: rank {emu.rank} alone on {where} with a fake process group, "
        + ("one warm-up, one timed" if not emu.modelled_step else "two warm-up, three timed, one profiled")
        + f" and one tracked step, {emu.wall_s:.1f} s in all; compute-only step "
        f"{(emu.step_time_ms or 0) / 1e3:.2f} s",
        highlight=False,
    )
    if emu.alloc_peak_allocated_bytes is not None:
        console.print(
            f"  emulated CUDA allocator peak: allocated {_fmt(emu.alloc_peak_allocated_bytes, units)}, "
            f"reserved {_size(emu.alloc_peak_reserved_bytes, units)}; NVML peak "
            f"{_fmt(emu.nvml_peak_bytes, units)}",
            highlight=False,
        )
    if emu.modelled_step:
        m = emu.modelled_step
        console.print(
            f"  modelled step of {emu.case_id} on {m[MODEL_LINK]}: "
            f"{m[MODEL_STEP_TIME]:.1f} ms = compute {m[MODEL_COMPUTE]:.1f} ms + exposed "
            f"communication {m[MODEL_EXPOSED_COMM]:.1f} ms (of {m[MODEL_COMM]:.1f} ms); assumes "
            "every rank like this one, no stragglers, the link as its preset says "
            "(docs/step-time-model.md)",
            highlight=False,
        )
    console.print(
        f"  emulation cannot see: {EMULATION_LIMITS['collective_time']}; {EMULATION_LIMITS['nccl_buffers']}",
        highlight=False,
    )
    if fit:
        needed, fits = fit
        extra = f" + {args.context_allowance} CUDA context/NCCL allowance" if emu.device == "cuda" else ""
        console.print(
            f"  emulated: {'fits' if fits else 'does NOT fit'} in {_size(parse_device_memory(args), units)} "
            f"(needs {_fmt(needed, units)}: emulated device peak{extra})",
            highlight=False,
        )


def parse_device_memory(args: Any) -> int:
    from fsdpbench.predictors.memory_model.search import parse_bytes

    return parse_bytes(args.device_memory)


def _traced_rows(est: Any) -> dict[str, int]:
    cat = est.peak_by_category
    states = est.states_by_category
    return {
        "params": states.get("params"),
        "grads": states.get("grads"),
        "optim": states.get("optim"),
        "resting": est.model_states_bytes,
        "params_unsharded": cat.get("params_unsharded"),
        "grads_unsharded": cat.get("grads_unsharded"),
        "all_gather": cat.get("all_gather"),
        "reduce_scatter": cat.get("reduce_scatter"),
        "activations": cat.get("activations", 0) + cat.get("inputs", 0),
        "temp": cat.get("temp"),
        "peak": est.peak_bytes,
    }
