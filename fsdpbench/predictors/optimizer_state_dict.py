"""What torch's ``optimizer.state_dict()`` holds for each optimizer fsdpbench runs: the checkpoint
predictors (``checkpoint``, ``deepspeed_checkpoint``) lay out its entries from these."""

from __future__ import annotations

from typing import Any

# per optimizer, torch 2.13's state per parameter (name, scalar?) and its param_group entries, in the
# order optimizer.state_dict() writes them
OPTIMIZER_STATE: dict[str, tuple[tuple[str, bool], ...]] = {
    "adamw": (("step", True), ("exp_avg", False), ("exp_avg_sq", False)),
    "adam": (("step", True), ("exp_avg", False), ("exp_avg_sq", False)),
    "sgd": (),
    "sgd-momentum": (("momentum_buffer", False),),
    "adadelta": (("step", True), ("square_avg", False), ("acc_delta", False)),
}
_ADAM_GROUP = {
    "betas": (0.9, 0.999),
    "eps": 1e-08,
    "amsgrad": False,
    "maximize": False,
    "foreach": False,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}
PARAM_GROUP: dict[str, dict[str, Any]] = {
    "adamw": {**_ADAM_GROUP, "weight_decay": 0.01, "decoupled_weight_decay": True},
    "adam": {**_ADAM_GROUP, "weight_decay": 0, "decoupled_weight_decay": False},
}
