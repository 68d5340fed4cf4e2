"""torchtitan's Llama 3 flavors as decoder presets: parameter counts to the parameter, grouped-query
attention's shapes, the SwiGLU sizing rule, RoPE θ and scaling, and old case ids left as they were."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fsdpbench.core.case import Case
from fsdpbench.models import build_model, check_model_args, count_params, resolve_model
from fsdpbench.models.families.decoder import default_ffn_dim, ffn_dim, param_shapes
from fsdpbench.predictors.memory_model import predict_memory
from fsdpbench.predictors.traced import estimate

BASELINE = Path(__file__).resolve().parents[1] / "baselines/ci.json"


def declared_params(name: str) -> int:
    shapes, _ = param_shapes(resolve_model(name)[1])
    return sum(math.prod(p.shape) for p in shapes)


@pytest.mark.parametrize(
    "name,params,ffn",
    [
        ("llama3-8b", 8_030_261_248, 14336),  # torchtitan's 8B (and Meta's Llama-3.1-8B)
        # 80 × (2·8192² + 2·1024·8192 + 3·8192·28672 + 2·8192) + 2·128256·8192 + 8192
        ("llama3-70b", 70_553_706_496, 28672),
        # 126 × (2·16384² + 2·1024·16384 + 3·16384·53248 + 2·16384) + 2·128256·16384 + 16384
        ("llama3-405b", 405_853_388_800, 53248),
    ],
)
def test_llama3_parameter_counts_are_torchtitans(name, params, ffn):
    args = resolve_model(name)[1]
    assert ffn_dim(args) == ffn
    assert declared_params(name) == params
    if name == "llama3-8b":  # the declared shapes are what the torch side builds (meta: no memory)
        assert count_params(name) == params


def test_the_ffn_rule_is_torchtitans():
    """int(2·4d/3), times ffn_dim_multiplier (int), rounded up to multiple_of."""
    assert default_ffn_dim(4096, 1024, 1.3) == 14336  # int(1.3 · 10922) = 14198 → 14336
    assert default_ffn_dim(8192, 4096, 1.3) == 28672
    assert default_ffn_dim(16384, 4096, 1.2) == 53248
    assert default_ffn_dim(64) == 192  # the decoder's own rule (multiple of 32) is unchanged


def test_grouped_query_attention_shapes():
    """8 KV heads of 128: wk and wv are 1024 × 4096, wq and wo 4096 × 4096."""
    shapes = {p.name: p.shape for p in param_shapes(resolve_model("llama3-8b")[1])[0]}
    assert shapes["layers.0.attention.wq.weight"] == (4096, 4096)
    assert shapes["layers.0.attention.wk.weight"] == (1024, 4096)
    assert shapes["layers.0.attention.wv.weight"] == (1024, 4096)
    assert shapes["layers.0.attention.wo.weight"] == (4096, 4096)
    assert shapes["tok_embeddings.weight"] == shapes["output.weight"] == (128256, 4096)  # untied
    tiny = build_model("llama3-tiny", device="meta")
    attn = tiny.layers[0].attention
    assert (attn.n_heads, attn.n_kv_heads, attn.head_dim) == (8, 2, 8)  # the 4:1 ratio kept
    assert (attn.rope_theta, attn.rope_scaling) == (500000.0, "llama3")


def test_llama3_rope_scaling_divides_the_low_frequencies_only():
    from fsdpbench.models.decoder import _inv_freq

    plain = _inv_freq(128, 500000.0, "none", torch.device("cpu"))
    scaled = _inv_freq(128, 500000.0, "llama3", torch.device("cpu"))
    wavelen = 2 * math.pi / plain
    assert torch.equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])  # high frequencies kept
    assert torch.allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)  # low ones ÷ 8


def test_the_gqa_decoder_trains_and_its_analytic_peak_is_the_traced_one():
    """llama3-tiny on 2 ranks, zero2 in fp32 and bf16: the analytic peak (what each kernel saves, with
    k and v of 2 heads) is the traced one to the byte, on the CPU."""
    for precision in ("fp32", "bf16"):
        case = Case(
            model="llama3-tiny", strategy="zero2", world_size=2, batch_size=2, seq_len=32, precision=precision
        )
        assert predict_memory(case).peak_bytes == estimate(case).peak_bytes


def test_bad_decoder_arguments_are_named():
    assert "rope_scaling" in check_model_args("decoder", {"rope_scaling": "yarn"})
    assert "n_kv_heads" in check_model_args("decoder", {"n_heads": 4, "n_kv_heads": 3})
    assert "multiple_of" in check_model_args("decoder", {"multiple_of": 0})
    assert "odd" in check_model_args("decoder", {"d_model": 12, "n_heads": 4})


def test_new_decoder_arguments_leave_the_baselines_case_ids_as_they_were():
    """A case id hashes the fields that differ from their defaults: the baseline's ids still come out."""
    ids = set(json.loads(BASELINE.read_text())["cases"])
    cases = [
        Case(
            model="decoder-tiny", strategy=s, world_size=2, wrap="none" if s in ("ddp", "zero1") else "block"
        )
        for s in ("ddp", "zero1", "zero2", "zero3")
    ]
    for case in cases:
        case = case.replace(steps=15, warmup_steps=2, time_blocks=10, time_block_steps=3, timeout_s=120)
        assert case.case_id in ids
