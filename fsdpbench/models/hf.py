"""Hugging Face Transformers models built from a config — no weights downloaded, nothing fetched.

Families (``transformers`` is an optional extra: ``pip install 'fsdpbench[hf]'``):

- ``hf-llama``: ``LlamaForCausalLM``, next-token loss; blocks ``LlamaDecoderLayer``.
- ``hf-bert``:  ``BertForMaskedLM``, token-classification loss on every position; blocks ``BertLayer``.
- ``hf-t5``:    ``T5ForConditionalGeneration``, encoder input and decoder input from one tensor;
  blocks ``T5Block`` (encoder and decoder).

Each family and preset is registered whether or not ``transformers`` is installed, so a scenario
naming one validates everywhere; a case that needs it is skipped with the install command
(``fsdpbench.knobs.check_knobs``), and building one raises the same message.
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

from fsdpbench.models import ModelDef, register_model, register_preset

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


# ---- builders -----------------------------------------------------------------------------------
def build_llama(
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int = 192,
    vocab: int = 512,
    max_positions: int = 2048,
    dropout: float = 0.0,
) -> HFModel:
    tf = _transformers("hf-llama")
    config = tf.LlamaConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        attention_dropout=dropout,
        tie_word_embeddings=False,
    )
    return HFModel(tf.LlamaForCausalLM(config), "causal")


def build_bert(
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    vocab: int = 512,
    max_positions: int = 512,
    dropout: float = 0.0,
) -> HFModel:
    tf = _transformers("hf-bert")
    config = tf.BertConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return HFModel(tf.BertForMaskedLM(config), "masked")


def build_t5(
    d_model: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    d_kv: int = 16,
    d_ff: int = 256,
    vocab: int = 512,
    dropout: float = 0.0,
) -> HFModel:
    tf = _transformers("hf-t5")
    config = tf.T5Config(
        d_model=d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        d_kv=d_kv,
        d_ff=d_ff,
        vocab_size=vocab,
        dropout_rate=dropout,
    )
    return HFModel(tf.T5ForConditionalGeneration(config), "seq2seq")


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


def _defaults(builder: Any) -> dict[str, Any]:
    import inspect

    return {k: p.default for k, p in inspect.signature(builder).parameters.items()}


for _name, _builder, _batch, _block_name, _desc in _FAMILIES:
    register_model(
        ModelDef(
            name=_name,
            build=_builder,
            defaults=_defaults(_builder),
            make_batch=_batch,
            loss=_token_loss,
            block_classes=lambda args, m=_name, b=_block_name: (_block(m, b),),
            is_sequence=True,
            description=f"{_desc} ({INSTALL_HINT}); blocks {_block_name}",
            extra={"requires": "transformers", "install": INSTALL_HINT, "block_class_names": (_block_name,)},
        )
    )

register_preset("hf-llama-tiny", "hf-llama", "d64 L2 H4 V512 (172k params)")
register_preset(
    "hf-llama2-7b",
    "hf-llama",
    "Llama-2 7B shape (6,738,415,616 params)",
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    intermediate_size=11008,
    vocab=32000,
    max_positions=4096,
)
register_preset("hf-bert-tiny", "hf-bert", "d64 L2 H4 V512 (171k params)")
register_preset(
    "hf-bert-base",
    "hf-bert",
    "BERT-base shape (109,514,298 params with the MLM head)",
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    intermediate_size=3072,
    vocab=30522,
)
register_preset("hf-t5-tiny", "hf-t5", "d64 L2+2 H4 V512 (263k params)")
register_preset(
    "hf-t5-small",
    "hf-t5",
    "T5-small shape (60,506,624 params)",
    d_model=512,
    num_layers=6,
    num_heads=8,
    d_kv=64,
    d_ff=2048,
    vocab=32128,
)
