"""Run a list of cases one after another, each in fresh processes, storing each as it finishes."""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from fsdpbench.core.case import HOST_TUNINGS, Case
from fsdpbench.core.rundir import (
    RunDirError,
    check_component,
    check_inside,
    space_error,
    torch_caches_in,
    use_torch_cache,
)
from fsdpbench.core.schema import (
    CASE_ID,
    CASE_MODEL_STEP_TIME,
    COMM_PATTERN,
    ERROR,
    MODEL_CHECKABLE,
    MODEL_STEP_TIME,
    MODEL_UNCHECKED_REASON,
    OK,
    RANK,
    SKIPPED,
    STATUS,
    STEP_TIME,
    WALL_S,
)
from fsdpbench.engine.rank_result import CaseOutcome
from fsdpbench.pipeline.interrupts import ignore_sigint
from fsdpbench.pipeline.launch import CaseDirInUse, collect_case, launch_case
from fsdpbench.pipeline.scenario import ScenarioError, Skipped, case_from_row
from fsdpbench.store.results import (
    ResultsFileError,
    RunStore,
    build_rows,
    read_results_file,
    skipped_rows,
)

TRACED_LOG = "traced.log"  # in the run directory: what the traced predictor's processes wrote


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def default_run_dir(scenario: str, root: str | Path = "reports") -> Path:
    """reports/<scenario>/<timestamp>; the name is one safe component, so it stays under ``root``."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return check_inside(Path(root) / check_component(scenario) / stamp, Path(root))


def latest_run_dir(scenario: str, root: str | Path = "reports") -> Path | None:
    runs = sorted(p for p in (Path(root) / scenario).glob("*") if (p / "run.json").exists())
    return runs[-1] if runs else None


def case_overhead(outcome: CaseOutcome) -> dict[str, Any]:
    """Launch overhead of a case: its wall time minus the slowest rank's time inside training steps."""
    steps_s = max((r.steps_wall_s or 0.0 for r in outcome.ranks), default=0.0)
    return {
        STATUS: outcome.status,
        WALL_S: round(outcome.wall_s, 3),
        "spawn_s": round(outcome.spawn_s, 3),
        "steps_s": round(steps_s, 3),
        "overhead_s": round(outcome.wall_s - steps_s, 3),
    }


def run_cases(
    cases: list[Case],
    skipped: list[Skipped],
    store: RunStore,
    meta: dict[str, Any],
    *,
    resume: bool = False,
    collect: bool = False,
    on_start: Callable[[Case, int], None] | None = None,
    on_done: Callable[[Case, CaseOutcome | None, pd.DataFrame], None] | None = None,
    traced: bool = False,
    link: str | None = None,
) -> pd.DataFrame:
    """Run every case not already stored (with resume); write rows and run.json after each.

    With ``collect``, launch nothing: read what an external launcher's ranks wrote into each
    case directory (multi-node runs; see ``python -m fsdpbench.engine.worker``). With ``traced``, each
    finished case also gets the traced predictor's figures per rank (``traced_*`` columns). With
    ``link`` (a --link value), each finished case gets its modelled step time on that link
    (``model_*`` columns; predictors/step_model.py)."""
    store.create()
    # refuses (RunDirError) while another run uses this directory
    with store.lock(), torch_caches_in(store.run_dir):
        tracer = TracedPredictor(log_path=store.run_dir / TRACED_LOG) if traced else None
        meta["host_tuning"] = host_tuning_record([*cases, *(s.case for s in skipped)])
        done = _start_run(store, meta, skipped, resume=resume, traced=traced, link=link)
        try:
            for i, case in enumerate(cases):
                if case.case_id in done:
                    continue
                # what is alive now (torch's, pandas', plotly's modules; the run's state) lives on: out
                # of the cyclic collector's sight, whose passes over it made the trace analysis below
                # several times slower (pipeline/_forkserver_heap.py does the same in the ranks)
                gc.freeze()
                if on_start:
                    on_start(case, i)
                outcome = _launch_or_collect(case, store, meta, collect=collect, link=link)
                if outcome is None:
                    continue
                rows = _case_rows(
                    case, outcome, store, meta["env"], link=link, tracer=tracer, launch_twin=not collect
                )
                meta["cases"][case.case_id] = case_overhead(outcome)
                if not _store_case(store, case, rows, meta):
                    continue
                if on_done:
                    on_done(case, outcome, rows)
            not_run = [i for i, c in meta["cases"].items() if c.get(STATUS) in (NOT_RUN, NOT_STORED)]
            # a case skipped because a live rank holds its directory, or not stored for want of space, is
            # not done: --resume runs it
            meta[STATUS] = f"incomplete: {len(not_run)} case(s) not run" if not_run else "complete"
        except KeyboardInterrupt:
            meta[STATUS] = "interrupted"
            raise
        except OSError as exc:  # a full disk, an unwritable directory: stored cases stay, resume works
            meta[STATUS] = f"failed: {exc.strerror or exc}"
            raise
        except ResultsFileError as exc:  # a case file planted in cases/ that is not this run's
            meta[STATUS] = f"failed: {exc}"
            raise
        finally:
            _end_run(store, meta, tracer, failing=sys.exc_info()[0] is not None)
        return store.consolidate()


