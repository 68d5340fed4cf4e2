"""Scenario files: validation errors name the field; the sweep expands to the right cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdpbench.pipeline.scenario import ScenarioError, load_scenario, parse_scenario
from tests.helpers import CPU
from tests.helpers import REPO as ROOT


def expand(text: str):
    return parse_scenario(text, source="s.yaml")


def expand_on_cpu(text: str):
    """Expanded with every case pinned to CPU ranks (gloo): the same cases on any machine."""
    return parse_scenario(text, source="s.yaml", overrides=CPU)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: x\nsweep: {wrld_size: [1]}", "s.yaml: sweep.wrld_size: unknown field; allowed: model,"),
        (
            "name: x\nsweep: {world_size: [2, 0]}",
            "s.yaml: sweep.world_size[1]: Input should be greater than 0",
        ),
        ("name: x\nsweep: {world_size: two}", "s.yaml: sweep.world_size[0]: Input should be a valid integer"),
        ("name: x\nsweep: {}", "s.yaml: sweep: empty"),
        ("name: x\nsweep: {strategy: []}", "s.yaml: sweep.strategy: empty list"),
        (
            "name: x\nsweep: {strategy: [ddp, zero9]}",
            "s.yaml: sweep.strategy[1]: unknown strategy 'zero9'; allowed: ddp",
        ),
        ("name: x\nsweep: {model: [gpt9]}", "s.yaml: sweep.model[0]: unknown model 'gpt9'; allowed:"),
        (
            "name: x\ndefaults: {precision: fp8}\nsweep: {world_size: 1}",
            "s.yaml: defaults.precision: Input should be 'fp32'",
        ),
        (
            "name: x\ndefaults: {batch_size: 0}\nsweep: {world_size: 1}",
            "s.yaml: defaults.batch_size: Input should be greater than 0",
        ),
        (
            "name: x\nfoo: 1\nsweep: {world_size: [1]}",
            "s.yaml: foo: unknown field; allowed: name, description",
        ),
        ("sweep: {world_size: [1]}", "s.yaml: name: Field required"),
        ("name: x\nsweep: {world_size: 1}\nexclude: [{wrld: 1}]", "s.yaml: exclude[0].wrld: unknown field"),
        (
            "name: x\nsweep: {model_args.d_modl: [8]}",
            "s.yaml: model_args: model 'decoder-tiny' has no argument(s) ['d_modl']",
        ),
        ("name: x\ncases: [{strategy: ddp, world_sise: 2}]", "s.yaml: cases[0].world_sise: unknown field"),
        ("name: [x", "s.yaml: not valid YAML"),
        ("- a\n- b", "s.yaml: a scenario is a mapping"),
    ],
)
def test_malformed_scenario_names_the_field(text: str, expected: str) -> None:
    with pytest.raises(ScenarioError) as info:
        expand(text)
    message = str(info.value)
    assert message.startswith(expected), message
    assert "\n" not in message


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read scenario file"):
        load_scenario(tmp_path / "nope.yaml")


def test_sweep_is_the_product_plus_extra_cases() -> None:
    s = expand_on_cpu(
        "name: q\nsweep: {world_size: [1, 2, 4], strategy: [ddp, zero1, zero2, zero3]}\n"
        "cases: [{strategy: hsdp, world_size: 4, shard_size: 2}]"
    )
    assert len(s.cases) == 13
    assert {(c.strategy, c.world_size) for c in s.cases} >= {("ddp", 1), ("zero3", 4), ("hsdp", 4)}
    assert len({c.case_id for c in s.cases}) == 13
    assert all(c.scenario == "q" for c in s.cases)


def test_quickstart_has_at_least_13_cases() -> None:
    s = load_scenario(ROOT / "scenarios" / "quickstart.yaml", overrides=CPU)
    assert len(s.cases) >= 13 and not s.skipped
    assert {c.strategy for c in s.cases} == {"ddp", "zero1", "zero2", "zero3", "hsdp"}
    assert {c.world_size for c in s.cases} == {1, 2, 4}


def test_impossible_combinations_are_skipped_with_a_reason() -> None:
    s = expand_on_cpu(
        "name: q\nsweep: {strategy: [ddp, zero3, hsdp], world_size: [4], prefetch: [0, 1], shard_size: [3]}"
    )
    reasons = {(k.case.strategy, k.case.prefetch): k.reason for k in s.skipped}
    assert reasons[("ddp", 1)] == "prefetch=1 applies to FSDP strategies; ddp has no prefetch"
    assert reasons[("hsdp", 0)] == "hsdp shard_size=3 does not divide world_size=4"
    assert {(c.strategy, c.prefetch) for c in s.cases} == {("ddp", 0), ("zero3", 0), ("zero3", 1)}


def test_ddp_bf16_compression_is_skipped_on_gloo_but_not_on_nccl() -> None:
    text = (
        "name: q\ndefaults: {backend: %s, device: %s}\n"
        "sweep: {strategy: [ddp, zero1, zero3], precision: [bf16-lowreduce, fp16-lowreduce], world_size: 2}"
    )
    s = expand(text % ("gloo", "cpu"))
    skipped = {(k.case.strategy, k.case.precision): k.reason for k in s.skipped}
    assert set(skipped) == {("ddp", "bf16-lowreduce"), ("zero1", "bf16-lowreduce")}
    assert "needs NCCL" in skipped[("ddp", "bf16-lowreduce")]
    assert len(s.cases) == 4
    s = expand(text % ("nccl", "cuda"))
    assert not any("NCCL" in k.reason for k in s.skipped)


def test_axes_a_strategy_ignores_collapse_to_one_case() -> None:
    s = expand_on_cpu("name: q\nsweep: {strategy: [ddp, zero3], wrap: [block, whole], world_size: 2}")
    assert sorted((c.strategy, c.wrap) for c in s.cases) == [
        ("ddp", "none"),
        ("zero3", "block"),
        ("zero3", "whole"),
    ]


def test_exclude_drops_matching_combinations() -> None:
    s = expand_on_cpu(
        "name: q\nsweep: {strategy: [ddp, zero3], world_size: [1, 2]}\n"
        "exclude: [{strategy: ddp, world_size: [1, 2]}, {world_size: 1}]"
    )
    assert [(c.strategy, c.world_size) for c in s.cases] == [("zero3", 2)]


def test_model_argument_axis_and_defaults() -> None:
    s = expand("name: q\ndefaults: {model: decoder-tiny, steps: 3}\nsweep: {model_args.n_layers: [2, 4]}")
    assert [c.model_args for c in s.cases] == [{"n_layers": 2}, {"n_layers": 4}]
    assert all(c.steps == 3 for c in s.cases)
    assert "n_layers4" in s.cases[1].case_id


def test_auto_backend_is_gloo_on_a_cpu_machine() -> None:
    import torch

    s = expand("name: q\nsweep: {world_size: 1}")
    expected = ("cuda", "nccl") if torch.cuda.is_available() else ("cpu", "gloo")
    assert (s.cases[0].device, s.cases[0].backend) == expected


def test_overrides_apply_to_every_case() -> None:
    s = parse_scenario("name: q\nsweep: {world_size: [1, 2]}", overrides={"steps": 7, **CPU})
    assert [c.steps for c in s.cases] == [7, 7]


def test_case_ids_name_the_knobs_switched_on_and_keep_plain_ids() -> None:
    from fsdpbench.core.case import Case

    plain = Case(strategy="zero3", world_size=2)
    assert (
        plain.case_id.startswith("zero3_n2_decoder-tiny_block_pf0_fp32_b4_") and plain.case_id.count("_") == 7
    )
    knobs = plain.replace(
        cpu_offload=True, activation_checkpointing=True, backward_prefetch="post", forward_prefetch=True
    )
    assert "_fp32_b4_ac_offload_bwd-post_fwdpf_" in knobs.case_id
    assert plain.replace(cpu_offload=True).case_id != plain.case_id


def test_a_scenario_can_ask_for_traced_predictions() -> None:
    assert expand("name: q\ntraced: true\nsweep: {world_size: 1}").traced is True
    assert expand("name: q\nsweep: {world_size: 1}").traced is False
    with pytest.raises(ScenarioError, match="s.yaml: traced: Input should be a valid boolean"):
        expand("name: q\ntraced: maybe\nsweep: {world_size: 1}")


def test_every_scenario_field_is_in_the_table_of_docs_scenarios_md():
    """The scenario's fields (derived from Case) and the table users read agree, both ways."""
    import re

    from fsdpbench.pipeline.scenario import CASE_FIELDS

    text = (ROOT / "docs" / "scenarios.md").read_text()
    table = text[text.index("## Case fields") :].split("\n\n## ")[0]
    documented = {
        name for cell in re.findall(r"^\| ([^|]+) \|", table, re.M) for name in re.findall(r"`(\w+)`", cell)
    }
    assert documented - {"field"} == set(CASE_FIELDS)


