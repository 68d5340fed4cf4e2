"""The MLP family, declared: ``depth`` blocks of Linear(width, width) + ReLU, then a classifier head
(the torch side: ``fsdpbench/models/mlp.py``)."""

from __future__ import annotations

from typing import Any

from fsdpbench.models.registry import ModelDef, ParamShape, TorchSide, register_model, register_preset

TORCH_SIDE = "fsdpbench.models.mlp"


def param_shapes(a: dict[str, Any]) -> tuple[tuple[ParamShape, ...], int]:
    """``MLP``'s parameters in ``model.parameters()`` order (block = ``MLPBlock``; the head at the root)."""
    w, depth, classes = a["width"], a["depth"], a["n_classes"]
    out = []
    for i in range(depth):
        out += [
            ParamShape(f"blocks.{i}.fc.weight", (w, w), i, True),
            ParamShape(f"blocks.{i}.fc.bias", (w,), i, True),
        ]
    out += [ParamShape("head.weight", (classes, w), -1, True), ParamShape("head.bias", (classes,), -1, True)]
    return tuple(out), depth


register_model(
    ModelDef(
        name="mlp",
        build=TorchSide(f"{TORCH_SIDE}:MLP"),
        defaults={"width": 256, "depth": 4, "n_classes": 10},
        make_batch=TorchSide(f"{TORCH_SIDE}:make_batch"),
        loss=TorchSide("torch.nn.functional:cross_entropy"),
        block_classes=TorchSide(f"{TORCH_SIDE}:block_classes"),
        block_class_names=("MLPBlock",),
        param_shapes=param_shapes,
        description="MLP of `depth` Linear+ReLU blocks of `width`",
    )
)
register_preset("mlp-tiny", "mlp", "MLP 64 wide, 2 deep (~9k params)", width=64, depth=2)
register_preset("mlp-1m", "mlp", "MLP 512 wide, 4 deep (~1.05M params)", width=512, depth=4)
