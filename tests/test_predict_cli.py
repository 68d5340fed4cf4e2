"""``fsdpbench predict``: the table, --json, fitting, and errors that name what is allowed."""

from __future__ import annotations

import json

import pytest

from fsdpbench.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(["predict", *argv])
    out = capsys.readouterr()
    return exc.value.code or 0, out.out, out.err


ZERO_PAPER = (
    "--params",
    "7.5e9",
    "--world-size",
    "64",
    "--strategy",
    "zero1,zero2,zero3",
    "--precision",
    "mixed",
    "--optimizer",
    "adam",
)


def test_zero_paper_figure_json(capsys):
    code, out, _ = run_cli(capsys, *ZERO_PAPER, "--json")
    assert code == 0
    records = json.loads(out)
    assert [(r["strategy"], r["method"], r["model_states_bytes"]) for r in records] == [
        ("zero1", "analytic", 31_406_250_000),
        ("zero2", "analytic", 16_640_625_000),
        ("zero3", "analytic", 1_875_000_000),
    ]
    for r in records:
        assert {
            "strategy",
            "world_size",
            "params",
            "method",
            "model_states_bytes",
            "peak_bytes",
            "bytes",
        } <= set(r)
        assert r["world_size"] == 64 and r["params"] == 7_500_000_000
        assert r["peak_bytes"] is None and r["bytes"]["activations"] is None  # not estimated without a model


def test_zero_paper_figure_table(capsys):
    code, out, _ = run_cli(capsys, *ZERO_PAPER)
    assert code == 0
    lines = [ln for ln in out.splitlines() if "model states (ZeRO accounting)" in ln]
    assert [ln.split("│")[-2].strip() for ln in lines] == ["31.4", "16.6", "1.9"]
    assert "needs --model" in out


def test_model_prediction_with_device_memory(capsys):
    code, out, _ = run_cli(
        capsys,
        "--model",
        "decoder-small",
        "--world-size",
        "4",
        "--strategy",
        "zero3",
        "--seq-len",
        "128",
        "--batch-size",
        "4",
        "--device-memory",
        "80GiB",
        "--json",
    )
    assert code == 0
    rec, alloc = json.loads(out)  # the analytic prediction, then the allocator model's answer on CUDA
    assert "fits" not in rec  # on CUDA "fits?" comes from the allocator model, not tracked bytes + allowance
    assert rec["peak_bytes"] > rec["model_states_bytes"]
    assert rec["device_peak_bytes"] == rec["peak_bytes"] + rec["terms"]["untracked"] + 2**30  # the allowance
    assert alloc["fits"] is True and alloc["decided_by"].startswith("the allocator model")
    assert alloc["smallest_world_size"] == 1 and alloc["largest_batch"] > 4
    # the layers: live tensors ≤ allocated blocks ≤ reserved segments < NVML (+ context + NCCL, each sourced)
    assert alloc["tracked_peak_bytes"] <= alloc["allocated_peak_bytes"] <= alloc["reserved_peak_bytes"]
    assert (
        alloc["nvml_peak_bytes"]
        == alloc["reserved_peak_bytes"] + alloc["context_bytes"] + alloc["nccl_bytes"]
    )
    # one ring, 16 channels
    assert alloc["nvml_terms_bytes"]["nccl_buffers"] == 16 * (4 * 2**20 + 512 * 2**10 + 120 * 640 * 64)
    assert (
        alloc["nccl_bytes"]
        == alloc["nvml_terms_bytes"]["nccl_buffers"] + alloc["nvml_terms_bytes"]["nccl_library"]
    )
    assert alloc["margin_bytes"] == 80 * 2**30 - alloc["nvml_peak_bytes"]


def test_does_not_fit(capsys):
    code, out, _ = run_cli(
        capsys, "--model", "llama-7b", "--world-size", "8", "--strategy", "ddp", "--device-memory", "80GiB"
    )
    assert code == 0
    assert "does NOT fit in 80.0 GiB" in out  # in the units asked
    # ddp's analytic and allocator layers agree (the traced stream counts DDP's bucket once): a verdict,
    # and searches that find nothing (a replicated model fits on no number of ranks)
    assert "contradict" not in out
    assert "the tracked peak alone (analytic) + context + NCCL, short by 48.4 GiB" in " ".join(out.split())
    assert "largest per-rank batch that fits: none; smallest world size that fits" in " ".join(out.split())


