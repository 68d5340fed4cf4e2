"""Models: the registry (``fsdpbench/models/registry.py``) and the families declared in it
(``fsdpbench/models/families/``), whose torch side (``decoder.py``, ``mlp.py``, …) is imported only
when a model is built, fed or scored."""

from fsdpbench.models import families  # noqa: F401  (registration)
from fsdpbench.models.registry import (
    ModelDef,
    OwnModel,
    ParamShape,
    Preset,
    build_model,
    check_model_args,
    count_params,
    is_own_model,
    make_global_batch,
    make_samples,
    model_names,
    register_model,
    register_preset,
    resolve_model,
)

__all__ = [
    "ModelDef",
    "OwnModel",
    "ParamShape",
    "Preset",
    "build_model",
    "check_model_args",
    "count_params",
    "is_own_model",
    "make_global_batch",
    "make_samples",
    "model_names",
    "register_model",
    "register_preset",
    "resolve_model",
]