def test_every_case_field_is_in_one_section_and_the_docs_group_them_so():
    """Case.sections() holds each field once; docs/scenarios.md lists under '### <section>' exactly the
    fields a scenario may set of that section."""
    import dataclasses
    import re

    from fsdpbench.core.case import Case, Section
    from fsdpbench.pipeline.scenario import CASE_FIELDS

    sections = Case.sections()
    names = [n for fields in sections.values() for n in fields]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(Case))
    assert Case.section_of("world_size") is Section.PARALLELISM
    assert Case.section_of("limit_all_gathers") is Section.FSDP1
    assert sections[Section.EMULATION] == ("emulate", "emulate_ranks")
    text = (ROOT / "docs" / "scenarios.md").read_text()
    table = text[text.index("## Case fields") :].split("\n\n## ")[0]
    documented = {
        m.group(1): {
            n
            for cell in re.findall(r"^\| ([^|]+) \|", m.group(2), re.M)
            for n in re.findall(r"`(\w+)`", cell)
        }
        - {"field"}
        for m in re.finditer(r"^### (\w+)\n(.*?)(?=^### |\Z)", table, re.M | re.S)
    }
    expected = {s.value: {n for n in fields if n in CASE_FIELDS} for s, fields in sections.items()}
    assert documented == {k: v for k, v in expected.items() if v}