def test_traced_and_analytic_side_by_side(capsys):
    code, out, _ = run_cli(
        capsys,
        "--model",
        "decoder-tiny",
        "--world-size",
        "2",
        "--strategy",
        "zero3",
        "--device",
        "cpu",
        "--batch-size",
        "4",
        "--seq-len",
        "64",
        "--method",
        "both",
        "--json",
    )
    assert code == 0
    analytic, traced = json.loads(out)
    assert (analytic["method"], traced["method"]) == ("analytic", "traced")
    assert analytic["peak_bytes"] == traced["peak_bytes"] == 5852124  # the measured zero3 n2 peak


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--model", "nope", "--world-size", "2"), "allowed: "),
        (("--model", "decoder-tiny", "--world-size", "2", "--strategy", "foo"), "known: ddp"),
        (("--model", "decoder-tiny", "--world-size", "3", "--strategy", "hsdp"), "does not divide"),
        (("--model", "decoder-tiny", "--world-size", "2", "--device-memory", "80Gb2"), "GiB"),
        (("--params", "1e9", "--world-size", "2", "--method", "traced"), "needs --model"),
        (("--model", "decoder-tiny", "--world-size", "2", "--rank", "5"), "--rank 5"),
    ],
)
def test_errors_name_what_is_allowed(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in " ".join(err.split())


def test_device_memory_on_cuda_prints_each_layer_and_answers_from_the_allocator(capsys):
    code, out, _ = run_cli(
        capsys,
        *("--model", "decoder-small", "--world-size", "4", "--strategy", "zero3", "--precision", "bf16"),
        *("--seq-len", "128", "--batch-size", "4", "--device-memory", "3GiB", "--nccl-channels", "2"),
    )
    assert code == 0
    lines = {ln.strip().split("  ")[0]: ln for ln in out.splitlines()}
    for label in (
        "tracked peak (live tensors, traced tracker)",
        "allocated peak (max_memory_allocated)",
        "reserved peak (max_memory_reserved, no limit)",
        "+ cuda_context",
        "+ cudnn",
        "+ nccl_library",
        "+ nccl_buffers",
        "NVML used, no limit",
    ):
        figure = lines[label].split("  (")[0]  # each its own line, in binary units as asked
        assert label in lines and figure.endswith((" GiB", " MiB", " KiB"))
    assert "2 channels (given)" in out
    assert "+ profiler" not in lines  # a plain training job's terms
    assert "fits in 3.0 GiB: the allocator model's reserved peak + context + NCCL" in out
    assert "+ CUDA context / NCCL allowance" in out  # the analytic table keeps its flat allowance row


def test_alloc_conf_is_checked_before_anything_runs(capsys):
    code, _, err = run_cli(
        capsys, "--model", "decoder-small", "--world-size", "2", "--alloc-conf", "max_split_size_mb:10"
    )
    assert code == 2 and "max_split_size_mb:10" in err


MNIST_DDP = ("--model", "mnist-cnn", "--world-size", "2", "--strategy", "ddp", "--device", "cpu")


def test_a_model_without_an_activation_model_is_traced_instead(capsys):
    """mnist-cnn has no analytic activation model: --method analytic still answers with a peak, the traced
    one, and says so once."""
    from fsdpbench.core.case import Case
    from fsdpbench.predictors.traced import estimate

    code, out, _ = run_cli(capsys, *MNIST_DDP, "--json")
    assert code == 0
    analytic, traced = json.loads(out)
    assert (analytic["method"], traced["method"]) == ("analytic", "traced")
    assert analytic["peak_bytes"] is None and analytic["model_states_bytes"] > 0
    assert traced["fallback"] == "analytic activation model not available for mnist-cnn: traced instead"
    case = Case(model="mnist-cnn", strategy="ddp", world_size=2, batch_size=1, seq_len=2048)
    assert traced["peak_bytes"] == estimate(case).peak_bytes > analytic["model_states_bytes"]

    code, out, _ = run_cli(capsys, *MNIST_DDP)
    assert code == 0
    lines = [" ".join(ln.split()) for ln in out.splitlines()]
    assert lines.count("analytic activation model not available for mnist-cnn: traced instead") == 1
    assert not any("no activation model" in ln for ln in lines)  # the analytic note it replaces
    peak = next(ln for ln in lines if ln.startswith("│ peak: live tensors"))
    assert peak.split("│")[-3].strip() == "not estimated" and peak.split("│")[-2].strip() != "—"


def test_a_model_with_an_activation_model_is_not_traced(capsys):
    code, out, _ = run_cli(capsys, "--model", "mlp-tiny", "--world-size", "2", "--device", "cpu", "--json")
    assert code == 0
    (analytic,) = json.loads(out)
    assert analytic["method"] == "analytic" and analytic["peak_bytes"] > 0


def test_device_memory_traces_each_stream_once_and_fits_80_columns(capsys, monkeypatch):
    import fsdpbench.predictors.traced as traced

    traced_ids: list[str] = []
    trace = traced.estimate

    def counted(case, **kwargs):  # noqa: ANN001, ANN003, ANN202 — traced.estimate's own
        traced_ids.append(case.case_id)
        return trace(case, **kwargs)

    monkeypatch.setattr(traced, "estimate", counted)
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli(
        capsys,
        *("--model", "decoder-small", "--world-size", "4", "--strategy", "zero2,zero3"),
        *("--precision", "bf16", "--seq-len", "128", "--batch-size", "4"),
        *("--device-memory", "3GiB", "--nccl-channels", "2", "--method", "both"),
        *("--jobs", "1"),  # the traces counted in this process
    )
    assert code == 0
    # one trace per distinct stream: the case asked once (the allocator model's and the traced column's),
    # then the searches' candidates, none twice
    assert len(traced_ids) == len(set(traced_ids))
    asked = [ln for ln in err.splitlines() if "tracing the case asked" in ln]
    assert len(asked) == 2 and len(err.splitlines()) == len(traced_ids)  # a progress line per trace
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= 80
    notes = [ln.strip() for ln in lines if ln.strip().startswith("note:")]
    assert notes and len(notes) == len(set(notes))  # a note shared by both strategies printed once
    assert "e-0" not in out  # no size in scientific notation


@pytest.mark.parametrize(
    "nbytes,units,shown",
    [
        (4, "GiB", "4 B"),
        (256 * 2**10, "GiB", "256 KiB"),
        (500 * 2**20, "GiB", "500 MiB"),
        (3 * 2**29, "GiB", "1.5"),
        (250 * 10**6, "GB", "250 MB"),
        (1_500, "GB", "1.5 KB"),
        (0, "GB", "0"),
    ],
)
def test_sizes_print_in_a_unit_a_person_reads(nbytes, units, shown):
    from fsdpbench.commands.predict import _fmt

    assert _fmt(nbytes, units) == shown


SMALL_ON_3GIB = (
    *("--model", "decoder-small", "--world-size", "4", "--strategy", "zero3", "--precision", "bf16"),
    *("--seq-len", "128", "--batch-size", "4", "--device-memory", "3GiB", "--nccl-channels", "2"),
)


def test_a_prediction_whose_methods_agree_says_so_and_gives_its_verdict(capsys):
    code, out, _ = run_cli(capsys, *SMALL_ON_3GIB, "--json")
    assert code == 0
    answer = next(r for r in json.loads(out) if "allocated_peak_bytes" in r)
    assert answer["consistent"] is True and answer["disagreements"] == [] and answer["fits"] is True
    assert answer["tracked_peak_bytes"] <= answer["allocated_peak_bytes"] <= answer["reserved_peak_bytes"]
    assert answer["reserved_peak_bytes"] <= answer["nvml_peak_bytes"]


def test_a_prediction_that_contradicts_itself_gives_no_verdict_and_says_where(capsys, monkeypatch):
    """An analytic allocated peak a third above the allocator model's: no fits line, no searches, and
    each disagreement named in readable sizes (at 80 columns); JSON says the same."""
    import dataclasses

    import fsdpbench.predictors.consistency as consistency

    real = consistency.layer_figures

    def inflated(case, method, **kwargs):  # noqa: ANN001, ANN003, ANN202 — layer_figures' own
        f = real(case, method, **kwargs)
        return dataclasses.replace(f, allocated=f.allocated * 3 // 2, reserved=f.reserved * 3 // 2)

    monkeypatch.setattr(consistency, "layer_figures", inflated)
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli(capsys, *SMALL_ON_3GIB)
    assert code == 0
    text = " ".join(out.split())
    assert "this case's predictions contradict each other: - allocated peak: analytic " in text
    assert "apart (they agree within 10%)" in text
    assert "no verdict on 3.0 GiB: whether it fits is not known from them no search" in text
    assert "fits in" not in text and "does NOT fit" not in text and "largest per-rank batch" not in text
    assert len(err.splitlines()) == 1  # the case asked traced once; no search traced anything
    assert max(len(line) for line in out.splitlines()) <= 80
    code, out, _ = run_cli(capsys, *SMALL_ON_3GIB, "--json")
    answer = next(r for r in json.loads(out) if "allocated_peak_bytes" in r)
    assert answer["consistent"] is False and answer["fits"] is None and answer["largest_batch"] is None
    assert any(d.startswith("allocated peak: analytic ") for d in answer["disagreements"])


def test_where_the_methods_disagree_the_live_tensors_they_agree_on_still_decide_a_no(capsys, monkeypatch):
    """Allocated peaks apart, tracked peaks equal, and the live tensors + NVML's terms alone above the
    device memory: "does NOT fit", said to rest on the live tensors; still no search."""
    import dataclasses

    import fsdpbench.predictors.consistency as consistency

    real = consistency.layer_figures

    def inflated(case, method, **kwargs):  # noqa: ANN001, ANN003, ANN202 — layer_figures' own
        f = real(case, method, **kwargs)
        return dataclasses.replace(f, allocated=f.allocated * 3 // 2, reserved=f.reserved * 3 // 2)

    monkeypatch.setattr(consistency, "layer_figures", inflated)
    argv = [a if a != "3GiB" else "1GiB" for a in SMALL_ON_3GIB]
    code, out, _ = run_cli(capsys, *argv)
    text = " ".join(out.split())
    assert code == 0 and "this case's predictions contradict each other" in text
    assert "does NOT fit in 1.0 GiB: the tracked peak alone (analytic) + context + NCCL" in text
    assert "(both methods agree on the live tensors) no search" in text and "largest per-rank" not in text


def _predict_process(*argv: str):  # noqa: ANN202 — a CompletedProcess
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run(
        [sys.executable, "-m", "fsdpbench", "predict", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_strategies_predicted_at_once_answer_as_one_after_the_other():
    """--jobs 2 predicts each strategy in a process of its own: the same output, byte for byte, as one
    after the other; the progress lines of both on stderr."""
    argv = (
        "--model",
        "decoder-tiny",
        "--world-size",
        "4",
        "--strategy",
        "ddp,zero3",
        "--device-memory",
        "64MiB",
    )
    apart, together = _predict_process(*argv, "--jobs", "2"), _predict_process(*argv, "--jobs", "1")
    assert apart.returncode == together.returncode == 0, apart.stderr[-2000:]
    assert apart.stdout == together.stdout and "fits" in apart.stdout
    assert {"(ddp)", "(zero3)"} <= {
        line.split()[-2] for line in apart.stderr.splitlines() if "tracing" in line
    }


def test_an_error_in_a_process_of_its_own_is_one_line():
    """A case that cannot be traced, predicted in a process of its own: its error comes back as one line
    naming the strategy (torch's exception, holding C++ objects, is not pickled), exit 2."""
    argv = ("--model", "decoder-tiny", "--world-size", "4", "--shard-size", "2", "--method", "traced")
    proc = _predict_process(*argv, "--strategy", "ddp,fsdp1_hybrid", "--jobs", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: fsdp1_hybrid: aten._local_scalar_dense.default"


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    from pathlib import Path

    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def _gone(pids: set[int], limit_s: float = 30.0) -> bool:
    """Whether every one of ``pids`` has exited, waiting up to ``limit_s`` (a bound, not a measurement)."""
    import os
    import time

    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        alive = set()
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.add(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["ctrl-c", "killed"])
def test_the_predicting_processes_end_with_the_command(how):
    """Ctrl-C to the command's process group ends the command (exit 130) and its predicting processes
    at once, not after their cases; a command killed outright (SIGKILL) takes them along."""
    import os
    import signal
    import subprocess
    import sys

    argv = ("--model", "llama-7b", "--world-size", "8", "--strategy", "ddp,zero1,zero2,zero3")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdpbench", "predict", *argv, "--device-memory", "80GiB", "--jobs", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        seen = 0
        for line in proc.stderr:  # both processes at work
            seen += "tracing the case asked" in line
            if seen == 2:
                break
        children = _children(proc.pid)
        assert len(children) >= 2
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(timeout=120) == 130
        else:
            proc.kill()
            proc.wait(timeout=120)
        assert _gone(children)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("asked", "cpus", "cases", "jobs"),
    [
        (0, 1, 4, 1),  # one CPU: one after the other, in the command's process
        (0, 2, 4, 4),  # a process per case: the OS shares the CPUs until the last ends
        (0, 2, 6, 4),  # up to two per CPU
        (0, 16, 3, 3),
        (2, 16, 4, 2),  # as asked
        (8, 16, 3, 3),  # never more than the cases
    ],
)
def test_processes_predicting_at_once(monkeypatch, asked, cpus, cases, jobs):
    from fsdpbench.commands import predict

    monkeypatch.setattr(predict, "_usable_cpus", lambda: set(range(cpus)))
    assert predict._jobs(asked, cases) == jobs


@pytest.mark.parametrize("argv", [["--strategy", "zero3"], ["--strategy", "nope"]])
def test_the_command_ends_at_once_after_its_exit_handlers_with_its_output(argv):
    """predict ends without the interpreter's teardown (cli._exit_at_once): the exit handlers still run,
    everything written to a pipe arrives, and the exit status is the command's."""
    import subprocess
    import sys

    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('exit handler ran'))\n"
        f"sys.argv = ['fsdpbench', 'predict', '--model', 'llama-7b', '--world-size', '8', *{argv!r}]\n"
        "from fsdpbench.cli import main\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == (0 if argv[1] == "zero3" else 2), proc.stderr[-2000:]
    assert proc.stdout.endswith("exit handler ran\n")
    if argv[1] == "zero3":
        assert "zero3 — llama-7b, 8 ranks" in proc.stdout
    else:
        assert proc.stderr.startswith("error:")
