"""Hugging Face Transformers models built from a config — no weights downloaded, nothing fetched.

Families (``transformers`` is an optional extra: ``pip install 'fsdpbench[hf]'``):

- ``hf-llama``: ``LlamaForCausalLM``, next-token loss; blocks ``LlamaDecoderLayer``.
- ``hf-bert``:  ``BertForMaskedLM``, token-classification loss on every position; blocks ``BertLayer``.
- ``hf-t5``:    ``T5ForConditionalGeneration``, encoder input and decoder input from one tensor;
  blocks ``T5Block`` (encoder and decoder).

The torch side of the ``hf-*`` families, declared (whether or not ``transformers`` is installed, so a
scenario naming one validates everywhere) in ``fsdpbench/models/families/hf.py``; a case that needs it
is skipped with the install command (``fsdpbench.engine.knobs.check_knobs``), and building one raises
the same message.
Dropout defaults to 0 (the library's defaults are 0.1) so runs are deterministic and losses compare
across strategies; set ``dropout: 0.1`` to match the published configs.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdpbench.models.families.hf import INSTALL_HINT, family_defaults


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


def _config(model: str, args: dict[str, Any]) -> dict[str, Any]:
    """The config fields ``args`` (missing ones at their defaults) set for ``model``."""
    config = {}
    for arg, value in {**family_defaults(model), **args}.items():
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
def causal_batch(args: dict[str, Any], batch: int, seq_len: int, gen: torch.Generator):
    tokens = torch.randint(0, args["vocab"], (batch, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def masked_batch(args: dict[str, Any], batch: int, seq_len: int, gen: torch.Generator):
    tokens = torch.randint(0, args["vocab"], (batch, seq_len), generator=gen)
    labels = torch.randint(0, args["vocab"], (batch, seq_len), generator=gen)
    return tokens, labels


def seq2seq_batch(args: dict[str, Any], batch: int, seq_len: int, gen: torch.Generator):
    source = torch.randint(0, args["vocab"], (batch, seq_len), generator=gen)
    target = torch.randint(0, args["vocab"], (batch, seq_len + 1), generator=gen)
    return torch.stack((source, target[:, :-1]), dim=1), target[:, 1:].contiguous()


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _block(model: str, name: str) -> Any:
    _transformers(model)
    family = {"LlamaDecoderLayer": "llama", "BertLayer": "bert", "T5Block": "t5"}[name]
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)


def block_classes(model: str, name: str, args: dict[str, Any]) -> tuple[Any, ...]:
    """The family's block class (the FSDP unit), imported from transformers when first asked for."""
    return (_block(model, name),)
