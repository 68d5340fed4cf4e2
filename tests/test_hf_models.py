"""Hugging Face Llama, BERT and T5 from configs (the ``hf`` extra): exact sizes, layer classes as wrap
units, and the same training maths under sharding. Skipped where ``transformers`` is not installed,
except the test that the package works without it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from fsdpbench.core.case import Case
from fsdpbench.models import build_model, count_params, make_global_batch, resolve_model
from fsdpbench.models.hf import transformers_available
from fsdpbench.models.wrap import get_wrap_units
from tests.helpers import global_losses, run, tiny_case

needs_hf = pytest.mark.skipif(
    not transformers_available(), reason="transformers is not installed: pip install 'fsdpbench[hf]'"
)


def test_without_transformers_the_models_register_and_explain(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    mdef, args = resolve_model("hf-llama-tiny")
    assert args["hidden_size"] == 64
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'fsdpbench\[hf\]'"):
        build_model("hf-llama-tiny")
    with pytest.raises(ModuleNotFoundError, match="transformers"):
        mdef.block_classes(args)


@needs_hf
@pytest.mark.parametrize(
    ("preset", "params"),
    [("hf-llama2-7b", 6_738_415_616), ("hf-bert-base", 109_514_298), ("hf-t5-small", 60_506_624)],
)
def test_presets_have_the_published_shapes(preset: str, params: int) -> None:
    assert count_params(preset) == params  # meta-device build: no memory, nothing downloaded


@needs_hf
def test_llama2_7b_from_transformers_matches_fsdpbench_decoder() -> None:
    assert count_params("hf-llama2-7b") == count_params("llama-7b")


@needs_hf
@pytest.mark.parametrize(
    ("model", "block", "n_blocks"),
    [
        ("hf-llama-tiny", "LlamaDecoderLayer", 2),
        ("hf-bert-tiny", "BertLayer", 2),
        ("hf-t5-tiny", "T5Block", 4),
    ],
)
def test_layer_classes_are_the_wrap_units(model: str, block: str, n_blocks: int) -> None:
    meta = build_model(model, device="meta")
    by_block = get_wrap_units(meta, Case(model=model, wrap="block"))
    by_name = get_wrap_units(meta, Case(model=model, wrap="classes", wrap_classes=(block,)))
    assert [type(m).__name__ for m in by_block] == [block] * n_blocks
    assert [id(m) for m in by_name] == [id(m) for m in by_block]


@needs_hf
@pytest.mark.parametrize("model", ["hf-llama-tiny", "hf-bert-tiny", "hf-t5-tiny"])
def test_forward_gives_token_logits_and_a_loss(model: str) -> None:
    mdef, args = resolve_model(model)
    torch.manual_seed(0)
    net = build_model(model)
    x, y = make_global_batch(model, None, 2, 8, 0, 0)
    logits = net(x)
    assert logits.shape == (2, 8, args["vocab"])
    loss = mdef.loss(logits, y)
    assert (
        abs(loss.item() - torch.log(torch.tensor(float(args["vocab"]))).item()) < 1.0
    )  # near-uniform at init


@needs_hf
@pytest.mark.slow
def test_hf_llama_sharded_by_its_layer_class_matches_one_rank(tmp_path: Path) -> None:
    common = dict(model="hf-llama-tiny", wrap="classes", wrap_classes=("LlamaDecoderLayer",))
    ref = run(tiny_case(strategy="ddp", world_size=1, batch_size=4, **common), tmp_path / "ref")
    for strategy in ("zero3", "fsdp1_full"):
        outcome = run(tiny_case(strategy=strategy, world_size=2, **common), tmp_path)
        assert outcome.status == "ok", outcome.error
        assert outcome.ranks[0].setup.n_units == 3  # two decoder layers + the root
        assert global_losses(outcome) == pytest.approx(global_losses(ref), rel=1e-5)