def _start_run(
    store: RunStore,
    meta: dict[str, Any],
    skipped: list[Skipped],
    *,
    resume: bool,
    traced: bool,
    link: str | None,
) -> set[str]:
    """Store the skipped cases and run.json as "running"; return the ids already stored (--resume)."""
    meta["predictions"] = ["analytic", "traced"] if traced else ["analytic"]
    if link:
        meta["step_time_model"] = {"link": link}
    done = store.completed_ids()
    if resume:
        _check_stored_cases(store, done)
    if done and not resume:  # a fresh run must not take another run's rows into its results and gate
        raise RunDirError(
            f"{store.run_dir} already holds {len(done)} stored case(s) of another run; continue that run "
            "with --resume, or choose an empty --out"
        )
    meta.setdefault("cases", {})
    meta[STATUS] = "running"
    for item in skipped:
        store.write_case(item.case.case_id, skipped_rows(item.case, item.reason, meta["env"]))
    store.write_run_json(meta)
    return done


def host_tuning_record(cases: list[Case]) -> str:
    """run.json's (and the report's) words for the host tuning of a run's cases: each tuning, what it
    does, and how many cases ran with it (one sentence when they all did)."""
    counts: dict[str, int] = {}
    for case in cases:
        counts[case.host_tuning] = counts.get(case.host_tuning, 0) + 1
    if len(counts) == 1:
        (tuning,) = counts
        return f"{tuning}: {HOST_TUNINGS[tuning]}"
    return "; ".join(f"{t} ({n} case{'s' if n != 1 else ''}): {HOST_TUNINGS[t]}" for t, n in counts.items())


def _check_stored_cases(store: RunStore, done: set[str]) -> None:
    """Each case file --resume keeps is this run's: a results table (``read_results_file``) of that one
    case, its configuration checked as a scenario's case (``case_from_row``); ResultsFileError names the
    file and the field otherwise (a foreign file failed later, in pyarrow, with the run left running)."""
    for case_id in sorted(done):
        path = store.cases_dir / f"{case_id}.parquet"
        frame = read_results_file(path)
        if frame.empty or set(frame[CASE_ID]) != {case_id}:
            raise ResultsFileError(f"{path}: column {CASE_ID}: not the rows of case {case_id}")
        try:
            case_from_row(frame.iloc[0], source=str(path))
        except ScenarioError as exc:
            raise ResultsFileError(str(exc)) from None


NOT_RUN = "not run"  # run.json's status of a case whose directory a live rank holds
NOT_STORED = "not stored"  # run.json's status of a case whose rows found no space on the disk


def _store_case(store: RunStore, case: Case, rows: pd.DataFrame, meta: dict[str, Any]) -> bool:
    """Store the case's rows and run.json; whether its rows are stored. A disk with no space left is
    this case's failure, in one line, not the run's: the sweep goes on (a failed case's removed
    checkpoint, or the user, may free space), and ``--resume`` runs the case again."""
    try:
        store.merge_timelines(case.case_id)
        store.write_case(case.case_id, rows)
    except OSError as exc:
        full = space_error(exc)
        if full is None:
            raise
        stored = case.case_id in store.completed_ids()  # the case's file, if only results.parquet failed
        if not stored:
            error = f"no space left on device to store its rows ({full.filename or store.cases_dir})"
            print(f"warning: {case.case_id} not stored: {error}; --resume runs it again", file=sys.stderr)
            meta["cases"][case.case_id] = {STATUS: NOT_STORED, ERROR: error}
    else:
        stored = True
    try:
        store.write_run_json(meta)
    except OSError as exc:  # written again after the next case and at the end
        if space_error(exc) is None:
            raise
    return stored


