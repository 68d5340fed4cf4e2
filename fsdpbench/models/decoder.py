"""A Llama-style decoder: RMSNorm, rotary attention (optionally grouped-query), SwiGLU MLP, untied head.

Presets reproduce the published parameter counts of Llama-2 7B/13B/70B exactly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdpbench.models.registry import ModelDef, register_model, register_preset


def _rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding on (batch, heads, seq, head_dim); computed, no parameters."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    ang = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.wq = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q), _rope(k)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, ffn_dim, bias=False)
        self.w3 = nn.Linear(d_model, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, ffn_dim: int, norm_eps: float) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.attention = Attention(d_model, n_heads, n_kv_heads)
        self.ffn_norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.feed_forward = FeedForward(d_model, ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(
        self,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        n_kv_heads: int | None = None,
        vocab: int = 512,
        ffn_dim: int | None = None,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        n_kv_heads = n_kv_heads or n_heads
        ffn_dim = ffn_dim or default_ffn_dim(d_model)
        self.tok_embeddings = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, n_heads, n_kv_heads, ffn_dim, norm_eps) for _ in range(n_layers)
        )
        self.norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.output = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def default_ffn_dim(d_model: int, multiple_of: int = 32) -> int:
    """Llama's SwiGLU width: 2/3 of 4·d, rounded up to a multiple."""
    hidden = int(2 * 4 * d_model / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _make_batch(args: dict[str, Any], batch: int, seq_len: int, gen: torch.Generator):
    tokens = torch.randint(0, args["vocab"], (batch, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _check_args(args: dict[str, Any]) -> str | None:
    """What Decoder's constructor and attention need of the widths and head counts."""
    n_kv = args["n_kv_heads"] or args["n_heads"]
    if args["d_model"] % args["n_heads"]:
        return f"n_heads: d_model={args['d_model']} is not divisible by n_heads={args['n_heads']}"
    if args["n_heads"] % n_kv:
        return f"n_kv_heads: n_heads={args['n_heads']} is not divisible by n_kv_heads={n_kv}"
    return None


register_model(
    ModelDef(
        name="decoder",
        build=Decoder,
        defaults={
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": None,
            "vocab": 512,
            "ffn_dim": None,
            "norm_eps": 1e-5,
        },
        make_batch=_make_batch,
        loss=_loss,
        block_classes=lambda args: (TransformerBlock,),
        is_sequence=True,
        check_args=_check_args,
        description="Llama-style decoder (d_model, n_layers, n_heads, n_kv_heads, vocab, ffn_dim)",
    )
)
register_preset(
    "decoder-tiny",
    "decoder",
    "d64 L2 H4 V512 (~172k params): seconds on a CPU",
    d_model=64,
    n_layers=2,
    n_heads=4,
    vocab=512,
)
register_preset(
    "decoder-mini",
    "decoder",
    "d128 L4 H4 V256 (~0.87M params): model states dominate memory",
    d_model=128,
    n_layers=4,
    n_heads=4,
    vocab=256,
)
register_preset(
    "decoder-small",
    "decoder",
    "d256 L4 H8 V4096 (~5.3M params)",
    d_model=256,
    n_layers=4,
    n_heads=8,
    vocab=4096,
)
register_preset(
    "decoder-base",
    "decoder",
    "d768 L12 H12 V32000 (~134M params)",
    d_model=768,
    n_layers=12,
    n_heads=12,
    vocab=32000,
)
register_preset(
    "llama-7b",
    "decoder",
    "Llama-2 7B (6,738,415,616 params)",
    d_model=4096,
    n_layers=32,
    n_heads=32,
    vocab=32000,
    ffn_dim=11008,
)
register_preset(
    "llama-13b",
    "decoder",
    "Llama-2 13B (13,015,864,320 params)",
    d_model=5120,
    n_layers=40,
    n_heads=40,
    vocab=32000,
    ffn_dim=13824,
)
register_preset(
    "llama-70b",
    "decoder",
    "Llama-2 70B, GQA 8 kv heads (68,976,648,192 params)",
    d_model=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    vocab=32000,
    ffn_dim=28672,
)
