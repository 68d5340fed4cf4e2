"""``fsdpbench check`` without a GPU: its one line on a CPU-only machine, its grid built and predicted on
CUDA targets (CUDA's rules on a CPU-only build), its report rendered from measurements recorded on the
reference H100 (tests/data/gpu_h100_fsdpbench_runs.json), its calibration file read by ``predict``, and
its fits-boundary bisection on a stand-in probe."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from fsdpbench.cli import main
from fsdpbench.commands import check
from fsdpbench.core import schema
from fsdpbench.core.case import Case
from fsdpbench.core.formats import BOUNDARIES, CALIBRATION, FORMAT_VERSION
from fsdpbench.predictors.consistency import layer_figures, violations
from fsdpbench.predictors.device_fit import TRACED_MAX_BATCH
from fsdpbench.predictors.memory_model.nvml import REFERENCE_H100, Calibration
from tests.gpu_reference_rows import DATA


def run_cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return int(exc.value.code or 0)


def test_without_a_gpu_it_says_so_in_one_line(monkeypatch, capsys):
    import fsdpbench.store.env

    why = "torch 2.13.0+cpu is a CPU-only build"
    monkeypatch.setattr(fsdpbench.store.env, "cuda_status", lambda: (False, why))
    assert run_cli(["check"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "fsdpbench check needs a CUDA GPU: torch 2.13.0+cpu is a CPU-only build\n"
    assert captured.out == ""


def test_the_grid_covers_every_family_and_what_the_calibration_reads():
    cases = check.grid_cases(transformers=True)
    labels = [check.case_label(c) for c in cases]
    assert len(set(labels)) == len(labels)
    assert {c.strategy for c in cases} == {
        "ddp", "zero1", "zero2", "zero3", "hsdp", "fsdp1_full", "ds_zero2", "ds_zero3",
    }  # fmt: skip
    assert {c.precision for c in cases} == {"fp32", "bf16"}
    assert any(c.activation_checkpointing for c in cases)
    assert any(c.alloc_conf == check.EXPANDABLE for c in cases)
    assert any(c.model.startswith("hf-") for c in cases)
    real = [c for c in cases if not c.emulate]
    assert [(c.world_size, c.backend) for c in real] == [(1, "nccl")]
    assert all(c.world_size == check.EMULATED_WORLD_SIZE for c in cases if c.emulate)
    assert {"zero3 fp32", "zero3 bf16", "zero3 bf16 no profiler", "zero3 bf16 1 real rank"} <= set(labels)
    assert set(check.BOUNDARY_LABELS) <= set(labels)
    without = check.grid_cases(transformers=False)
    assert not any(c.model.startswith("hf-") for c in without)


def test_the_grid_is_predicted_by_every_method_and_its_layers_nest():
    """The grid's cases at a small size (decoder-tiny) on CUDA targets: the analytic and the traced
    method answer each (DeepSpeed: analytic only; the trace needs its launcher) and nothing breaks
    tracked ≤ allocated ≤ reserved ≤ NVML."""
    found = []
    for case in check.grid_cases(transformers=False, model="decoder-tiny"):
        case = case.replace(batch_size=2, seq_len=128)
        analytic = check.analytic_layers(case)
        assert all(analytic[layer] for layer in check.LAYERS), check.case_label(case)
        found += violations(layer_figures(case, "analytic"))
        if not case.strategy.startswith("ds_"):  # not traceable (tests/test_layer_consistency.py)
            found += violations(layer_figures(case, "traced"))
    assert found == []


def recorded_run(tmp_path):
    """A check-like run directory of the reference H100's recorded rows (rank 0, measured and traced)."""
    data = json.loads(DATA.read_text())
    rows = []
    for r in data["rows"]:
        case = Case.from_dict(r["case"])
        rows.append(
            {
                **schema.case_to_columns(case),
                schema.RANK: 0,
                schema.STATUS: schema.OK,
                **r["measured"],
                **r["traced"],
            }
        )
    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame(rows).to_parquet(run / "results.parquet")
    env = json.loads(
        json.dumps(
            {
                "gpus": ["NVIDIA H100 80GB HBM3"],
                "nvml_reason": "NVML sees 1 device(s), driver 580.159.04",
                schema.TORCH_VERSION: "2.11.0+cu130",
                "cuda_reason": "1 GPU(s), CUDA 13.0",
            }
        )
    )
    (run / "run.json").write_text(json.dumps({"env": env, "cases": {}}))
    boundaries = [{"label": "zero3 bf16", "measured_fraction": 0.1, "predicted_fraction": 0.101}]
    (run / "boundaries.json").write_text(json.dumps(BOUNDARIES.stamped({"boundaries": boundaries})))
    return run


