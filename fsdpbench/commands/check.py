"""``fsdpbench check``: how far to trust fsdpbench's memory predictions on this GPU, driver and torch.

    fsdpbench check --out check/                 # on a CUDA machine: ~5 minutes on one GPU
    fsdpbench predict ... --calibration check/calibration.json

It runs a fixed grid of cases with the run machinery (``pipeline.runner.run_cases``, ``traced: true``):
every strategy family (DDP, ZeRO-1, FSDP2's ZeRO-2/3 and HSDP, FSDP1, DeepSpeed's ZeRO-2/3 where
installed) as rank 0 of 8-rank jobs emulated on this GPU (fake process group: every allocation real),
fp32 and bf16, with and without activation checkpointing, one ``expandable_segments`` case, one without
the profiler (its share of NVML), a Hugging Face model where ``transformers`` is installed, and one real
one-rank case with NCCL (its library's share). Each case is measured (tracker, allocator, NVML) and
predicted by every method (analytic; traced and its allocator model); three cases also get their fits
boundary measured — the smallest ``torch.cuda.set_per_process_memory_fraction`` at which a step runs,
bisected, each probe a fresh process — beside the allocator model's. Out come the table of errors per
layer (terminal and ``check.html``), ``check.json`` and ``calibration.json``: this machine's measured NVML
terms (``predictors/memory_model/nvml.py``) for ``predict --calibration``.

``--from RUN_DIR`` renders the report of a check run already measured (its results.parquet and run.json)
without a GPU.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpbench.core import schema
from fsdpbench.core.case import Case
from fsdpbench.core.formats import BOUNDARIES, FORMAT_VERSION
from fsdpbench.core.markup import escape
from fsdpbench.core.names import FULL_SHARD_STRATEGY, REFERENCE_STRATEGY
from fsdpbench.core.readback import read_json
from fsdpbench.core.rundir import write_atomically

CHECK_MODEL = "decoder-base"
NVML_NEEDS_GPU = "fsdpbench check needs a CUDA GPU"
EMULATED_WORLD_SIZE = 8
SHARD_GROUP = 4  # HSDP: 2 replicas × 4 shards
EXPANDABLE = "expandable_segments:True"
HF_MODEL = {"model": "hf-llama", "seq_len": 256}  # a Hugging Face model, when transformers is installed
BOUNDARY_LABELS = (
    f"{FULL_SHARD_STRATEGY} bf16",
    f"{REFERENCE_STRATEGY} bf16",
    f"{FULL_SHARD_STRATEGY} fp32 AC",
)
BOUNDARY_PROBES = 6
MAX_BOUNDARIES_BYTES = 1 << 20  # a few lines per bisected case
LAYERS = ("tracker", "allocated", "reserved", "nvml")
METHODS = ("analytic", "traced")
MEASURED = {
    "tracker": schema.TRACKER_PEAK,
    "allocated": schema.ALLOC_PEAK_ALLOCATED,
    "reserved": schema.ALLOC_PEAK_RESERVED,
    "nvml": schema.NVML_PEAK,
}
TRACED = {
    "tracker": schema.TRACED_PEAK,
    "allocated": schema.TRACED_ALLOC_ALLOCATED,
    "reserved": schema.TRACED_ALLOC_RESERVED,
    "nvml": schema.TRACED_NVML,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="the check's directory (default: reports/check/<timestamp>)")
    parser.add_argument(
        "--from",
        dest="from_dir",
        metavar="RUN_DIR",
        help="render the report of a check already run (its results.parquet, run.json); no GPU needed",
    )
    parser.add_argument("--no-boundary", action="store_true", help="skip the fits-boundary bisections")


def main(args: argparse.Namespace) -> int:
    from fsdpbench.pipeline.runner import default_run_dir

    out = Path(args.out) if args.out else default_run_dir("check")
    if args.from_dir:
        from fsdpbench.store.results import ResultsFileError, RunStore, load_results

        try:
            rows = load_results(args.from_dir)
            env = RunStore(Path(args.from_dir)).read_run_json().get("env", {})
            boundaries = _read_boundaries(Path(args.from_dir))
        except (ResultsFileError, OSError, ValueError) as exc:
            print(f"error: --from {args.from_dir}: {exc}", file=sys.stderr)
            return 2
        return write_report(check_records(rows), env, boundaries, out)
    from fsdpbench.store.env import cuda_status

    ok, why = cuda_status()
    if not ok:
        print(f"{NVML_NEEDS_GPU}: {why}", file=sys.stderr)
        return 2
    return _run_check(out, boundary=not args.no_boundary)


# ---- the grid -----------------------------------------------------------------------------------------
def grid_entries(*, transformers: bool) -> list[dict[str, Any]]:
    """Each case's fields beyond the grid's defaults: every strategy that declares ``checked_on_gpu`` in
    bf16 (a shard group of 4 where it has one); the replicated reference in fp32; the fully sharded one
    in fp32, with activation checkpointing (bf16, fp32), with expandable segments, without the profiler,
    and as one real rank; a Hugging Face model."""
    from fsdpbench.predictors.memory_model import resolve_shard_size
    from fsdpbench.strategies import get_strategy, strategy_names

    entries: list[dict[str, Any]] = []
    for name in strategy_names():
        strategy = get_strategy(name)
        if strategy.checked_on_gpu:
            probe = Case(strategy=name, world_size=EMULATED_WORLD_SIZE, shard_size=SHARD_GROUP)
            grouped = resolve_shard_size(probe, strategy.sharding) is not None
            entries.append({"strategy": name, **({"shard_size": SHARD_GROUP} if grouped else {})})
    full = {"strategy": FULL_SHARD_STRATEGY}
    entries += [
        {"strategy": REFERENCE_STRATEGY, "precision": "fp32"},
        {**full, "precision": "fp32"},
        {**full, "activation_checkpointing": True},
        {**full, "precision": "fp32", "activation_checkpointing": True},
        {**full, "alloc_conf": EXPANDABLE},
        {**full, "profile_steps": 0},
        {**full, "world_size": 1, "emulate": False},
    ]
    if transformers:
        entries.append({**full, **HF_MODEL})
    return entries


def grid_text(*, transformers: bool, model: str = CHECK_MODEL) -> str:
    """The grid as a scenario (validated and expanded by the scenario parser, as ``run`` does)."""
    cases = grid_entries(transformers=transformers)
    defaults = {
        "model": model,
        "batch_size": 8,
        "seq_len": 1024,
        "optimizer": "adamw",
        "precision": "bf16",
        "wrap": "block",
        "warmup_steps": 2,
        "steps": 3,
        "device": "cuda",
        "backend": "nccl",
        "world_size": EMULATED_WORLD_SIZE,
        "emulate": True,
        "timeout_s": 240,
    }
    return json.dumps(
        {
            "name": "check",
            "description": "fsdpbench check: every strategy family measured and predicted on this GPU",
            "defaults": defaults,
            "cases": cases,
        }
    )


def case_label(case: Any) -> str:
    """What a grid case is, in words: its strategy and precision and whatever else sets it apart."""
    words = [case.strategy, case.precision]
    if case.model != CHECK_MODEL:
        words.insert(0, case.model)
    if case.activation_checkpointing:
        words.append("AC")
    if case.alloc_conf == EXPANDABLE:
        words.append("expandable")
    if not case.profile_steps:
        words.append("no profiler")
    if not case.emulate:
        words.append(f"{case.world_size} real rank")
    return " ".join(words)


def grid_cases(*, transformers: bool, model: str = CHECK_MODEL) -> list[Any]:
    """Every case of the grid, those this machine would skip (no GPU here) included."""
    from fsdpbench.pipeline.scenario import parse_scenario

    text = grid_text(transformers=transformers, model=model)
    scenario = parse_scenario(text, source="fsdpbench check")
    return [*scenario.cases, *(s.case for s in scenario.skipped)]


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ---- predictions beside measurements ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CheckRecord:
    """One case: what each layer measured, and what each method predicted for it (bytes)."""

    label: str
    case_id: str
    status: str
    measured: dict[str, int | None]
    predicted: dict[str, dict[str, int | None]]  # method -> layer -> bytes
    retries: int | None

    def error(self, method: str, layer: str) -> float | None:
        m, p = self.measured.get(layer), self.predicted.get(method, {}).get(layer)
        return None if not m or p is None else p / m - 1

    def to_json(self) -> dict[str, Any]:
        errors = {f"{m}.{la}": self.error(m, la) for m in METHODS for la in LAYERS}
        return {
            "label": self.label,
            "case_id": self.case_id,
            schema.STATUS: self.status,
            "measured": self.measured,
            "predicted": self.predicted,
            "errors": errors,
            "alloc_retries": self.retries,
        }


def analytic_layers(case: Any) -> dict[str, int | None]:
    """The analytic method, layer by layer: its tracked peak, its schedule's stream replayed, NVML's
    terms for one of fsdpbench's ranks (None where the model has no activation model)."""
    from fsdpbench.predictors.consistency import analytic_stream
    from fsdpbench.predictors.device_fit import DeviceModel
    from fsdpbench.predictors.memory_model import predict_memory

    pred = predict_memory(case)
    if pred.peak_breakdown.get("activations") is None or not pred.peak_bytes:
        return dict.fromkeys(LAYERS)
    model = DeviceModel.for_case(case, fsdpbench_run=True)
    memory = model.replayed(case, analytic_stream(case), pred.peak_bytes)
    return {
        "tracker": pred.peak_bytes,
        "allocated": memory.allocated_peak,
        "reserved": memory.reserved_peak,
        "nvml": memory.nvml_peak,
    }


