"""The Hugging Face Transformers families, declared: ``hf-llama``, ``hf-bert``, ``hf-t5`` and their
presets, registered whether or not ``transformers`` is installed (the torch side, which needs it:
``fsdpbench/models/hf.py``). No parameter shapes are declared: the memory model reads them from a
meta-device build.
"""

from __future__ import annotations

import functools
from typing import Any

from fsdpbench.models.registry import ModelDef, TorchSide, register_model, register_preset

TORCH_SIDE = "fsdpbench.models.hf"
INSTALL_HINT = "pip install 'fsdpbench[hf]'"

# ---- arguments -----------------------------------------------------------------------------------
# Each argument's default in the families that take it; a family's arguments come in this order.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "hidden_size": {"hf-llama": 64, "hf-bert": 64},
    "d_model": {"hf-t5": 64},
    "num_layers": {"hf-llama": 2, "hf-bert": 2, "hf-t5": 2},
    "num_heads": {"hf-llama": 4, "hf-bert": 4, "hf-t5": 4},
    "num_kv_heads": {"hf-llama": None},  # None: num_heads (build_llama)
    "intermediate_size": {"hf-llama": 192, "hf-bert": 256},
    "d_kv": {"hf-t5": 16},
    "d_ff": {"hf-t5": 256},
    "vocab": {"hf-llama": 512, "hf-bert": 512, "hf-t5": 512},
    "max_positions": {"hf-llama": 2048, "hf-bert": 512},
    "dropout": {"hf-llama": 0.0, "hf-bert": 0.0, "hf-t5": 0.0},
}


def family_defaults(model: str) -> dict[str, Any]:
    """The arguments of one family (``hf-llama``, …) and their defaults, in their order."""
    return {arg: family[model] for arg, family in _DEFAULTS.items() if model in family}


_FAMILIES = [
    (
        "hf-llama",
        "build_llama",
        "causal_batch",
        "LlamaDecoderLayer",
        "Hugging Face LlamaForCausalLM, from a config",
    ),
    ("hf-bert", "build_bert", "masked_batch", "BertLayer", "Hugging Face BertForMaskedLM from a config"),
    (
        "hf-t5",
        "build_t5",
        "seq2seq_batch",
        "T5Block",
        "Hugging Face T5ForConditionalGeneration from a config",
    ),
]


for _name, _builder, _batch, _block_name, _desc in _FAMILIES:
    register_model(
        ModelDef(
            name=_name,
            build=TorchSide(f"{TORCH_SIDE}:{_builder}"),
            defaults=family_defaults(_name),
            make_batch=TorchSide(f"{TORCH_SIDE}:{_batch}"),
            loss=TorchSide(f"{TORCH_SIDE}:token_loss"),
            block_classes=functools.partial(TorchSide(f"{TORCH_SIDE}:block_classes"), _name, _block_name),
            block_class_names=(_block_name,),
            is_sequence=True,
            description=f"{_desc} ({INSTALL_HINT}); blocks {_block_name}",
            extra={"requires": "transformers", "install": INSTALL_HINT},
        )
    )

# the published models' shapes; the -tiny presets are the families' defaults
_LLAMA2_7B = dict(
    hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=11008, vocab=32000, max_positions=4096
)
_BERT_BASE = dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072, vocab=30522)
_T5_SMALL = dict(d_model=512, num_layers=6, num_heads=8, d_kv=64, d_ff=2048, vocab=32128)

register_preset("hf-llama-tiny", "hf-llama", "d64 L2 H4 V512 (172k params)")
register_preset("hf-llama2-7b", "hf-llama", "Llama-2 7B shape (6,738,415,616 params)", **_LLAMA2_7B)
register_preset("hf-bert-tiny", "hf-bert", "d64 L2 H4 V512 (171k params)")
register_preset(
    "hf-bert-base", "hf-bert", "BERT-base shape (109,514,298 params with the MLM head)", **_BERT_BASE
)
register_preset("hf-t5-tiny", "hf-t5", "d64 L2+2 H4 V512 (263k params)")
register_preset("hf-t5-small", "hf-t5", "T5-small shape (60,506,624 params)", **_T5_SMALL)
