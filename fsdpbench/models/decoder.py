"""A Llama-style decoder: RMSNorm, rotary attention (optionally grouped-query), SwiGLU MLP, untied head.

The torch side of the ``decoder`` family (declared in ``fsdpbench/models/families/decoder.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdpbench.models.families.decoder import default_ffn_dim

# Llama 3.1's RoPE frequency scaling (torchtitan's RoPEScalingArgs defaults)
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_pos": 8192}


def _inv_freq(dim: int, theta: float, scaling: str, device: torch.device) -> torch.Tensor:
    """RoPE's per-pair frequencies, with Llama 3.1's scaling of the low ones where asked."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if scaling != "llama3":
        return inv
    sc = LLAMA3_SCALING
    wavelen = 2 * math.pi / inv
    smooth = (sc["original_max_pos"] / wavelen - sc["low_freq_factor"]) / (
        sc["high_freq_factor"] - sc["low_freq_factor"]
    )
    low = wavelen > sc["original_max_pos"] / sc["low_freq_factor"]
    high = wavelen < sc["original_max_pos"] / sc["high_freq_factor"]
    scaled = torch.where(low, inv / sc["factor"], inv)
    smoothed = (1 - smooth) * inv / sc["factor"] + smooth * inv
    return torch.where(~high & ~low, smoothed, scaled)


def _rope(x: torch.Tensor, theta: float = 10000.0, scaling: str = "none") -> torch.Tensor:
    """Rotary position embedding on (batch, heads, seq, head_dim), adjacent pairs rotated (the real form
    of torchtitan's complex multiply); computed, no parameters."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = _inv_freq(dim, theta, scaling, x.device)
    ang = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        rope_theta: float = 10000.0,
        rope_scaling: str = "none",
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
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
        q, k = _rope(q, self.rope_theta, self.rope_scaling), _rope(k, self.rope_theta, self.rope_scaling)
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
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        ffn_dim: int,
        norm_eps: float,
        rope_theta: float = 10000.0,
        rope_scaling: str = "none",
    ) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.attention = Attention(d_model, n_heads, n_kv_heads, rope_theta, rope_scaling)
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
        multiple_of: int = 32,
        ffn_dim_multiplier: float = 1.0,
        rope_theta: float = 10000.0,
        rope_scaling: str = "none",
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        n_kv_heads = n_kv_heads or n_heads
        ffn_dim = ffn_dim or default_ffn_dim(d_model, multiple_of, ffn_dim_multiplier)
        self.tok_embeddings = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, n_heads, n_kv_heads, ffn_dim, norm_eps, rope_theta, rope_scaling)
            for _ in range(n_layers)
        )
        self.norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.output = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def make_batch(args: dict[str, Any], batch: int, seq_len: int, gen: torch.Generator):
    tokens = torch.randint(0, args["vocab"], (batch, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """torchtitan's cross-entropy: the logits upcast to fp32 (a 16-bit model's loss allocates an fp32 copy
    of them and log-softmaxes that), averaged over the tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def block_classes(args: dict[str, Any]) -> tuple[type[nn.Module], ...]:
    return (TransformerBlock,)