def test_the_report_from_recorded_measurements(tmp_path, capsys):
    run = recorded_run(tmp_path)
    out = tmp_path / "out"
    assert run_cli(["check", "--from", str(run), "--out", str(out)]) == 0
    report = json.loads((out / "check.json").read_text())
    assert report["environment"]["GPU"] == "NVIDIA H100 80GB HBM3"
    assert report["environment"]["torch"] == "2.11.0+cu130"
    by_label = {c["label"]: c for c in report["cases"] if c["case_id"].endswith("emulated_a28fbf")}
    assert set(by_label) == {"ddp bf16"}
    cases = {(c["label"], c["case_id"]): c for c in report["cases"]}
    assert len(cases) == 11
    for c in report["cases"]:
        if c["label"] in ("ddp bf16", "zero1 bf16") and "emulated" in c["case_id"]:
            assert abs(c["errors"]["traced.allocated"]) < 0.02
            assert abs(c["errors"]["traced.reserved"]) < 0.05
        for layer in check.LAYERS:
            assert c["measured"][layer] > 0
    page = (out / "check.html").read_text()
    assert "NVIDIA H100 80GB HBM3" in page and "ddp bf16" in page and "fits boundary" in page.lower()
    text = capsys.readouterr().out
    assert (
        "prediction error per layer" in text and "zero3 bf16: measured 0.1, predicted 0.101 (+1.0%)" in text
    )
    # the reference runs have no unprofiled case: no calibration is claimed from them
    assert "calibration" not in report and not (out / "calibration.json").exists()


def test_a_boundaries_file_without_its_format_version_is_refused_in_one_line(tmp_path, capsys):
    run = recorded_run(tmp_path)
    (run / "boundaries.json").write_text(json.dumps([{"label": "zero3 bf16", "measured_fraction": 0.1}]))
    assert run_cli(["check", "--from", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "boundaries.json" in err


def record(label: str, reserved: int, nvml: int) -> check.CheckRecord:
    measured = {"tracker": 1, "allocated": 1, "reserved": reserved, "nvml": nvml}
    return check.CheckRecord(label, label, schema.OK, measured, {}, 0)


def test_the_calibration_takes_each_term_from_the_cases_that_differ_by_it():
    gib = 1 << 30
    records = [
        record("zero3 fp32", 10 * gib, 10 * gib + 1_300_000_000),  # context + profiler
        record("zero3 bf16", 8 * gib, 8 * gib + 1_320_000_000),  # + cuDNN
        record("zero3 bf16 no profiler", 8 * gib, 8 * gib + 1_310_000_000),
        record("zero3 bf16 1 real rank", 8 * gib, 8 * gib + 1_900_000_000),  # + NCCL
    ]
    cal = check.calibration_from(records, {"gpus": ["X"]})
    assert (cal.profiler_bytes, cal.cuda_context_bytes, cal.cudnn_bytes, cal.nccl_library_bytes) == (
        10_000_000,
        1_290_000_000,
        20_000_000,
        580_000_000,
    )
    assert cal.samplers_bytes == REFERENCE_H100.samplers_bytes
    assert "fsdpbench check on X" in cal.source


def test_predict_takes_the_calibration(tmp_path, capsys):
    cal = Calibration(1_000_000_000, 0, 123_000_000, 0, 0, "test")
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(cal.to_json()))
    argv = ["predict", "--model", "decoder-tiny", "--world-size", "2", "--strategy", "zero3"]
    argv += ["--device", "cuda", "--batch-size", "2", "--seq-len", "64", "--device-memory", "80GiB"]
    assert run_cli([*argv, "--calibration", str(path), "--json"]) == 0
    answer = next(r for r in json.loads(capsys.readouterr().out) if "nvml_terms_bytes" in r)
    assert answer["nvml_terms_bytes"]["cuda_context"] == 1_000_000_000
    assert answer["nvml_terms_bytes"]["nccl_library"] == 123_000_000
    assert answer["nvml_peak_bytes"] == answer["reserved_peak_bytes"] + sum(
        answer["nvml_terms_bytes"].values()
    )
    # decoder-tiny fits batches far past the search's limit, which the search traces and stops at
    assert answer["largest_batch"] == answer["largest_batch_limit"] == TRACED_MAX_BATCH
    assert json.loads(path.read_text())[FORMAT_VERSION] == CALIBRATION.version
    bad = dict(cal.to_json(), cudnn_bytes=-1)
    path.write_text(json.dumps(bad))
    assert run_cli([*argv, "--calibration", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and "cudnn_bytes" in err
    path.write_text(json.dumps({k: v for k, v in cal.to_json().items() if k != FORMAT_VERSION}))
    assert run_cli([*argv, "--calibration", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and FORMAT_VERSION in err


def test_the_measured_boundary_bisects_fresh_probes():
    asked = []

    def probe(case: Case) -> bool:
        asked.append(case.memory_fraction)
        return case.memory_fraction >= 0.4

    base = Case(model="decoder-tiny", strategy="zero3", device="cuda", backend="nccl")
    found = check.measured_boundary_fraction(base, 0.3, 0.5, probe, 6)
    assert 0.4 <= found < 0.4 + 0.2 / 2**6 and len(asked) == 6 and len(set(asked)) == 6


def test_the_predicted_boundary_is_where_the_allocator_model_stops_running_out():
    from fsdpbench.predictors.device_fit import DeviceModel

    case = Case(
        model="decoder-tiny",
        strategy="ddp",
        world_size=2,
        batch_size=2,
        seq_len=128,
        device="cuda",
        backend="nccl",
    )
    limit = check.predicted_boundary_bytes(case, resolution=1 << 20)
    model = DeviceModel.for_case(case)
    stream, _ = model.stream(case)
    free = stream.replay()
    assert free.peak_allocated <= limit <= free.peak_reserved
    assert stream.replay(limit=limit, fraction_set=True).oom is None
    assert stream.replay(limit=limit - (1 << 20), fraction_set=True).oom is not None
