"""The Llama-style decoder family, declared: its arguments and presets, its blocks and every parameter's
shape (the torch side, ``fsdpbench/models/decoder.py``, builds what this declares).

Presets reproduce the published parameter counts of Llama-2 7B/13B/70B exactly, and torchtitan's Llama 3
flavors (``torchtitan/models/llama3``: grouped-query attention with 8 KV heads, a 128,256-token vocabulary,
RoPE θ = 500,000 with Llama 3.1's frequency scaling, the SwiGLU width rule with ``multiple_of`` and
``ffn_dim_multiplier``, an untied output head) to the parameter.
"""

from __future__ import annotations

from typing import Any

from fsdpbench.models.registry import ModelDef, ParamShape, TorchSide, register_model, register_preset

TORCH_SIDE = "fsdpbench.models.decoder"


ROPE_SCALINGS = ("none", "llama3")  # llama3: Llama 3.1's frequency scaling, as torchtitan applies it


def default_ffn_dim(d_model: int, multiple_of: int = 32, ffn_dim_multiplier: float = 1.0) -> int:
    """Llama's SwiGLU width, as torchtitan's ``FeedForward`` sizes it: 2/3 of 4·d, times the multiplier,
    rounded up to a multiple of ``multiple_of``."""
    hidden = int(2 * 4 * d_model / 3)
    hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def ffn_dim(args: dict[str, Any]) -> int:
    """The SwiGLU width of a full argument set: ``ffn_dim`` when given, else the sizing rule."""
    return args.get("ffn_dim") or default_ffn_dim(
        args["d_model"], args.get("multiple_of", 32), args.get("ffn_dim_multiplier", 1.0)
    )


def _check_args(args: dict[str, Any]) -> str | None:
    """What Decoder's constructor and attention need of the widths, head counts and RoPE."""
    n_kv = args["n_kv_heads"] or args["n_heads"]
    if args["d_model"] % args["n_heads"]:
        return f"n_heads: d_model={args['d_model']} is not divisible by n_heads={args['n_heads']}"
    if args["n_heads"] % n_kv:
        return f"n_kv_heads: n_heads={args['n_heads']} is not divisible by n_kv_heads={n_kv}"
    if (args["d_model"] // args["n_heads"]) % 2:
        return f"n_heads: the head dimension {args['d_model'] // args['n_heads']} is odd (RoPE rotates pairs)"
    if args["rope_scaling"] not in ROPE_SCALINGS:
        return f"rope_scaling: {args['rope_scaling']!r} is not one of {', '.join(ROPE_SCALINGS)}"
    return None


def param_shapes(a: dict[str, Any]) -> tuple[tuple[ParamShape, ...], int]:
    """``Decoder``'s parameters in ``model.parameters()`` order (block = layer; embedding, final norm
    and head at the root)."""
    d, layers, heads, vocab = a["d_model"], a["n_layers"], a["n_heads"], a["vocab"]
    kv = a.get("n_kv_heads") or heads
    hd = d // heads
    ffn = ffn_dim(a)
    out = [ParamShape("tok_embeddings.weight", (vocab, d), -1)]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            ParamShape(p + "attention_norm.weight", (d,), i),
            ParamShape(p + "attention.wq.weight", (heads * hd, d), i, True),
            ParamShape(p + "attention.wk.weight", (kv * hd, d), i, True),
            ParamShape(p + "attention.wv.weight", (kv * hd, d), i, True),
            ParamShape(p + "attention.wo.weight", (d, heads * hd), i, True),
            ParamShape(p + "ffn_norm.weight", (d,), i),
            ParamShape(p + "feed_forward.w1.weight", (ffn, d), i, True),
            ParamShape(p + "feed_forward.w3.weight", (ffn, d), i, True),
            ParamShape(p + "feed_forward.w2.weight", (d, ffn), i, True),
        ]
    out += [ParamShape("norm.weight", (d,), -1), ParamShape("output.weight", (vocab, d), -1, True)]
    return tuple(out), layers


register_model(
    ModelDef(
        name="decoder",
        build=TorchSide(f"{TORCH_SIDE}:Decoder"),
        defaults={
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": None,
            "vocab": 512,
            "ffn_dim": None,
            "norm_eps": 1e-5,
            # the SwiGLU sizing rule when ffn_dim is not given (torchtitan's names; its multiple_of
            # defaults to 256, fsdpbench's decoder has always rounded to 32)
            "multiple_of": 32,
            "ffn_dim_multiplier": 1.0,
            "rope_theta": 10000.0,
            "rope_scaling": "none",
        },
        make_batch=TorchSide(f"{TORCH_SIDE}:make_batch"),
        loss=TorchSide(f"{TORCH_SIDE}:loss"),
        block_classes=TorchSide(f"{TORCH_SIDE}:block_classes"),
        block_class_names=("TransformerBlock",),
        is_sequence=True,
        check_args=_check_args,
        param_shapes=param_shapes,
        description=(
            "Llama-style decoder (d_model, n_layers, n_heads, n_kv_heads, vocab, ffn_dim or multiple_of and "
            "ffn_dim_multiplier, rope_theta, rope_scaling)"
        ),
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


# torchtitan's Llama 3 flavors (torchtitan/models/llama3/__init__.py: 8B, 70B, 405B)
LLAMA3 = dict(n_kv_heads=8, vocab=128256, rope_theta=500000.0, rope_scaling="llama3")
register_preset(
    "llama3-8b",
    "decoder",
    "Llama 3.1 8B as torchtitan builds it (8,030,261,248 params)",
    d_model=4096,
    n_layers=32,
    n_heads=32,
    multiple_of=1024,
    ffn_dim_multiplier=1.3,
    **LLAMA3,
)
register_preset(
    "llama3-70b",
    "decoder",
    "Llama 3.1 70B as torchtitan builds it (70,553,706,496 params)",
    d_model=8192,
    n_layers=80,
    n_heads=64,
    multiple_of=4096,
    ffn_dim_multiplier=1.3,
    **LLAMA3,
)
register_preset(
    "llama3-405b",
    "decoder",
    "Llama 3.1 405B as torchtitan builds it (405,853,388,800 params)",
    d_model=16384,
    n_layers=126,
    n_heads=128,
    multiple_of=4096,
    ffn_dim_multiplier=1.2,
    **LLAMA3,
)
# the same rules at CPU size: 4 query heads per KV head as in llama3-8b, a small vocabulary
register_preset(
    "llama3-tiny",
    "decoder",
    "Llama 3 rules at d64 L2 H8 KV2 V512 (GQA 4:1, θ 500k, ffn 256): seconds on a CPU",
    d_model=64,
    n_layers=2,
    n_heads=8,
    multiple_of=64,
    ffn_dim_multiplier=1.3,
    **{**LLAMA3, "n_kv_heads": 2, "vocab": 512},
)
register_preset(
    "llama3-mini",
    "decoder",
    "Llama 3 rules at d256 L4 H8 KV2 V2048 (GQA 4:1, θ 500k, ffn 1024)",
    d_model=256,
    n_layers=4,
    n_heads=8,
    multiple_of=256,
    ffn_dim_multiplier=1.3,
    **{**LLAMA3, "n_kv_heads": 2, "vocab": 2048},
)
