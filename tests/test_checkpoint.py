"""The checkpoint phase (fsdpbench/engine/checkpoint.py) and its prediction (predictors/checkpoint.py,
predictors/torch_save_format.py): bytes pinned exactly against real saves of tiny models, round trips,
validation, and nothing written outside the run directory."""

from __future__ import annotations

import importlib.util
import io
import os
from pathlib import Path

import pytest
import torch

from fsdpbench.core import schema
from fsdpbench.core.case import Case
from fsdpbench.pipeline.scenario import ScenarioError, parse_scenario
from fsdpbench.predictors import torch_save_format as fmt
from fsdpbench.predictors.checkpoint import predict_checkpoint
from fsdpbench.strategies import get_strategy
from tests.helpers import CPU, run_with_predictions


def _saved_bytes(obj: object, path: Path | None = None) -> int:
    if path is not None:
        torch.save(obj, path)
        return path.stat().st_size
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return len(buffer.getvalue())


@pytest.mark.parametrize(
    "dtype, shape",
    [("float32", (10, 3)), ("float32", ()), ("bfloat16", (7,)), ("int64", (300, 2)), ("float32", (70, 1000))],
)
def test_one_tensor_archive_is_predicted_to_the_byte(dtype: str, shape: tuple[int, ...]) -> None:
    real = torch.zeros(shape, dtype=getattr(torch, dtype))
    assert fmt.torch_save_bytes(fmt.Tensor(dtype, shape)) == _saved_bytes(real)


def test_a_state_dict_like_archive_in_a_named_file_is_predicted_to_the_byte(tmp_path: Path) -> None:
    # nested dicts, a scalar step, a list of floats, tuples, None and booleans; the records carry the stem
    real = {
        "model": {f"layer{i}.weight": torch.zeros(33, 17) for i in range(12)},
        "optim": {
            "state": {"a": {"step": torch.tensor(3.0), "exp_avg": torch.zeros(5)}},
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "fused": None, "amsgrad": False}],
        },
    }
    stand_in = {
        "model": {f"layer{i}.weight": fmt.Tensor("float32", (33, 17)) for i in range(12)},
        "optim": {
            "state": {"a": {"step": fmt.Tensor("float32", ()), "exp_avg": fmt.Tensor("float32", (5,))}},
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "fused": None, "amsgrad": False}],
        },
    }
    assert fmt.torch_save_bytes(stand_in, "ckpt") == _saved_bytes(real, tmp_path / "ckpt.pt")


def test_a_storage_larger_than_its_view_is_written_whole() -> None:
    base = torch.zeros(12, 4)
    stand_in = fmt.Tensor("float32", (9, 4), fmt.Storage("float32", 48))
    assert fmt.torch_save_bytes(stand_in) == _saved_bytes(base[:9])


def test_zip_framing_aligns_every_record_to_64_bytes() -> None:
    # one 1-byte record: header 30 + name 1 + "FB" 4, padded to 64; data 1; descriptor 16; central 46+1
    assert fmt.zip_bytes([("a", 1)]) == 64 + 1 + 16 + 47 + fmt.END_RECORDS