def _launch_or_collect(
    case: Case, store: RunStore, meta: dict[str, Any], *, collect: bool, link: str | None = None
) -> CaseOutcome | None:
    """The case's outcome: its ranks launched here (with a modelled step time to come, its compute twin
    beside them, taking turns: ``twin_beside``), or (``collect``) read from what they wrote; None when
    its directory is in use (not run and not stored: a later --resume runs it)."""
    try:
        if collect:
            return collect_case(case, store.case_dir(case.case_id))
        return launch_case(case, store.case_dir(case.case_id), twin=twin_beside(case, link))
    except CaseDirInUse as exc:
        print(f"warning: {case.case_id} not run: {exc}", file=sys.stderr)
        meta["cases"][case.case_id] = {STATUS: NOT_RUN, ERROR: str(exc)}
        return None


def twin_beside(case: Case, link: str | None) -> Case | None:
    """The compute twin to start beside the case's ranks: where the case will get a modelled step time
    whose compute is a twin's (a real CPU case, no more ranks than cores, a link asked for)."""
    from fsdpbench.pipeline.compute_twin import interleaved_twin
    from fsdpbench.predictors import step_model

    if not link or step_model.contended(
        torch_device_type(case.device), case.world_size, case.emulate, os.cpu_count()
    ):
        return None
    return interleaved_twin(case)


def _case_rows(
    case: Case,
    outcome: CaseOutcome,
    store: RunStore,
    env: dict[str, Any],
    *,
    link: str | None,
    tracer: TracedPredictor | None,
    launch_twin: bool = True,
) -> pd.DataFrame:
    """The case's result rows: measured, predicted, and (when asked) modelled step time and traced."""
    if outcome.status == SKIPPED:
        rows = skipped_rows(case, outcome.error, env)
    else:
        rows = add_predictions(case, build_rows(case, outcome, env))
    if link and outcome.status == OK:
        rows = add_step_model(
            case, rows, store.case_dir(case.case_id), store.run_dir, link, launch_twin=launch_twin
        )
    if tracer is not None and outcome.status == OK:
        rows = tracer.add_columns(case, rows, store.case_dir(case.case_id))
    return rows


def _end_run(store: RunStore, meta: dict[str, Any], tracer: TracedPredictor | None, *, failing: bool) -> None:
    """Close the tracer and store run.json's end; a write error is raised unless already failing."""
    if tracer is not None:
        tracer.close(kill=failing)  # interrupted: a trace under way is not waited for
    meta["ended"] = now_iso()
    try:
        store.write_run_json(meta)
    except OSError:
        if not failing:
            raise
        # already failing (the disk that failed above): run.json keeps its last good state


def add_predictions(case: Case, rows: pd.DataFrame) -> pd.DataFrame:
    """The analytic prediction for the same case, beside the measurement (pred_* columns)."""
    from fsdpbench.predictors.checkpoint import checkpoint_columns
    from fsdpbench.predictors.memory_model.columns import prediction_columns

    try:
        pred = {**prediction_columns(case, rows), **checkpoint_columns(case, rows)}
    except Exception as exc:  # noqa: BLE001 — a prediction bug must not lose a measurement
        print(f"warning: prediction failed for {case.case_id}: {exc}", file=sys.stderr)
        return rows
    for key, value in pred.items():
        rows[key] = value
    return rows


