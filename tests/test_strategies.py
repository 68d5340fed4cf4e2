"""Strategies declare what they are, and nothing outside ``fsdpbench/strategies/`` names one: a plugin
in one file gets its communication pattern, analytic volume, colour, order and labels from its
declaration alone."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fsdpbench
from fsdpbench.core.case import Case
from fsdpbench.metrics.profiled import analyze_profile
from fsdpbench.report.data import build_case_frame, case_labels
from fsdpbench.report.panel import ordered_strategies, strategy_color
from fsdpbench.report.synthetic import synthetic_results
from fsdpbench.strategies import find_strategy, get_strategy, register_strategy, strategy_names
from tests.plugins.hybrid_keep_params import HybridKeepParams

PACKAGE = Path(fsdpbench.__file__).parent


NAMES = PACKAGE / "core" / "names.py"  # the strategies other modules name by role, named once


def test_no_strategy_is_named_outside_the_strategy_files() -> None:
    names = "|".join(map(re.escape, strategy_names()))
    quoted = re.compile(f"[\"']({names})[\"']")
    hits = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "strategies" and path != NAMES
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if quoted.search(line)
    ]
    assert hits == []


def test_the_registry_and_the_torch_free_modules_import_no_torch() -> None:
    # store.results: what `regress` and `report` read runs with (engine/reference.py's arithmetic)
    modules = (
        "strategies",
        "core.case",
        "core.schema",
        "analysis.regress",
        "analysis.summary",
        "commands.regress",
        "commands.report",
        "store.results",
        "report",
    )
    imports = ", ".join(f"fsdpbench.{m}" for m in modules)
    code = f"import sys, {imports}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_plugin_declares_its_comm_pattern_and_analytic_volume(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": []}))
    case = Case(strategy=HybridKeepParams.name, world_size=8, shard_size=4)
    columns = analyze_profile(trace, case, get_strategy(HybridKeepParams.name).sharding, n_params=250)
    assert columns["comm_pattern"] == "hsdp"  # shard groups, reduce-scattered gradients
    # 1000 fp32 bytes; one all-gather and one reduce-scatter in groups of 4, then the gradient shards
    # all-reduced across 2 replicas: 3/4·1000, 3/4·1000, 2·(1/2)·1000/4
    predicted = {k: columns[f"comm_pred_{k}_bytes"] for k in ("all_gather", "reduce_scatter", "all_reduce")}
    assert predicted == {"all_gather": 750.0, "reduce_scatter": 750.0, "all_reduce": 250.0}


def test_a_plugin_gets_its_colour_order_and_shard_label_in_the_report() -> None:
    rows = synthetic_results()
    last = rows["strategy"].iloc[-1]  # the resharding strategy's cases stand in for the plugin's
    plugin = rows["strategy"] == last
    rows.loc[plugin, "strategy"] = HybridKeepParams.name
    rows.loc[plugin, "shard_size"] = 2
    cases = build_case_frame(rows.assign(run="syn"))
    assert strategy_color(HybridKeepParams.name) == HybridKeepParams.color
    assert ordered_strategies(cases)[-1] == HybridKeepParams.name  # after every built-in
    labels = [label for label, s in zip(case_labels(cases), cases["strategy"]) if s == HybridKeepParams.name]
    assert labels and all(" shard=2" in label for label in labels)


def test_a_strategy_is_registered_once() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_strategy(HybridKeepParams)


def test_find_strategy_imports_no_plugin() -> None:
    assert find_strategy("tests.plugins.hybrid_keep_params:HybridKeepParams") is HybridKeepParams
    assert find_strategy("not_imported_anywhere:Strategy") is None
    assert "not_imported_anywhere" not in sys.modules


@pytest.mark.parametrize(
    "fields",
    [
        {"params": True, "params_unsharded_fwd_to_bwd": True, "param_gathers": 2},  # kept, yet gathered twice
        {"params": True, "param_gathers": 1},  # gathered once, yet resharded after forward
        {"params": True, "param_gathers": 0},  # sharded and never gathered
        {"params": False, "param_gathers": 1},  # replicated, yet gathered
        {"params": False, "params_unsharded_fwd_to_bwd": True},
    ],
)
def test_a_sharding_that_contradicts_itself_is_refused(fields: dict) -> None:
    from fsdpbench.strategies.base import Sharding

    with pytest.raises(ValueError, match="Sharding: "):
        Sharding(grads=True, optim=True, **{"params": False, **fields})


def test_every_registered_strategy_declares_a_consistent_sharding() -> None:
    # the declarations are built on import; a contradiction would raise there
    shardings = {name: get_strategy(name).sharding for name in strategy_names()}
    kept = {name for name, s in shardings.items() if s.params_unsharded_fwd_to_bwd}
    assert kept == {name for name, s in shardings.items() if s.params and s.param_gathers == 1}
    assert kept  # SHARD_GRAD_OP-style strategies exist among the built-ins


def test_no_module_outside_the_strategy_files_tests_an_engine_version_or_a_strategy_class() -> None:
    identity = re.compile(r"fsdp_version|DeepSpeedEngine|isinstance\([^)]*ZeroRedundancyOptimizer")
    hits = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "strategies"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if identity.search(line)
    ]
    assert hits == []


def test_a_sharding_says_what_it_communicates_phase_by_phase() -> None:
    from fsdpbench.strategies.base import FSDP_FULL_SHARD, FSDP_HYBRID_SHARD, OPTIM_SHARDED, REPLICATED

    def plan(sharding):
        return [(c.phase, c.kind, c.payload, c.group) for c in sharding.collectives()]

    assert plan(REPLICATED) == [("backward", "all_reduce", "grads", "shard")]
    assert plan(OPTIM_SHARDED) == [
        ("backward", "all_reduce", "grads", "shard"),
        ("after_step", "broadcast", "params", "shard"),
    ]
    assert plan(FSDP_FULL_SHARD) == [
        ("forward", "all_gather", "params", "shard"),
        ("backward", "all_gather", "params", "shard"),
        ("backward", "reduce_scatter", "grads", "shard"),
    ]
    assert plan(HybridKeepParams.sharding) == [
        ("forward", "all_gather", "params", "shard"),
        ("backward", "reduce_scatter", "grads", "shard"),
        ("backward", "all_reduce", "grad_shard", "replicas"),
    ]
    assert plan(FSDP_HYBRID_SHARD)[1] == ("backward", "all_gather", "params", "shard")


def test_a_plugin_declares_its_tracker_checkpoint_and_knobs_and_the_engine_follows() -> None:
    from fsdpbench.engine.emulate import shards_on_meta
    from fsdpbench.engine.knobs import normalize_knobs
    from fsdpbench.predictors.checkpoint import predict_checkpoint
    from fsdpbench.predictors.memory_model import _case_notes
    from fsdpbench.strategies.base import FSDP1_STATE_DICT, STRATEGY_KNOBS, Strategy

    plugin = HybridKeepParams()
    assert plugin.memory_tracker == "fsdp2" and shards_on_meta(plugin)
    case = Case(model="mlp", strategy=HybridKeepParams.name, world_size=4, shard_size=2, checkpoint="full")
    # what it gathers is what it declares: FSDP2's padded tensors, as hsdp, not FSDP1's flat parameters
    ours = predict_checkpoint(case, plugin)
    assert [p.bytes for p in ours] == [p.bytes for p in predict_checkpoint(case, get_strategy("hsdp"))]
    assert not any(k.startswith("fsdp1_") for p in ours for k in p.terms)

    class FlatPlugin(HybridKeepParams):  # the same engine, declared to checkpoint and read knobs as FSDP1
        name = "flat_plugin"
        memory_tracker = "fsdp1"
        reads_knobs = STRATEGY_KNOBS
        checkpointing = FSDP1_STATE_DICT
        memory_model_notes = ("flat_plugin: laid out per parameter",)

    flat = FlatPlugin()
    assert "fsdp1_flat_gather_host" in predict_checkpoint(case.replace(strategy=flat.name), flat)[1].terms
    knobs = case.replace(backward_prefetch="post", limit_all_gathers=False)
    assert normalize_knobs(knobs, flat) == knobs
    assert normalize_knobs(knobs, plugin) == case  # HybridKeepParams reads none of them
    # the first note is the recipe every prediction assumes; the strategy's own follow it
    assert _case_notes(case, flat)[1:] == ["flat_plugin: laid out per parameter"]
    assert _case_notes(case, plugin)[1:] == []
    with pytest.raises(ValueError, match="memory_tracker"):
        type("Bad", (Strategy,), {"memory_tracker": "fsdp3"})
    with pytest.raises(ValueError, match="reads_knobs"):
        type("Bad", (Strategy,), {"reads_knobs": ("wrap",)})
    with pytest.raises(TypeError, match="checked_on_gpu"):
        type("Bad", (Strategy,), {"checked_on_gpu": "yes"})


@pytest.mark.parametrize(
    "fields",
    [
        {"state_dict_api": "fsdp1"},  # a gathering API that gathers nothing
        {"gathers": "flat_parameters"},  # the module's own state dict gathers nothing
        {"state_dict_api": "distributed", "gathers": "padded_tensors", "optimizer_consolidation": "to_rank0"},
        {"optimizer_consolidation": "rank0"},
    ],
)
def test_a_checkpointing_that_contradicts_itself_is_refused(fields: dict) -> None:
    from fsdpbench.strategies.base import Checkpointing

    with pytest.raises(ValueError, match="Checkpointing"):
        Checkpointing(**fields)
