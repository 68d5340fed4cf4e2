"""How fast ``fsdpbench predict`` answers (pytest-benchmark).

    python -m pytest tests/benchmarks/test_predict_speed.py -q --benchmark-enable        # analytic (cheap)
    FSDPBENCH_BENCH_TRACED=1 python -m pytest tests/benchmarks/test_predict_speed.py -q --benchmark-enable

Analytic: a 1T-parameter model on 4096 GPUs from its parameter count, a ~1T decoder and llama-70b on
4096 GPUs with their full structure (every parameter's padding, every unit, the whole step timeline);
the target is under 100 ms each. Traced: llama-7b, ZeRO-3 on 64 fake ranks, bf16, batch 1 × 2048
tokens, in a fresh Python process (its wall time and peak RSS go to ``extra_info``; the model is never
allocated). It takes tens of seconds, so it runs only with FSDPBENCH_BENCH_TRACED=1. No timing is
asserted: the numbers are recorded (``--benchmark-autosave``) and reported in docs/memory-model.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fsdpbench.core.case import Case
from fsdpbench.predictors.memory_model import ModelFacts, get_model_facts, predict_memory

GPU = {"device": "cuda", "backend": "nccl", "precision": "bf16"}


def test_analytic_1t_params_on_4096(benchmark):
    case = Case(
        strategy="zero3", world_size=4096, precision="mixed", optimizer="adam", device="cuda", backend="nccl"
    )
    facts = ModelFacts.from_count(10**12)
    pred = benchmark(predict_memory, case, facts=facts)
    assert pred.model_states_bytes == 16 * 10**12 // 4096


def test_analytic_1t_decoder_on_4096(benchmark):
    """A ~1.01T-parameter decoder (d 25600, 128 layers) with its full structure, ZeRO-3 on 4096 GPUs."""
    args = {"d_model": 25600, "n_layers": 128, "n_heads": 200, "vocab": 32000}
    case = Case(
        model="decoder", model_args=args, strategy="zero3", world_size=4096, batch_size=1, seq_len=4096, **GPU
    )
    pred = benchmark(predict_memory, case)
    assert 1.0e12 < pred.params < 1.02e12
    benchmark.extra_info.update(peak_bytes=pred.peak_bytes, peak_moment=pred.peak_moment)


def test_analytic_llama_70b_on_4096(benchmark):
    case = Case(model="llama-70b", strategy="zero3", world_size=4096, batch_size=1, seq_len=4096, **GPU)
    get_model_facts("llama-70b", wrap="block")  # structure facts are cached after the first call (~ms)
    pred = benchmark(predict_memory, case)
    assert pred.peak_bytes > pred.model_states_bytes > 0
    benchmark.extra_info.update(peak_bytes=pred.peak_bytes, peak_moment=pred.peak_moment)


_TRACE = """
import json, time
from fsdpbench.core.case import Case
from fsdpbench.predictors.traced import estimate
case = Case(model="llama-7b", strategy="zero3", world_size=64, batch_size=1, seq_len=2048, precision="bf16",
            device="cuda", backend="nccl")
est = estimate(case)
print(json.dumps({"wall_s": est.wall_s, "peak_rss_bytes": est.peak_rss_bytes, "peak_bytes": est.peak_bytes,
                  "model_states_bytes": est.model_states_bytes}))
"""


@pytest.mark.skipif(
    not os.environ.get("FSDPBENCH_BENCH_TRACED"), reason="set FSDPBENCH_BENCH_TRACED=1 (tens of seconds)"
)
def test_traced_llama_7b_on_64(benchmark):
    def trace() -> dict:
        out = subprocess.run([sys.executable, "-c", _TRACE], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    result = benchmark.pedantic(trace, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    assert result["model_states_bytes"] > 0
    assert (
        result["peak_rss_bytes"] < 6_738_415_616 * 2
    )  # far below one bf16 copy of the model: nothing allocated
