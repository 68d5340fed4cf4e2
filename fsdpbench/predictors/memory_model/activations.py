"""Activation memory of one training step, stage by stage, counted from what autograd saves in *this*
implementation (fsdpbench/models/decoder.py, mlp.py) on the target device — not fitted to any
measurement. What the norm and attention kernels save differs by device and dtype: kernels.py says what.

A step is a list of stages in forward order (decoder: embedding, blocks, head with the loss). Each
stage keeps ``saved_bytes`` from its forward until its backward, and its backward passes through a
few named moments (what of its own saved tensors is still alive, which of its parameters already
have gradients, and the gradient temporaries alive then). ``timeline.py`` walks these stages.

Compute modes: ``fp32``; ``pure16`` — FSDP's MixedPrecisionPolicy runs the whole model in 16 bits
(RMSNorm upcasts internally, SDPA's logsumexp and the loss stay fp32); ``autocast16`` — DDP/ZeRO-1
under ``torch.autocast``: the residual stream and norms stay fp32, every Linear saves its own 16-bit
copy of its input, and autocast's cached 16-bit weight copies stay alive until their backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsdpbench.core.case import AC_FULL, AC_OP, ac_every
from fsdpbench.engine.ac_policy import saves_output
from fsdpbench.predictors.memory_model.kernels import ASSUMED_CASE, kernels_for, storage_bytes

FP32, PURE16, AUTOCAST16 = "fp32", "pure16", "autocast16"


@dataclass(frozen=True, slots=True)
class BwdMoment:
    label: str
    saved_left_bytes: int  # this stage's saved tensors still alive (recomputed ones included, with AC)
    grads_done: tuple[str, ...]  # parameters of this stage whose gradients exist at this moment
    temp_bytes: int  # gradients of activations and other temporaries alive at this moment
    pre_backward: bool = False  # the stage's output gradient just arrived: FSDP's pre-backward unshards here


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    params: tuple[str, ...]
    saved_bytes: int  # kept from this stage's forward to its backward
    fwd_extra_bytes: int  # alive only at the end of its forward (logits while the loss runs)
    bwd: tuple[BwdMoment, ...]
    # the head only: what its module forward holds before the loss runs outside the model
    # (saved so far, and the logits), when FSDP still holds the last all-gather output
    in_model: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class ActivationProfile:
    inputs_bytes: int  # the step's batch: the worker slices views of the global batch, which stays alive
    stages: tuple[Stage, ...]
    mode: str
    kernel_note: str = ""  # the kernel choices assumed, where they depend on versions, hardware or shapes
    scalar_bytes: int = 4  # one fp32 scalar's storage on the device (the loss, its seed gradient)

    @property
    def saved_bytes(self) -> int:
        return sum(s.saved_bytes for s in self.stages)


@dataclass(frozen=True, slots=True)
class Shape:
    """What activations depend on besides the model: per-rank batch, sequence, global batch."""

    batch: int
    seq_len: int
    global_batch: int
    mode: str = FP32
    checkpointing: bool = False
    checkpoint_policy: str = AC_FULL  # with checkpointing: full, op or every:N (fsdpbench/core/case.py)
    device: str = "cpu"  # whose kernels run (kernels.py), and CUDA's 512-byte rounding of every storage


def get_activation_profile(family: str, args: dict[str, Any], shape: Shape) -> ActivationProfile | None:
    """The profile for a model family, or None when fsdpbench has no activation model for it."""
    fn = _PROFILES.get(family)
    return fn(args, shape) if fn else None


# ---- decoder ---------------------------------------------------------------------------------------
def _decoder(a: dict[str, Any], sh: Shape) -> ActivationProfile:
    from fsdpbench.models.families.decoder import default_ffn_dim

    d, layers, heads, vocab = a["d_model"], a["n_layers"], a["n_heads"], a["vocab"]
    kv = a.get("n_kv_heads") or heads
    hd, f = d // heads, a.get("ffn_dim") or default_ffn_dim(d)
    b, s = sh.batch, sh.seq_len
    tok = b * s
    bd, bf, kvd = tok * d, tok * f, tok * kv * hd
    e = 4 if sh.mode == FP32 else 2  # matmul/attention path
    res = 2 if sh.mode == PURE16 else 4  # residual stream and norm inputs
    norm, attn = kernels_for(sh.device, sh.mode != FP32)

    def r(nbytes: int) -> int:  # one tensor's storage
        return storage_bytes(nbytes, sh.device)

    def norm_bytes() -> int:
        # beyond its input: the fused kernel saves an fp32 (b, s, 1) rstd; the decomposed one also the
        # normalised fp32 result, and in pure16 an fp32 copy of its input instead of the input. The
        # output (norm·weight, compute dtype) is saved by the Linear(s) that read it.
        if norm.fused:
            return r(4 * tok)
        upcast = r(4 * bd) if sh.mode == PURE16 else 0
        return upcast + r(4 * tok) + r(4 * bd)

    if sh.mode == AUTOCAST16:
        norm_out_attn, norm_out_ffn = 3 * r(2 * bd), 2 * r(2 * bd)  # each Linear saves its own 16-bit cast
    else:
        norm_out_attn = norm_out_ffn = r(e * bd)  # one tensor, saved by wq/wk/wv (w1/w3)
    # the residual stream is saved by the norms that read it, unless they save an fp32 copy instead
    keeps_residual = norm.fused or sh.mode != PURE16
    block_input = r(res * bd) if keeps_residual else 0
    h1 = r(res * bd) if keeps_residual else 0  # residual after attention (saved by ffn_norm)
    lse = 4 * math.prod(attn.lse_shape(b, heads, s))  # fp32 logsumexp
    attention = (
        2 * r(e * bd)
        + 2 * r(e * kvd)  # q, out; k, v
        + (0 if attn.output_heads_last else r(e * bd))  # the (b, s, h·d) copy of out that wo reads
        + r(lse)
        + (2 * r(8) if attn.rng_state else 0)  # RNG seed and offset (int64 scalars)
    )
    rope = 4 * r(s * (hd // 2) * e)  # cos and sin for q and for k (s × hd/2 each)
    ffn = 4 * r(e * bf)  # w1 out, silu out, w3 out, product
    block_saved = block_input + 2 * norm_bytes() + norm_out_attn + norm_out_ffn + attention + rope + h1 + ffn
    autocast_weights = (
        2 * ((heads + 2 * kv) * hd * d + d * heads * hd + 3 * d * f) if sh.mode == AUTOCAST16 else 0
    )
    block_saved += autocast_weights
    # the block's matmuls in forward order (output bytes): what the op-level policy saves of them
    matmuls = (r(e * bd), r(e * kvd), r(e * kvd), r(e * bd), r(e * bf), r(e * bf), r(e * bd))
    sac_saved = sum(nbytes for i, nbytes in enumerate(matmuls, 1) if saves_output("aten.mm", i))
    if saves_output(attn.op, 0):  # the kernel's outputs: attention output, logsumexp, RNG state
        sac_saved += r(e * bd) + r(lse) + (2 * r(8) if attn.rng_state else 0)

    blocks = []
    for i in range(layers):
        p = f"layers.{i}."
        names = tuple(
            p + n
            for n in (
                "attention_norm.weight",
                "attention.wq.weight",
                "attention.wk.weight",
                "attention.wv.weight",
                "attention.wo.weight",
                "ffn_norm.weight",
                "feed_forward.w1.weight",
                "feed_forward.w3.weight",
                "feed_forward.w2.weight",
            )
        )
        # op policy: the recompute stops once the last tensor backward needs is saved (early stop) — as
        # w2's matmul saves its input, before it runs — so w2's cached output stays with the checkpoint
        # until the block's backward is done
        held = matmuls[-1] if _op_checkpointed(sh) and saves_output("aten.mm", len(matmuls)) else 0
        bwd = (
            BwdMoment(
                "start", block_saved + held, (), res * bd, pre_backward=True
            ),  # grad of the block output
            # w2 backward then the SwiGLU product: grad of the block output, grad of w2's input and the
            # two gradients of the product alive together
            BwdMoment(
                "ffn", block_saved - e * bf + held, (p + "feed_forward.w2.weight",), res * bd + 3 * e * bf
            ),
            # end of the block: every parameter has its gradient; grads w.r.t. the block input and residual
            BwdMoment("end", 0, names, 2 * res * bd),
        )
        blocks.append(Stage(f"block{i}", names, _kept(sh, i, block_saved, res * bd, sac_saved), 0, bwd))

    logits_e = r(e * tok * vocab)
    logsm = r(4 * tok * vocab)  # log_softmax of fp32 logits (the loss upcasts 16-bit logits)
    head_autocast = r(2 * vocab * d) if sh.mode == AUTOCAST16 else 0
    loss_scalar = r(8)  # nll_loss's total weight
    head_saved = (
        block_input
        + norm_bytes()
        + r(2 * bd if sh.mode == AUTOCAST16 else e * bd)
        + logsm
        + loss_scalar
        + head_autocast
    )
    head = Stage(
        "head",
        ("norm.weight", "output.weight"),
        head_saved,
        logits_e + (r(4 * tok * vocab) if e != 4 else 0),
        (
            BwdMoment("loss", head_saved, (), 2 * 4 * tok * vocab),  # nll grad + log_softmax grad, fp32
            BwdMoment("logits grad", head_saved - logsm, (), logits_e, pre_backward=True),
            BwdMoment("output", head_saved - logsm, ("output.weight",), logits_e + e * bd),
            BwdMoment("end", 0, ("norm.weight", "output.weight"), 2 * res * bd),
        ),
        in_model=(head_saved - logsm - loss_scalar, logits_e),
    )
    emb = Stage(
        "embedding",
        ("tok_embeddings.weight",),
        0,
        0,
        (BwdMoment("end", 0, ("tok_embeddings.weight",), res * bd),),
    )
    inputs = 2 * sh.global_batch * s * 8  # tokens and targets (int64) of the global batch
    return ActivationProfile(inputs, (emb, *blocks, head), sh.mode, ASSUMED_CASE.get(sh.device, ""), r(4))


def _op_checkpointed(sh: Shape) -> bool:
    return sh.checkpointing and sh.checkpoint_policy == AC_OP


def _kept(sh: Shape, block: int, saved: int, block_input: int, selected: int) -> int:
    """What block ``block`` keeps from its forward to its backward under the case's checkpointing: all it
    saves (not checkpointed), its input (checkpointed whole), or its input and the outputs the op-level
    policy selects (``selected``). A checkpointed block recomputes the rest at the start of its backward."""
    if not sh.checkpointing:
        return saved
    if sh.checkpoint_policy == AC_OP:
        return block_input + selected
    every = ac_every(sh.checkpoint_policy) or 1
    return block_input if (block + 1) % every == 0 else saved


# ---- MLP -------------------------------------------------------------------------------------------
def _mlp(a: dict[str, Any], sh: Shape) -> ActivationProfile:
    w, depth, classes = a["width"], a["depth"], a["n_classes"]
    b = sh.batch
    e = 4 if sh.mode == FP32 else 2

    def r(nbytes: int) -> int:  # one tensor's storage (CUDA: 512-byte blocks)
        return storage_bytes(nbytes, sh.device)

    act = r(e * b * w)  # one (b, w) activation or its gradient
    stages = []
    for i in range(depth):
        names = (f"blocks.{i}.fc.weight", f"blocks.{i}.fc.bias")
        saved = act  # ReLU output (also the next Linear's input)
        if i == 0 and sh.mode != FP32:
            saved += r(2 * b * w)  # the 16-bit copy of the fp32 input batch (autocast or FSDP input cast)
        if sh.mode == AUTOCAST16:
            saved += r(2 * w * w) + r(2 * w)  # autocast's cached 16-bit weight and bias
        kept = (0 if i == 0 else act) if sh.checkpointing else saved
        recomputed = act if sh.checkpointing else 0  # held by the checkpoint until the block is done
        bwd = (
            BwdMoment("start", saved, (), act, pre_backward=True),
            BwdMoment("relu", saved, (), 2 * act),
            BwdMoment("end", recomputed, names, 2 * act),  # Linear backward: grad out and grad in
        )
        stages.append(Stage(f"block{i}", names, kept, 0, bwd))
    logsm_e = 4 if sh.mode != PURE16 else 2
    logsm = r(logsm_e * b * classes)
    loss_scalars = 2 * r(4)  # the loss and cross-entropy's total weight, fp32 scalars
    logits = r(e * b * classes)
    head_saved = logsm + loss_scalars + (r(2 * classes * w) + r(2 * classes) if sh.mode == AUTOCAST16 else 0)
    head = Stage(
        "head",
        ("head.weight", "head.bias"),
        head_saved,
        logits,
        (
            BwdMoment("loss", head_saved, (), 2 * logsm),
            BwdMoment("logits grad", head_saved - logsm, (), logits, pre_backward=True),
            BwdMoment("end", 0, ("head.weight", "head.bias"), act),
        ),
        in_model=(head_saved - logsm - loss_scalars, logits),
    )
    # what engine/step.rank_batch keeps: on a GPU, ``.to("cuda")`` copies the rank's rows (the global batch
    # stays in host memory, which the device's tracker does not count); on the CPU the rows are views
    if sh.device == "cuda":
        inputs = r(b * w * 4) + r(b * 8)  # fp32 features, int64 labels
    else:
        inputs = sh.global_batch * w * 4 + sh.global_batch * 8
    return ActivationProfile(inputs, (*stages, head), sh.mode, scalar_bytes=r(4))


_PROFILES: dict[str, Callable[[dict[str, Any], Shape], ActivationProfile]] = {
    "decoder": _decoder,
    "mlp": _mlp,
}