def check_records(rows: Any) -> list[CheckRecord]:
    """Rank 0 of each case of a check run: measured beside predicted."""
    out = []
    for _, row in rows[rows[schema.RANK] == 0].iterrows():
        case = schema.case_from_columns(row)
        try:
            analytic = analytic_layers(case)
        except Exception:  # noqa: BLE001 — a model the analytic method cannot answer: no figures
            analytic = dict.fromkeys(LAYERS)
        out.append(
            CheckRecord(
                label=case_label(case),
                case_id=str(row[schema.CASE_ID]),
                status=str(row[schema.STATUS]),
                measured={layer: _int(row.get(col)) for layer, col in MEASURED.items()},
                predicted={
                    "analytic": analytic,
                    "traced": {layer: _int(row.get(col)) for layer, col in TRACED.items()},
                },
                retries=_int(row.get(schema.ALLOC_RETRIES)),
            )
        )
    return out


def _int(value: Any) -> int | None:
    try:
        return None if value is None or value != value else int(value)
    except (TypeError, ValueError):
        return None


# ---- calibration --------------------------------------------------------------------------------------
def calibration_from(records: list[CheckRecord], env: dict[str, Any]) -> Any:
    """This machine's NVML terms from the grid's cases that differ in one thing each: fp32 (no cuDNN)
    and bf16, with and without the profiler, emulated and one real NCCL rank. The samplers cannot be
    measured apart from NVML's own sampler: the reference's 0 stays."""
    from fsdpbench.predictors.memory_model.nvml import REFERENCE_H100, Calibration

    over = {r.label: _over_reserved(r) for r in records}
    fp32, bf16 = over.get("zero3 fp32"), over.get("zero3 bf16")
    unprofiled, nccl = over.get("zero3 bf16 no profiler"), over.get("zero3 bf16 1 real rank")
    if fp32 is None or bf16 is None or unprofiled is None:
        raise ValueError("the grid's zero3 fp32/bf16 and unprofiled cases are needed for a calibration")
    profiler = max(0, bf16 - unprofiled)
    context = max(0, fp32 - profiler)
    cudnn = max(0, bf16 - profiler - context)
    library = max(0, nccl - bf16) if nccl is not None else REFERENCE_H100.nccl_library_bytes
    gpus = ", ".join(env.get("gpus", [])) or "?"
    return Calibration(
        cuda_context_bytes=context,
        cudnn_bytes=cudnn,
        nccl_library_bytes=library,
        profiler_bytes=profiler,
        samplers_bytes=REFERENCE_H100.samplers_bytes,
        source=f"measured by fsdpbench check on {gpus} ({env.get('nvml_reason', '')}, torch "
        f"{env.get(schema.TORCH_VERSION, '?')}, {env.get('cuda_reason', '')})",
    )