NO_DEEPSPEED = 'DeepSpeed not installed (optional extra: DS_BUILD_OPS=0 pip install -e ".[deepspeed]")'
CKPT_TINY = dict(
    model="mlp",
    model_args={"width": 64, "depth": 2},
    warmup_steps=1,
    steps=1,
    memory_steps=1,
    profile_steps=0,
    batch_size=2,
    timeout_s=120,
    **CPU,
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, method",
    [
        ("zero3", "dcp"),
        ("zero3", "dcp_async"),
        ("ddp", "dcp"),
        ("ddp", "full"),
        ("fsdp1_full", "full"),
        ("zero1", "full"),
    ],
)
def test_round_trip_and_bytes_on_disk(strategy: str, method: str, tmp_path: Path) -> None:
    case = Case(**CKPT_TINY, strategy=strategy, world_size=2, checkpoint=method, keep_checkpoints=True)
    rows = run_with_predictions(case, tmp_path).sort_values("rank")
    assert rows[schema.CHECKPOINT_COLUMNS["state_equal"]].tolist() == [True, True]
    assert rows[schema.CHECKPOINT_COLUMNS["loss_equal"]].tolist() == [True, True]
    directory = tmp_path / case.case_id / "checkpoint"
    preds = predict_checkpoint(case, get_strategy(strategy))
    if method.startswith("dcp"):
        # every rank's .distcp file to the byte; rank 0 also writes DCP's .metadata, modelled but for
        # which strings the real pickle shares (identity) and the run directory's path
        metadata = (directory / ".metadata").stat().st_size
        distcp = [(directory / f"__{rank}_0.distcp").stat().st_size for rank in range(2)]
        assert distcp[1] == preds[1].bytes
        assert 0 <= preds[0].bytes - distcp[0] - metadata + len(os.fspath(tmp_path)) < 2048
        assert rows[schema.CKPT_BYTES].tolist() == [distcp[0] + metadata, distcp[1]]
    else:
        # the state dict's own structure (the modules' _metadata, FSDP1's wrapped names) is pickled
        # approximately: the tensors and the zip framing exactly, the rest within 2 KiB
        measured = (directory / "full.pt").stat().st_size
        assert 0 <= measured - preds[0].bytes < 2048
        assert preds[0].payload_bytes == sum(
            t.nbytes for t in _tensors(torch.load(directory / "full.pt", weights_only=True))
        )
        assert rows[schema.CKPT_BYTES].tolist() == [measured, 0]
        assert abs(rows[schema.PRED_CKPT_BYTES_ERR].iloc[0]) < 0.01
    if strategy == "ddp" and method == "full":
        # the state dict's tensors are the parameters: nothing new on any rank (the save once imported
        # torch.distributed.optim, 4.7 MB of a rank's memory, before the baseline knew it)
        assert rows[schema.CKPT_SAVE_HOST_PEAK].max() < 2**20


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, method",
    [
        ("zero3", "dcp"),
        pytest.param(
            "ds_zero2",
            "native",
            marks=pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason=NO_DEEPSPEED),
        ),
    ],
)
def test_nothing_is_written_outside_the_case_directory(
    strategy: str, method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd, tmp, home = tmp_path / "cwd", tmp_path / "tmp", tmp_path / "home"
    for d in (cwd, tmp, home):
        d.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("HOME", str(home))
    case = Case(**CKPT_TINY, strategy=strategy, world_size=2, checkpoint=method)
    run_with_predictions(case, tmp_path / "run")
    assert [p for d in (cwd, home) for p in d.rglob("*")] == []
    leftovers = [p for p in tmp.rglob("*") if p.is_file()]
    assert leftovers == [], leftovers
    case_dir = tmp_path / "run" / case.case_id
    assert not (case_dir / "checkpoint").exists()  # removed once measured (keep_checkpoints: false)


SCENARIO = """
name: ck
defaults: {model: mlp, world_size: 2, device: cpu}
sweep:
  strategy: [ddp, zero1, zero3]
  checkpoint: [full, sharded]
"""


def test_a_strategy_declares_its_methods_and_the_rest_are_skipped_with_the_reason() -> None:
    scenario = parse_scenario(SCENARIO)
    ran = {(c.strategy, c.checkpoint) for c in scenario.cases}
    assert ran == {("ddp", "full"), ("zero1", "full"), ("zero3", "full"), ("zero3", "sharded")}
    reasons = {(s.case.strategy, s.case.checkpoint): s.reason for s in scenario.skipped}
    assert reasons[("ddp", "sharded")] == "checkpoint=sharded: ddp checkpoints with full, dcp, dcp_async"
    assert reasons[("zero1", "sharded")] == "checkpoint=sharded: zero1 checkpoints with full"


def test_a_case_over_the_size_limit_is_refused_before_it_runs() -> None:
    scenario = parse_scenario(SCENARIO.replace("device: cpu}", "device: cpu, checkpoint_max_bytes: 1000}"))
    assert not scenario.cases
    reason = {s.case.strategy: s.reason for s in scenario.skipped if s.case.checkpoint == "full"}["zero3"]
    total = sum(p.bytes for p in predict_checkpoint(scenario.skipped[0].case, get_strategy("ddp")))
    assert reason == (
        f"checkpoint=full would write {total:,} bytes (predicted), over checkpoint_max_bytes=1,000; "
        "raise it to run this case"
    )


def test_an_unknown_method_is_one_line_naming_the_field() -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario(SCENARIO.replace("[full, sharded]", "[full, zip]"), source="s.yaml")
    message = str(err.value)
    assert message.startswith("s.yaml: sweep.checkpoint[1]: ") and "\n" not in message
    assert "'full'" in message and "'dcp_async'" in message


def test_the_case_id_names_the_method_and_keeps_old_ids() -> None:
    assert Case().case_id == Case(keep_checkpoints=True, checkpoint_max_bytes=5).case_id
    assert "_ckpt-dcp_" in Case(checkpoint="dcp").case_id
    assert "_ckpt-full-model_" in Case(checkpoint="full", checkpoint_optimizer=False).case_id


def test_full_state_dict_host_peak_is_the_whole_state_on_rank_0_only_when_sharded() -> None:
    case = Case(model="mlp", world_size=4, checkpoint="full")
    zero3 = predict_checkpoint(case, get_strategy("zero3"))
    ddp = predict_checkpoint(case.replace(strategy="ddp"), get_strategy("ddp"))
    psi = 4 * (256 * 256 + 256) + 10 * 256 + 10
    largest = 256 * 256 * 4
    # AdamW: params + exp_avg + exp_avg_sq in fp32, and a 4-byte step per parameter tensor
    payload = 3 * 4 * psi + 4 * 10
    # FSDP2's full_tensor of head (10 rows over 4 ranks) views its padded all-gather output: 12 rows
    # are held and written, for the weight, its exp_avg and exp_avg_sq (and the bias likewise)
    padding = 3 * 2 * (256 + 1) * 4
    assert ddp[0].payload_bytes == payload and zero3[0].payload_bytes == payload + padding
    assert zero3[0].save_host_peak_bytes == payload + padding + largest
    # the other ranks hold the tensor being gathered and gloo's receive buffer, nothing more
    assert [p.save_host_peak_bytes for p in zero3[1:]] == [2 * largest] * 3
    assert [p.save_host_peak_bytes for p in ddp] == [0] * 4  # on a CPU rank its entries are the tensors
    assert os.fspath(case.case_id)


def test_fsdp1_host_peak_is_its_state_plus_one_gathered_flat_unit_gloo_receive_and_shard() -> None:
    # mlp 256x4, wrap=block: the largest unit is a block's FlatParameter, 256*256 + 256 elements (every
    # parameter 16-byte aligned already), a multiple of 2 ranks: no padding
    case = Case(model="mlp", world_size=2, checkpoint="full", strategy="fsdp1_full", optimizer="adamw")
    psi = 4 * (256 * 256 + 256) + 10 * 256 + 10
    flat = (256 * 256 + 256) * 4
    payload = 3 * 4 * psi + 4 * 10  # AdamW: param, exp_avg, exp_avg_sq in fp32 + a 4-byte step each
    # the state dict's pre-hook first frees this rank's sharded flat gradients (zero_grad(set_to_none)
    # leaves them): 4 blocks' flats of 256*256 + 256 and the root's head, 10*256 + 10 padded to 2 ranks
    grad = 4 * (4 * (256 * 256 + 256) + (10 * 256 + 10)) // 2
    full = predict_checkpoint(case, get_strategy("fsdp1_full"))
    assert full[0].terms["fsdp1_flat_grad_freed_host"] == -grad
    # rank 0 (rank0_only) holds the whole state but the unit's last entries while the last flat state is
    # gathered (P) into gloo's receive buffer (P), its own shard concatenated beside it (P/2)
    assert full[0].save_host_peak_bytes == payload + flat + flat // 2 - grad
    assert full[0].terms["gloo_allgather_receive_host"] == flat
    assert full[1].save_host_peak_bytes == 2 * flat + flat // 2 - grad  # the gathers only
    model_only = predict_checkpoint(case.replace(checkpoint_optimizer=False), get_strategy("fsdp1_full"))
    assert model_only[0].save_host_peak_bytes == 4 * psi + flat - grad
    dcp = predict_checkpoint(case.replace(checkpoint="dcp"), get_strategy("fsdp1_full"))
    local = 3 * (4 * (4 * (128 * 256 + 128) + 5 * 256 + 5)) + 4 * 10  # every entry's chunk, cloned
    assert [p.save_host_peak_bytes for p in dcp] == [local + 2 * flat - grad] * 2
    flat_grads = case.replace(strategy_args={"use_orig_params": False})  # zero_grad frees them itself
    assert (
        predict_checkpoint(flat_grads, get_strategy("fsdp1_full"))[0].terms["fsdp1_flat_grad_freed_host"] == 0
    )
    # the full state dict's spike exceeds the sharded one's on rank 0 by the rest of the state: the
    # freed gradient is in both
    assert full[0].save_host_peak_bytes - dcp[0].save_host_peak_bytes == payload - local + flat // 2 - flat


def test_zero1_full_consolidates_every_other_partition_onto_rank_0() -> None:
    from fsdpbench.predictors.checkpoint import _params, _zero1_partitions

    case = Case(model="mlp", world_size=2, checkpoint="full", strategy="zero1", optimizer="adamw")
    params, _ = _params(case)
    # largest first, each to the emptier rank (rank 0 on a tie): the four 256x256 weights alternate,
    # the head's weight breaks the tie to rank 0, and every bias then fills rank 1
    parts = [[p.name for p in part] for part in _zero1_partitions(params, 2)]
    assert parts[0] == ["blocks.0.fc.weight", "blocks.2.fc.weight", "head.weight"]
    assert set(parts[1]) == {"blocks.1.fc.weight", "blocks.3.fc.weight", "head.bias"} | {
        f"blocks.{i}.fc.bias" for i in range(4)
    }
    preds = predict_checkpoint(case, get_strategy("zero1"))
    partition1 = 2 * 4 * (2 * 256 * 256 + 4 * 256 + 10) + 7 * 4  # exp_avg, exp_avg_sq; a 4-byte step each
    assert preds[0].terms["zero1_partitions_loaded_host"] == partition1
    received = preds[0].terms["zero1_partition_received_host"]  # its bytes, received and copied
    assert 2 * partition1 < received < 2 * partition1 + 2 * 16 * 1024  # + the format's own, twice
    # the sender: BytesIO, bytearray, ByteTensor and the legacy constructor's 8-byte-per-element pass
    assert preds[1].terms["zero1_partition_serialized_host"] == 11 * received // 2
    assert preds[0].save_host_peak_bytes == partition1 + received
    assert preds[0].bytes == predict_checkpoint(case.replace(strategy="ddp"), get_strategy("ddp"))[0].bytes


def test_the_kernel_high_water_mark_holds_a_transient_the_sampler_would_miss() -> None:
    from fsdpbench.metrics.rss import read_status_bytes, reset_peak_rss

    if not reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs here: the checkpoint phase samples RSS instead")
    # 48 MiB, written, then freed before anything reads RSS. Above glibc's largest mmap threshold
    # (32 MiB), so its pages are new to the process: a smaller block can be served from heap pages
    # that an earlier test left resident, which raise no high-water mark (seen in a long-lived test
    # process of a parallel run).
    size = 48 * 2**20
    start = read_status_bytes()
    transient = torch.ones(size // 4)
    del transient
    end = read_status_bytes()
    assert end["VmHWM"] - start["VmRSS"] >= size * 0.95
    assert end["VmRSS"] - start["VmRSS"] < size // 8  # the tensor itself is gone


def test_predict_says_whether_rank_0_host_holds_a_full_save(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from fsdpbench.cli import main

    argv = ["predict", "--model", "mlp", "--world-size", "4", "--strategy", "zero3", "--device", "cpu"]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--checkpoint", "full", "--host-memory", "1MiB", "--json"])
    assert exit_.value.code == 0
    record = [r for r in json.loads(capsys.readouterr().out) if r.get("checkpoint") == "full"][0]
    psi = 4 * (256 * 256 + 256) + 10 * 256 + 10
    payload = 3 * 4 * psi + 4 * 10
    padding = 3 * 2 * (256 + 1) * 4  # head: 10 rows gathered into 12 (4 ranks)
    assert record["ranks"][0]["save_host_peak_bytes"] == payload + padding + 256 * 256 * 4
    assert record["host_memory_bytes"] == 2**20 and record["rank0_host_fits"] is False


def test_the_checkpoint_figure_draws_measured_and_modelled_host_peaks() -> None:
    import pandas as pd

    from fsdpbench.report.figure_checkpoint import build_checkpoint_panel

    cases = pd.DataFrame(
        {
            "case_id": ["a", "b"],
            "status": ["ok", "ok"],
            "strategy": ["ddp", "zero3"],
            "world_size": [2, 2],
            "device": ["cpu", "cpu"],
            "backend": ["gloo", "gloo"],
            "label": ["ddp", "zero3"],
            schema.CHECKPOINT_COLUMNS["method"]: ["full", "full"],
            schema.CKPT_CASE_SAVE_S: [0.1, 0.3],
            schema.CKPT_CASE_LOAD_S: [0.1, 0.2],
            schema.CKPT_RANK0_HOST_PEAK: [4e5, 5.5e7],
            schema.PRED_CKPT_RANK0_HOST_PEAK: [0, 5.47e7],
            schema.CKPT_ROUND_TRIP_OK: [True, True],
        }
    )
    panel = build_checkpoint_panel(cases)
    assert panel.figure is not None and not panel.notes
    peaks = {t.name: list(t.y) for t in panel.figure.data if "host peak" in t.name}
    assert peaks["zero3 host peak (modelled)"] == pytest.approx([5.47e7 / 2**20])
    assert build_checkpoint_panel(cases.drop(columns=[schema.CKPT_CASE_SAVE_S])).figure is None


def test_regress_gates_checkpoint_bytes_at_1_percent_and_the_rank0_spike_at_10() -> None:
    import pandas as pd

    from fsdpbench.analysis.regress import build_baseline, compare
    from tests.test_regress import case_rows

    case = Case(strategy="zero3", world_size=2, device="cpu", backend="gloo", checkpoint="dcp")

    def frame(bytes_rank1: int, spike_rank0: int) -> pd.DataFrame:
        rows = case_rows(case, peak=[1000, 1000], step_ms=50.0)
        for rank, (nbytes, spike) in enumerate([(25_000_000, spike_rank0), (bytes_rank1, 300_000)]):
            rows[rank].update(
                {
                    schema.CHECKPOINT_COLUMNS["method"]: "dcp",
                    schema.CKPT_BYTES: nbytes,
                    schema.CKPT_SAVE_HOST_PEAK: spike,
                    schema.CKPT_SAVE_S: 0.2,
                    schema.CKPT_LOAD_S: 0.3,
                    schema.CHECKPOINT_COLUMNS["state_equal"]: True,
                    schema.CHECKPOINT_COLUMNS["loss_equal"]: True,
                }
            )
        return pd.DataFrame(rows)

    baseline = json_round_trip(build_baseline(frame(25_000_000, 3_000_000)))
    metrics = baseline["cases"][case.case_id]["metrics"]
    assert metrics[schema.CKPT_CASE_BYTES] == 50_000_000
    assert metrics[schema.CKPT_RANK0_HOST_PEAK] == 3_000_000
    assert compare(baseline, frame(25_400_000, 3_250_000)).passed  # +0.8% bytes, +8% spike
    failed = compare(baseline, frame(25_600_000, 3_400_000)).failures  # +1.2% bytes, +13% spike
    assert {d.metric for d in failed} == {schema.CKPT_CASE_BYTES, schema.CKPT_RANK0_HOST_PEAK}


def json_round_trip(obj: object) -> dict:
    import json

    return json.loads(json.dumps(obj))


def test_the_save_format_model_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, fsdpbench.predictors.torch_save_format; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_fsdp1_rank0_full_spike_and_its_excess_over_sharded_are_as_predicted(tmp_path: Path) -> None:
    # the study's model (4.2M parameters, AdamW: 50.5 MB of state) at 2 ranks: rank 0's high-water mark
    # above the phase's baseline against the model, the freed flat gradient (8.4 MB) included; the case's
    # ranks fix glibc's mmap threshold from their start, so the heap does not decide what RSS sees
    study = dict(CKPT_TINY, model_args={"width": 1024, "depth": 4}, batch_size=4, timeout_s=300)
    peaks = {}
    for method in ("full", "sharded"):
        case = Case(**study, strategy="fsdp1_full", world_size=2, checkpoint=method)
        rank0 = run_with_predictions(case, tmp_path).sort_values("rank").iloc[0]
        peaks[method] = (rank0[schema.CKPT_SAVE_HOST_PEAK], rank0[schema.PRED_CKPT_HOST_PEAK])
        assert abs(rank0[schema.PRED_CKPT_HOST_PEAK_ERR]) < 0.05, (method, peaks[method])
    measured_gap = peaks["full"][0] - peaks["sharded"][0]
    predicted_gap = peaks["full"][1] - peaks["sharded"][1]
    assert abs(measured_gap - predicted_gap) < 0.05 * predicted_gap, (measured_gap, predicted_gap)
