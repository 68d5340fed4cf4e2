"""The knobs the FSDP guides name, as model transforms and as case rules.

Transforms, applied by the worker in torchtitan's order, before the data-parallel strategy:
activation checkpointing (``apply_activation_checkpointing``) → compile (``apply_compile``) →
strategy (its wrap units are found before either, so they are the model's own blocks).

Case rules, applied by ``scenario.build_case`` to every case of a sweep:
- ``normalize_knobs``: a knob the strategy ignores is reset to its default so equal cases collapse
  (FSDP1's ``backward_prefetch``/``forward_prefetch``/``limit_all_gathers`` on DDP, ZeRO-1, FSDP2);
- ``check_knobs``: a knob the strategy cannot honour skips the case with the reason (``cpu_offload``
  on DDP/ZeRO-1; knobs the model cannot take).

And one measurement: ``state_placement_bytes`` — where the strategy keeps this rank's parameters
(host or compute device), which a CPU run cannot measure because there host and device are one memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fsdpbench.core.case import AC_OP, Case, ac_every
from fsdpbench.core.schema import PLACEMENT
from fsdpbench.engine.ac_policy import ALTERNATING_OPS, SAVED_OPS, STANDIN_OPS, saves_output
from fsdpbench.models import resolve_model
from fsdpbench.strategies.optim import check_optimizer_impl

if TYPE_CHECKING:  # the case rules run without torch (scenario validation, the analytic prediction)
    import torch
    from torch import nn

_DEFAULT = Case()


def _blocks(case: Case) -> tuple[type[nn.Module], ...]:
    mdef, args = resolve_model(case.model, case.model_args)
    return tuple(mdef.block_classes(args))


def apply_activation_checkpointing(model: nn.Module, case: Case) -> nn.Module:
    """Non-reentrant activation checkpointing of the model's blocks (its block classes), as the case's
    policy says, applied as torchtitan applies it:

    - ``full``: every block keeps only its input; its activations are recomputed in backward;
    - ``every:N``: the same for the N-th, 2N-th, ... block in forward order, the others untouched;
    - ``op``: every block saves the outputs of the ops in ``ac_policy.SAVED_OPS`` (every second matmul
      excepted) through ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` and recomputes
      the rest.

    The wrapper is applied in place (``model`` keeps its identity), outermost matching blocks only.
    """
    if not case.activation_checkpointing:
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as _apply_ac,
    )

    policy = case.activation_checkpointing_policy
    blocks = _outermost(model, _blocks(case))
    every = ac_every(policy) or 1
    chosen = {id(m) for i, m in enumerate(blocks) if (i + 1) % every == 0}
    kwargs: dict[str, Any] = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT}
    if policy == AC_OP:
        kwargs["context_fn"] = selective_context_fn()
    _apply_ac(
        model,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, **kwargs),
        check_fn=lambda m: id(m) in chosen,
    )
    return model


def selective_context_fn() -> Callable[[], Any]:
    """torchtitan's op-level policy as a checkpoint ``context_fn``: a fresh matmul count per forward and
    per recompute of a block, so the same matmuls are saved in both."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    names: dict[Any, str] = {}
    for name in SAVED_OPS:
        namespace, _, op = name.partition(".")
        overload = getattr(getattr(torch.ops, namespace, None), op, None)
        if overload is not None and hasattr(overload, "default"):
            names[overload.default] = name

    def context_fn() -> Any:
        counts = {"forward": 0, "recompute": 0}

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            name = names.get(func) or STANDIN_OPS.get(func)
            if name is None:
                return CheckpointPolicy.PREFER_RECOMPUTE
            mode = "recompute" if ctx.is_recompute else "forward"
            if name in ALTERNATING_OPS:
                counts[mode] += 1
            if saves_output(name, counts[mode]):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def apply_compile(model: nn.Module, case: Case) -> nn.Module:
    """``torch.compile`` each block in place (per-block compile composes with FSDP, as in torchtitan).

    Compilation happens lazily in the first step: its cost shows in ``first_step_ms`` /
    ``warmup_times_ms``, never in the timed steps (use ``warmup_steps >= 2`` so they are warm).
    """
    if not case.compile:
        return model
    for module in _outermost(model, _blocks(case)):
        module.compile()
    return model


def _outermost(model: nn.Module, classes: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """Modules of the given classes that are not inside another one (no nested checkpoint/compile)."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, classes):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


# ---- case rules ---------------------------------------------------------------------------------
def normalize_knobs(case: Case, strategy: Any) -> Case:
    """Reset knobs the strategy ignores to their defaults, so a sweep over them collapses to one case."""
    from fsdpbench.strategies.base import STRATEGY_KNOBS

    ignored = [k for k in STRATEGY_KNOBS if k not in strategy.reads_knobs]
    return case.replace(**{k: getattr(_DEFAULT, k) for k in ignored}) if ignored else case


def check_knobs(case: Case, strategy: Any) -> str | None:
    """Why this strategy or model cannot take the case's knobs (a sentence), or None."""
    missing = missing_requirement(case.model)
    if missing:
        return missing
    if case.cpu_offload and not strategy.supports_cpu_offload:
        return (
            f"cpu_offload applies to FSDP strategies (zero2, zero3, hsdp, fsdp1_*); "
            f"{strategy.name} keeps every state on the compute device"
        )
    wrong_impl = check_optimizer_impl(case)
    if wrong_impl:
        return wrong_impl
    if (case.activation_checkpointing or case.compile) and not resolve_model(case.model)[0].block_class_names:
        knob = "activation_checkpointing" if case.activation_checkpointing else "compile"
        return f"{knob} is applied per block and model {case.model!r} declares no block classes"
    return None


def missing_requirement(model: str) -> str | None:
    """A model from an optional extra whose package is not installed: the install command."""
    import importlib.util

    mdef, _ = resolve_model(model)
    package = mdef.extra.get("requires")
    if package and importlib.util.find_spec(package) is None:
        return f"model {model!r} needs {package}: {mdef.extra.get('install', 'pip install ' + package)}"
    return None


# ---- where the strategy keeps the parameters ------------------------------------------------------
def state_placement_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's resident parameter bytes by where the strategy keeps them: host (CPU offload) or device.

    Read from the strategy's own bookkeeping — FSDP1 ``FlatParamHandle._offload_params``, FSDP2
    ``FSDPParam.offload_to_cpu`` — so it means the same on a CPU run (where host and device are one
    memory and no tracker can tell them apart) as on a GPU (where the tracker's per-device breakdown
    measures the same split). Other strategies keep every parameter on the compute device.
    """
    host = device = 0
    seen: set[int] = set()

    def add(t: torch.Tensor, offloaded: bool) -> None:
        nonlocal host, device
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or not storage.nbytes():
            return
        seen.add(storage.data_ptr())
        if offloaded:
            host += storage.nbytes()
        else:
            device += storage.nbytes()

    fsdp1 = _fsdp1_handles(model)
    fsdp2 = _fsdp2_params(model)
    for handle in fsdp1:
        add(getattr(handle.flat_param, "_local_shard", handle.flat_param), bool(handle._offload_params))
    for fsdp_param in fsdp2:
        add(fsdp_param._sharded_param_data, bool(fsdp_param.offload_to_cpu))
    if not fsdp1 and not fsdp2:
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            add(local, False)
    return {PLACEMENT.of("host"): host, PLACEMENT.of("device"): device}


def _fsdp1_handles(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

    return _get_fsdp_handles(model) if isinstance(model, FullyShardedDataParallel) else []


def _fsdp2_params(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    out = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [state._fsdp_param_group] if state._fsdp_param_group else []
        for group in groups:
            out.extend(group.fsdp_params)
    return out