def _over_reserved(r: CheckRecord) -> int | None:
    nvml, reserved = r.measured.get("nvml"), r.measured.get("reserved")
    return None if nvml is None or reserved is None or r.status != schema.OK else nvml - reserved


# ---- the fits boundary --------------------------------------------------------------------------------
def predicted_boundary_bytes(case: Any, *, stream: Any = None, resolution: int = 2 << 20) -> int:
    """The smallest allocator limit (bytes, within ``resolution``) under which the allocator model runs
    the step without an out-of-memory error, as under ``set_per_process_memory_fraction``; ``stream``:
    the case's traced allocation stream when a run stored it (else it is traced here)."""
    from fsdpbench.predictors.device_fit import DeviceModel

    model = DeviceModel.for_case(case)
    if stream is None:
        stream, _ = model.stream(case)
    free = stream.replay(model.conf, runtime=model.runtime)
    lo, hi = free.peak_allocated - 1, free.peak_reserved  # lo fails (below the live bytes), hi fits
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        stats = stream.replay(model.conf, runtime=model.runtime, limit=mid, fraction_set=True)
        lo, hi = (lo, mid) if stats.oom is None else (mid, hi)
    return hi


def measured_boundary_fraction(case: Any, lo: float, hi: float, probe: Any, probes: int) -> float:
    """Bisect ``memory_fraction`` between ``lo`` (assumed to fail) and ``hi`` (to fit): ``probe(case)``
    runs a case in fresh processes and says whether its steps ran. The smallest fraction seen to fit."""
    for _ in range(probes):
        mid = (lo + hi) / 2
        fits = probe(case.replace(memory_fraction=round(mid, 6)))
        lo, hi = (lo, mid) if fits else (mid, hi)
    return hi


