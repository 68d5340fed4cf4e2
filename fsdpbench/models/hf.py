"""Hugging Face Transformers models built from a config — no weights downloaded, nothing fetched.

Families (``transformers`` is an optional extra: ``pip install 'fsdpbench[hf]'``):

- ``hf-llama``: ``LlamaForCausalLM``, next-token loss; blocks ``LlamaDecoderLayer``.
- ``hf-bert``:  ``BertForMaskedLM``, token-classification loss on every position; blocks ``BertLayer``.
- ``hf-t5``:    ``T5ForConditionalGeneration``, encoder input and decoder input from one tensor;
  blocks ``T5Block`` (encoder and decoder).

Each family and preset is registered whether or not ``transformers`` is installed, so a scenario
naming one validates everywhere; a case that needs it is skipped with the install command
(``fsdpbench.engine.knobs.check_knobs``), and building one raises the same message.
Dropout defaults to 0 (the library's defaults are 0.1) so runs are deterministic and losses compare
across strategies; set ``dropout: 0.1`` to match the published configs.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdpbench.models.registry import ModelDef, register_model, register_preset

INSTALL_HINT = "pip install 'fsdpbench[hf]'"


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _transformers(model: str) -> Any:
    if not transformers_available():
        raise ModuleNotFoundError(f"model {model!r} needs Hugging Face transformers: {INSTALL_HINT}")
    import transformers

    return transformers


class HFModel(nn.Module):
    """A Transformers model behind fsdpbench's one-tensor interface: ``forward(x) -> logits``."""

    def __init__(self, model: nn.Module, kind: str) -> None:
        super().__init__()
        self.model = model
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "seq2seq":  # x is (batch, 2, seq): encoder input, decoder input
            return self.model(input_ids=x[:, 0], decoder_input_ids=x[:, 1], use_cache=False).logits
        if self.kind == "causal":
            return self.model(input_ids=x, use_cache=False).logits
        return self.model(input_ids=x).logits


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
# The config field(s) an argument sets where they are not named as the argument.
_FIELDS: dict[str, dict[str, str | tuple[str, ...]]] = {
    "num_layers": {"hf-llama": "num_hidden_layers", "hf-bert": "num_hidden_layers"},
    "num_heads": {"hf-llama": "num_attention_heads", "hf-bert": "num_attention_heads"},
    "num_kv_heads": {"hf-llama": "num_key_value_heads"},
    "vocab": {"hf-llama": "vocab_size", "hf-bert": "vocab_size", "hf-t5": "vocab_size"},
    "max_positions": {"hf-llama": "max_position_embeddings", "hf-bert": "max_position_embeddings"},
    "dropout": {
        "hf-llama": "attention_dropout",
        "hf-bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
        "hf-t5": "dropout_rate",
    },
}


def _defaults(model: str) -> dict[str, Any]:
    return {arg: family[model] for arg, family in _DEFAULTS.items() if model in family}


def _config(model: str, args: dict[str, Any]) -> dict[str, Any]:
    """The config fields ``args`` (missing ones at their defaults) set for ``model``."""
    config = {}
    for arg, value in {**_defaults(model), **args}.items():
        fields = _FIELDS.get(arg, {}).get(model, arg)
        config.update(dict.fromkeys((fields,) if isinstance(fields, str) else fields, value))
    return config


# ---- builders -----------------------------------------------------------------------------------
def build_llama(**args: Any) -> HFModel:
    tf = _transformers("hf-llama")
    config = _config("hf-llama", args)
    config["num_key_value_heads"] = config["num_key_value_heads"] or config["num_attention_heads"]
    return HFModel(tf.LlamaForCausalLM(tf.LlamaConfig(**config, tie_word_embeddings=False)), "causal")


def build_bert(**args: Any) -> HFModel:
    tf = _transformers("hf-bert")
    return HFModel(tf.BertForMaskedLM(tf.BertConfig(**_config("hf-bert", args))), "masked")


def build_t5(**args: Any) -> HFModel:
    tf = _transformers("hf-t5")
    return HFModel(tf.T5ForConditionalGeneration(tf.T5Config(**_config("hf-t5", args))), "seq2seq")


# ---- batches, losses, blocks ----------------------------------------------------------------------
def _causal_batch(args: dict[str, Any], batch: int, seq_len: int, gen: torch.Generator):
    tokens = torch.randint(0, args["vocab"], (batch, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _masked_batch(args: dict[str, Any], batch: int, seq_len: int, gen: torch.Generator):
    tokens = torch.randint(0, args["vocab"], (batch, seq_len), generator=gen)
    labels = torch.randint(0, args["vocab"], (batch, seq_len), generator=gen)
    return tokens, labels


def _seq2seq_batch(args: dict[str, Any], batch: int, seq_len: int, gen: torch.Generator):
    source = torch.randint(0, args["vocab"], (batch, seq_len), generator=gen)
    target = torch.randint(0, args["vocab"], (batch, seq_len + 1), generator=gen)
    return torch.stack((source, target[:, :-1]), dim=1), target[:, 1:].contiguous()


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _block(model: str, name: str) -> Any:
    _transformers(model)
    family = {"LlamaDecoderLayer": "llama", "BertLayer": "bert", "T5Block": "t5"}[name]
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)


def _block_classes(model: str, name: str, args: dict[str, Any]) -> tuple[Any, ...]:
    """The family's block class (the FSDP unit), imported from transformers when first asked for."""
    return (_block(model, name),)


_FAMILIES = [
    (
        "hf-llama",
        build_llama,
        _causal_batch,
        "LlamaDecoderLayer",
        "Hugging Face LlamaForCausalLM, from a config",
    ),
    ("hf-bert", build_bert, _masked_batch, "BertLayer", "Hugging Face BertForMaskedLM from a config"),
    ("hf-t5", build_t5, _seq2seq_batch, "T5Block", "Hugging Face T5ForConditionalGeneration from a config"),
]


for _name, _builder, _batch, _block_name, _desc in _FAMILIES:
    register_model(
        ModelDef(
            name=_name,
            build=_builder,
            defaults=_defaults(_name),
            make_batch=_batch,
            loss=_token_loss,
            block_classes=functools.partial(_block_classes, _name, _block_name),
            is_sequence=True,
            description=f"{_desc} ({INSTALL_HINT}); blocks {_block_name}",
            extra={"requires": "transformers", "install": INSTALL_HINT, "block_class_names": (_block_name,)},
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
