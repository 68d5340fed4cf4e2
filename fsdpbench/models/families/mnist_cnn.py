"""The PyTorch FSDP tutorial's MNIST network, declared (the torch side: ``fsdpbench/models/mnist_cnn.py``).

No parameter shapes are declared: the memory model reads them from a meta-device build."""

from __future__ import annotations

from fsdpbench.models.registry import ModelDef, TorchSide, register_model

TORCH_SIDE = "fsdpbench.models.mnist_cnn"

register_model(
    ModelDef(
        name="mnist-cnn",
        build=TorchSide(f"{TORCH_SIDE}:Net"),
        defaults={"dropout": True},
        make_batch=TorchSide(f"{TORCH_SIDE}:make_batch"),
        loss=TorchSide("torch.nn.functional:nll_loss"),
        block_classes=TorchSide(f"{TORCH_SIDE}:block_classes"),
        block_class_names=("Conv2d", "Linear"),
        description="FSDP tutorial MNIST CNN (1.2M params), synthetic 28×28 images",
    )
)