def _read_boundaries(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "boundaries.json"
    if not path.exists():
        return []
    data = read_json(path, MAX_BOUNDARIES_BYTES, what="boundaries file", follow_links=False)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    BOUNDARIES.check(path, data.get(FORMAT_VERSION))
    boundaries = data.get("boundaries")
    if not isinstance(boundaries, list):
        raise ValueError(f"{path}: boundaries: expected a list")
    return boundaries


def _write_boundaries(out: Path, boundaries: list[dict[str, Any]]) -> None:
    _write_json(out / "boundaries.json", BOUNDARIES.stamped({"boundaries": boundaries}))


def _write_json(path: Path, obj: Any) -> None:
    write_atomically(path, (json.dumps(obj, indent=1) + "\n").encode())


# ---- the report ---------------------------------------------------------------------------------------
def environment(env: dict[str, Any]) -> dict[str, str]:
    return {
        "GPU": ", ".join(env.get("gpus", [])) or "none",
        "driver": str(env.get("nvml_reason", "")),
        "torch": str(env.get(schema.TORCH_VERSION, "")),
        "CUDA": str(env.get("cuda_reason", "")),
        "fsdpbench": str(env.get(schema.COMMIT, "")),
    }


def table_rows(records: list[CheckRecord]) -> list[list[str]]:
    """Per case: measured tracker/allocated/reserved/NVML, then each method's error per layer."""
    from fsdpbench.core.formatting import fmt_bytes

    out = []
    for r in records:
        cells = [r.label, r.status]
        cells += [fmt_bytes(r.measured[la]) if r.measured.get(la) else "—" for la in LAYERS]
        for method in METHODS:
            for layer in LAYERS:
                e = r.error(method, layer)
                cells.append("—" if e is None else f"{e:+.1%}")
        out.append(cells)
    return out


def table_header() -> list[str]:
    return [
        "case",
        schema.STATUS,
        *(f"{la} (measured)" for la in LAYERS),
        *(f"{la}: {m}" for m in METHODS for la in LAYERS),
    ]


def write_report(
    records: list[CheckRecord], env: dict[str, Any], boundaries: list[dict[str, Any]], out: Path
) -> int:
    from rich.console import Console
    from rich.table import Table

    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=200) if not sys.stdout.isatty() else Console()
    table = Table(title="fsdpbench check: prediction error per layer (predicted / measured − 1)")
    for name in table_header():
        table.add_column(name, justify="left" if name in ("case", schema.STATUS) else "right")
    for cells in table_rows(records):
        table.add_row(*(escape(c) for c in cells))
    console.print(table)
    for key, value in environment(env).items():
        console.print(escape(f"{key}: {value}"), highlight=False)
    for b in boundaries:
        console.print(escape(_boundary_line(b)), highlight=False)
    report: dict[str, Any] = {
        "environment": environment(env),
        "cases": [r.to_json() for r in records],
        "boundaries": boundaries,
    }
    try:
        calibration = calibration_from(records, env)
    except ValueError as exc:
        console.print(escape(f"no calibration: {exc}"), highlight=False)
    else:
        report["calibration"] = calibration.to_json()
        _write_json(out / "calibration.json", calibration.to_json())
        console.print(
            escape(f"calibration: {out / 'calibration.json'} (predict --calibration)"), highlight=False
        )
    _write_json(out / "check.json", report)
    write_atomically(out / "check.html", render_html(records, env, boundaries).encode())
    console.print(escape(f"report: {out / 'check.html'}, {out / 'check.json'}"), highlight=False)
    return 0 if all(r.status == schema.OK for r in records) else 1