def add_step_model(
    case: Case,
    rows: pd.DataFrame,
    case_dir: Path,
    run_dir: Path,
    link_spec: str,
    *,
    launch_twin: bool = True,
) -> pd.DataFrame:
    """The modelled step time on the link (model_* columns per rank; case_model_step_time_ms is the
    slowest rank's, as case_step_time_ms is): each rank's compute timed without the profiler (the
    compute twin; an emulated rank's own timed steps), placed by the ranks' profiled traces.
    ``launch_twin`` False (``--collect``: the ranks ran elsewhere, the twin would time this machine):
    the profiled compute, said so in model_method."""
    from fsdpbench.engine.intra_op import rank_threads
    from fsdpbench.metrics.profiled import shard_group_sizes
    from fsdpbench.pipeline.comm_probe import resolve_link
    from fsdpbench.predictors import step_model
    from fsdpbench.strategies import get_strategy

    traces = {int(r): case_dir / f"trace_rank{int(r)}.json.gz" for r in rows[RANK] if int(r) >= 0}
    traces = {r: p for r, p in traces.items() if p.exists()}
    if not traces or COMM_PATTERN not in rows:
        return rows
    device_type = torch_device_type(case.device)
    beyond = step_model.contended(device_type, case.world_size, case.emulate, os.cpu_count())
    if launch_twin and beyond:  # no modelled figure where the model is known not to hold: no probe, no twin
        rows[MODEL_CHECKABLE] = False
        rows[MODEL_UNCHECKED_REASON] = beyond
        return rows
    try:
        link = resolve_link(link_spec, case.backend, case.world_size, run_dir, case.host_tuning)
        sharding = get_strategy(case.strategy).sharding
        bare, method = _bare_compute_ms(case, rows, case_dir, device_type, launch_twin=launch_twin)
        # real ranks on this machine whose threads fill its cores: no collective overlaps compute
        serial = (
            launch_twin
            and not case.emulate
            and step_model.no_idle_core(
                device_type, case.world_size, rank_threads(case.world_size), os.cpu_count()
            )
        )
        per_rank = step_model.case_model_columns(
            traces,
            sharding,
            device_type,
            link,
            steps=max(1, case.profile_steps),
            group_size=shard_group_sizes(case, sharding)[1],
            bare_compute_ms=bare,
            method=method,
            serial=serial,
        )
    except Exception as exc:  # noqa: BLE001 — a model bug must not lose the measurement
        print(
            f"warning: step-time model failed for {case.case_id}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return rows
    return _with_model_columns(case, rows, per_rank, n_traces=len(traces), device_type=device_type)


def _bare_compute_ms(
    case: Case, rows: pd.DataFrame, case_dir: Path, device_type: str, *, launch_twin: bool
) -> tuple[dict[int, float], str]:
    """Each rank's compute time without the profiler, and the model_method that names where it came
    from; no times: the profiled compute (or the kernels' on a GPU)."""
    from fsdpbench.pipeline.compute_twin import twin_compute_ms
    from fsdpbench.predictors import step_model

    bare: dict[int, float] = {}
    method = ""
    if case.emulate:
        timed = rows.set_index(RANK)[STEP_TIME] if STEP_TIME in rows else pd.Series(dtype=float)
        bare = {int(r): float(v) for r, v in timed.items() if int(r) >= 0 and pd.notna(v)}
        method = step_model.METHOD_EMULATED
    elif launch_twin:
        # on a GPU too: a step the host cannot launch fast enough (decoder-base in bf16 on an H200:
        # 26-30 ms of kernels in a 48-121 ms step) is host time, which the kernels do not show
        bare, interleaved = twin_compute_ms(case, case_dir)
        method = step_model.METHOD_TWIN_INTERLEAVED if interleaved else step_model.METHOD_TWIN
    if not bare:
        method = step_model.METHOD_KERNELS if device_type == "cuda" else step_model.METHOD_PROFILED
    return bare, method


def _with_model_columns(
    case: Case, rows: pd.DataFrame, per_rank: dict[int, dict[str, Any]], *, n_traces: int, device_type: str
) -> pd.DataFrame:
    """``rows`` with each rank's model_* columns, the case's modelled step time (the slowest rank's, when
    every traced rank has one) and whether the model can be checked here."""
    from fsdpbench.predictors import step_model

    model = pd.DataFrame.from_dict(per_rank, orient="index")
    rows = rows.drop(columns=[c for c in model.columns if c in rows])
    rows = rows.merge(model, left_on=RANK, right_index=True, how="left")
    modelled = [c[MODEL_STEP_TIME] for c in per_rank.values()]
    rows[CASE_MODEL_STEP_TIME] = max(modelled) if len(modelled) == n_traces else None
    reason = step_model.checkable(device_type, case.world_size, case.emulate, os.cpu_count())
    rows[MODEL_CHECKABLE] = not reason
    rows[MODEL_UNCHECKED_REASON] = reason
    return rows


def write_alloc_streams(traced: dict[int, dict[str, Any]], case_dir: Path) -> None:
    """Each traced rank's allocation stream beside the case's other files (alloc_stream_rank{R}.json.gz)."""
    from fsdpbench.predictors.memory_model.alloc_stream import AllocStream, stream_file

    for rank, t in traced.items():
        if t.get("alloc_stream"):
            AllocStream.from_json(t["alloc_stream"]).write(case_dir / stream_file(rank))


def torch_device_type(device: str) -> str:
    """'cuda' for cuda and cuda:N, else the part before the colon."""
    return device.split(":", 1)[0]


def _tracer_process_init(log_path: str) -> None:
    """The traced predictor's process: deaf to Ctrl-C (the orchestrator answers it), gone with the fork
    server, which is gone with the orchestrator, and writing (fds 1 and 2: Python's warnings, the C++
    libraries' lines) to ``log_path``, not the terminal."""
    from fsdpbench.pipeline.lifeline import die_with_parent, send_output_to

    ignore_sigint()
    die_with_parent()
    run_dir = None if log_path == os.devnull else Path(log_path).parent
    send_output_to(log_path, run_dir)  # in the run directory: a link planted there is not appended through
    if run_dir is not None:
        use_torch_cache(run_dir)


# each tracing process holds torch and its trace (a 70B model's: ~2 GB resident): not one per core of
# a big host
MAX_TRACING_PROCESSES = 4


class TracedPredictor:
    """The traced predictor for each finished case, in long-lived child processes (forked from the ranks'
    fork server, torch already imported): they join a (fake) process group, which the orchestrating
    process never does. Traces run between cases, when no rank does: a CPU case's ranks are traced on
    up to one process per core (at most ``MAX_TRACING_PROCESSES``); a CUDA case's in one process of
    their own, ended once the case is traced: a tracing process holds a CUDA context (0.55–0.70 GB on
    an H100), which NVML would count in every later case's device memory."""

    def __init__(self, timeout_s: float = 600.0, log_path: Path | None = None) -> None:
        self.timeout_s = timeout_s
        self.log_path = str(log_path) if log_path else os.devnull  # the tracing processes' output
        self._pools: dict[bool, Any] = {}  # by "traces a CUDA case"

    def add_columns(self, case: Case, rows: pd.DataFrame, case_dir: Path | None = None) -> pd.DataFrame:
        """traced_* columns; a CUDA case's allocation streams go to ``case_dir`` (alloc_stream_rank{R})."""
        from fsdpbench.predictors.traced_columns import trace_ranks, traced_columns

        ranks = sorted({int(r) for r in rows[RANK] if int(r) >= 0})
        try:
            pool, workers = self._pool(case.device == "cuda")
            chunks = [ranks[i::workers] for i in range(min(workers, len(ranks)))]
            futures = [pool.submit(trace_ranks, case.to_dict(), chunk) for chunk in chunks]
            deadline = time.monotonic() + self.timeout_s
            traced: dict[int, dict[str, Any]] = {}
            for future in futures:
                traced.update(future.result(timeout=max(0.0, deadline - time.monotonic())))
        except Exception as exc:  # noqa: BLE001 — a trace that fails must not lose the measurement
            print(
                f"warning: traced prediction failed for {case.case_id}: {type(exc).__name__}: {exc}",
                file=sys.stderr,
            )
            self.close(kill=True)  # a broken or stuck child is replaced for the next case
            return rows
        finally:
            if case.device == "cuda":
                self._end_pool(cuda=True)
        for key, value in traced_columns(traced, rows).items():
            rows[key] = value
        if case_dir is not None:
            write_alloc_streams(traced, case_dir)
        return rows

    def _pool(self, cuda: bool) -> tuple[Any, int]:
        from concurrent.futures import ProcessPoolExecutor

        from fsdpbench.pipeline.launch import forkserver_context

        workers = 1 if cuda else max(1, min(os.cpu_count() or 1, MAX_TRACING_PROCESSES))
        if cuda not in self._pools:
            self._pools[cuda] = ProcessPoolExecutor(
                max_workers=workers,
                mp_context=forkserver_context(),
                initializer=_tracer_process_init,
                initargs=(self.log_path,),
            )
        return self._pools[cuda], workers

    def _end_pool(self, *, cuda: bool) -> None:
        pool = self._pools.pop(cuda, None)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def close(self, kill: bool = False) -> None:
        for pool in self._pools.values():
            if kill:  # a trace past its timeout is not waited for
                for proc in list((getattr(pool, "_processes", None) or {}).values()):
                    proc.kill()
            pool.shutdown(wait=not kill, cancel_futures=True)
        self._pools = {}
