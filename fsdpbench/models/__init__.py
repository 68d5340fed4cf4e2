"""Models: the registry (``fsdpbench/models/registry.py``) and the families that register themselves in
it, one file each, imported here."""

from fsdpbench.models import decoder, hf, mlp, mnist_cnn  # noqa: F401  (registration)
from fsdpbench.models.registry import (
    ModelDef,
    Preset,
    build_model,
    check_model_args,
    count_params,
    make_global_batch,
    model_names,
    register_model,
    register_preset,
    resolve_model,
)

__all__ = [
    "ModelDef",
    "Preset",
    "build_model",
    "check_model_args",
    "count_params",
    "make_global_batch",
    "model_names",
    "register_model",
    "register_preset",
    "resolve_model",
]