def _boundary_line(b: dict[str, Any]) -> str:
    measured, predicted = b.get("measured_fraction"), b.get("predicted_fraction")
    err = f" ({predicted / measured - 1:+.1%})" if measured and predicted else ""
    return f"fits boundary, {b['label']}: measured {measured}, predicted {predicted}{err} of the GPU's memory"


def render_html(records: list[CheckRecord], env: dict[str, Any], boundaries: list[dict[str, Any]]) -> str:
    """A self-contained page: the environment, the error table, the fits boundaries."""

    def row(cells: list[str], tag: str = "td") -> str:
        return "<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>"

    env_rows = "".join(row([k, v]) for k, v in environment(env).items())
    body = "".join(row(cells) for cells in table_rows(records))
    bounds = "".join(f"<li>{html.escape(_boundary_line(b))}</li>" for b in boundaries)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>fsdpbench check</title>"
        "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:right}"
        "td:first-child{text-align:left}</style></head><body>"
        "<h1>fsdpbench check</h1><h2>Environment</h2><table>" + env_rows + "</table>"
        "<h2>Prediction error per layer</h2><p>predicted / measured − 1; rank 0 of each case "
        "(emulated ranks of 8-rank jobs, and one real rank)</p><table>"
        + row(table_header(), "th")
        + body
        + "</table><h2>Fits boundary</h2><ul>"
        + (bounds or "<li>not measured</li>")
        + "</ul></body></html>\n"
    )


# ---- running it on the GPU ----------------------------------------------------------------------------
def _run_check(out: Path, *, boundary: bool) -> int:  # pragma: no cover — needs a GPU
    from fsdpbench.commands import running
    from fsdpbench.pipeline.interrupts import signals_as_interrupts
    from fsdpbench.pipeline.runner import now_iso, run_cases
    from fsdpbench.pipeline.scenario import parse_scenario
    from fsdpbench.store.results import RunStore

    text = grid_text(transformers=installed("transformers"))
    scenario = parse_scenario(text, source="fsdpbench check")
    store = RunStore(out)
    meta = running.run_header(scenario, path=None, text=text, overrides={}, started=now_iso())
    with signals_as_interrupts():
        rows = run_cases(scenario.cases, scenario.skipped, store, meta, traced=True)
    records = check_records(rows)
    boundaries = _measure_boundaries(scenario.cases, records, out) if boundary else []
    _write_boundaries(out, boundaries)
    return write_report(records, meta["env"], boundaries, out)


def _measure_boundaries(cases: list[Any], records: list[CheckRecord], out: Path) -> list[dict[str, Any]]:
    from fsdpbench.metrics.nvml import device_total_bytes
    from fsdpbench.predictors.memory_model.alloc_stream import AllocStream, stream_file
    from fsdpbench.store.results import RunStore

    total = device_total_bytes(0)
    by_label = {case_label(c): c for c in cases}
    results = []
    for label in BOUNDARY_LABELS:
        record = next((r for r in records if r.label == label and r.status == schema.OK), None)
        if record is None or label not in by_label:
            continue
        case = by_label[label].replace(memory_steps=0, profile_steps=0)
        allocated, reserved = record.measured["allocated"] or 0, record.measured["reserved"] or 0
        probe = _Probe(out / "boundary" / label.replace(" ", "_"))
        measured = measured_boundary_fraction(
            case, allocated / total * 0.98, reserved / total * 1.02, probe, BOUNDARY_PROBES
        )
        # the stream the run's tracing process stored: no trace (and no CUDA context) in this process
        stored = RunStore(out).case_dir(record.case_id) / stream_file(0)
        stream = AllocStream.read(stored) if stored.exists() else None
        predicted = predicted_boundary_bytes(case, stream=stream) / total
        results.append(
            {
                "label": label,
                "measured_fraction": round(measured, 5),
                "predicted_fraction": round(predicted, 5),
            }
        )
    return results


class _Probe:
    """Runs one case in fresh rank processes (its own run directory); whether its steps ran."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.n = 0

    def __call__(self, case: Any) -> bool:  # pragma: no cover — needs a GPU
        from fsdpbench.pipeline.runner import now_iso, run_cases
        from fsdpbench.store.env import collect_env
        from fsdpbench.store.results import RunStore

        self.n += 1
        store = RunStore(self.directory / f"probe{self.n}")
        meta = {"env": collect_env(), "started": now_iso(), "scenario": {"name": "check: fits boundary"}}
        rows = run_cases([case], [], store, meta)
        return bool((rows[schema.STATUS] == schema.OK).all())