def test_a_field_declared_without_a_section_is_named():
    import dataclasses

    from fsdpbench.core.case import case_field, field_section

    @dataclasses.dataclass
    class Loose:
        knob: int = case_field(0, doc="a knob", accepts=None)

    with pytest.raises(TypeError, match="case field knob has no section"):
        field_section(dataclasses.fields(Loose)[0])


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            "defaults: {backend: mpi}\nsweep: {strategy: [ddp]}",
            "defaults.backend: Input should be 'auto', 'gloo' or 'nccl' (got 'mpi') [host section]",
        ),
        (
            "cases: [{forward_prefetch: 3}]\nsweep: {strategy: [ddp]}",
            "cases[0].forward_prefetch: Input should be a valid boolean (got 3) [fsdp1 section]",
        ),
        (
            "sweep: {strategy: [ddp], time_blocks: [-1]}",
            "sweep.time_blocks[0]: Input should be greater than or equal to 0 (got -1) [protocol section]",
        ),
        ("sweep: {strategy: [ddp], model_args.d_model: [abc]}", "[model section]"),
        ("sweep: {strategy: [ddp], checkpoint: [zip]}", "[checkpoint section]"),
    ],
)
def test_a_scenario_error_names_the_section_of_its_field(text: str, said: str):
    with pytest.raises(ScenarioError) as err:
        expand("name: q\n" + text)
    assert said in str(err.value) and "\n" not in str(err.value)
