"""The column registry (fsdpbench/core/schema.py): every column a run writes is declared and documented, no
column name or status is spelled outside the registry, and case_frame aggregates each column as declared."""

from __future__ import annotations

import ast
import dataclasses
import re
import warnings

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from fsdpbench.analysis.frame import UndeclaredColumnWarning, case_frame
from fsdpbench.analysis.summary import print_summary
from fsdpbench.core import schema
from fsdpbench.core.formatting import NOT_MEANINGFUL_ON_CPU
from fsdpbench.report.synthetic import write_synthetic_run
from fsdpbench.store.results import load_results
from tests.helpers import REPO

PACKAGE = REPO / "fsdpbench"
REGISTRY = PACKAGE / "core/schema.py"
MEASUREMENTS_DOC = REPO / "docs" / "measurements.md"
NOT_A_COLUMN = "# not a column"  # on the line, or the line above: a literal that only looks like one


def guarded_names() -> set[str]:
    """What no literal may spell: every declared column but a Case field (those are the scenario's field
    names as well, declared by the Case dataclass), and every status."""
    return {n for n, c in schema.COLUMNS.items() if c.source != "config"} | set(schema.STATUSES)


def literal_hits(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, text) of each string literal equal to one of ``names``, and of each f-string that spells one
    with a value in it (f"comm_{kind}_bytes"); docstrings, ``__all__`` and lines marked NOT_A_COLUMN aside."""
    tree = ast.parse(source)
    lines = source.splitlines()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            skip.update(id(n) for n in ast.walk(node))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values if isinstance(v, ast.Constant))
    hits = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            text = node.value
        elif isinstance(node, ast.JoinedStr) and _spells_a_name(node, names):
            text = ast.unparse(node)
        else:
            continue
        marked = NOT_A_COLUMN in lines[node.lineno - 1] or (
            node.lineno >= 2 and lines[node.lineno - 2].strip().startswith(NOT_A_COLUMN)
        )
        if not marked:
            hits.append((node.lineno, text))
    return hits


def _spells_a_name(node: ast.JoinedStr, names: set[str]) -> bool:
    """A family's pattern (f"paired_{k}"), or text on both sides of a value that spells a column."""
    parts = [v.value if isinstance(v, ast.Constant) else None for v in node.values]
    if "".join(p if p is not None else "{}" for p in parts) in schema.FAMILIES:
        return True
    if len(parts) < 3 or not isinstance(parts[0], str) or not isinstance(parts[-1], str) or len(parts[0]) < 4:
        return False
    pattern = re.compile("".join(re.escape(p) if p is not None else "[A-Za-z0-9_]+" for p in parts))
    return any(pattern.fullmatch(n) for n in names)


def _package_hits() -> dict[str, list[tuple[int, str]]]:
    names = guarded_names()
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == REGISTRY:
            continue
        hits = literal_hits(path.read_text(), names)
        if hits:
            out[path.relative_to(PACKAGE).as_posix()] = hits
    return out


def test_no_column_name_or_status_is_spelled_outside_the_registry():
    hits = _package_hits()
    listing = "; ".join(f"fsdpbench/{f}:{line}: {text}" for f, h in hits.items() for line, text in h)
    assert not hits, f"use the constants of fsdpbench/core/schema.py: {listing}"


def _bound_elsewhere(tree: ast.AST) -> tuple[set[str], dict[str, int]]:
    """Names a module imports from fsdpbench.core.schema, and each other name it binds → the line of its first
    binding (another import, an assignment, a def, an argument, a loop variable)."""

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Name):
            return [node.id]
        return [n for e in getattr(node, "elts", []) for n in targets(e)]

    from_schema: set[str] = set()
    other: dict[str, int] = {}
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if node.module == "fsdpbench.core.schema":
                    from_schema.add(alias.asname or alias.name)
                else:
                    other.setdefault(alias.asname or alias.name, line)
        names = []
        if isinstance(node, ast.Assign):
            names = [n for t in node.targets for n in targets(t)]
        elif isinstance(node, (ast.AnnAssign, ast.For, ast.comprehension)):
            names = targets(node.target)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        for name in names:
            other.setdefault(name, line)
    return from_schema, other


def test_no_module_that_names_columns_through_the_schema_binds_a_schema_name_to_something_else():
    """A constant of the schema bound to another value in a module that reads the schema (emulate's
    LOSS_SKIPPED_REASON, the reason text) would key a column by that value without a word."""
    public = {k for k, v in vars(schema).items() if k.isupper() and isinstance(v, (str, schema.Family))}
    clashes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == REGISTRY:
            continue
        from_schema, other = _bound_elsewhere(ast.parse(path.read_text()))
        if from_schema:
            clashes += [f"{path.relative_to(REPO)}:{other[n]}: {n}" for n in sorted(public & set(other))]
    assert clashes == []


def test_the_literal_scan_finds_literals_and_family_f_strings_and_nothing_else():
    source = '''"""pred_peak_bytes in a docstring is prose."""
__all__ = ["mfu"]
a = row["pred_peak_bytes"]
b = status == "oom"
c = f"comm_{kind}_bytes"
d = f"trace_rank{r}.json.gz"
e = row["pred_peak_bytes"]  # not a column: a test of the marker
# not a column: the line below
f = "mfu"
g = f"{label}: mfu"
h = f"step_{suffix}"
i = f"paired_{k}"
'''
    assert sorted(literal_hits(source, guarded_names())) == [
        (3, "pred_peak_bytes"),
        (4, "oom"),
        (5, "f'comm_{kind}_bytes'"),
        (12, "f'paired_{k}'"),
    ]


def test_a_name_is_declared_once_and_a_family_knows_its_members():
    with pytest.raises(ValueError, match="declared twice"):
        schema.column(schema.MFU, unit=schema.RATIO, agg=schema.Agg.SLOWEST, source="x", doc="x")
    with pytest.raises(ValueError, match="declared twice"):
        schema.family("comm_{}_bytes", ("x",), unit=schema.BYTES, agg=schema.Agg.MEAN, source="x", doc="x")
    assert schema.COMM_BYTES.of("all_gather") == "comm_all_gather_bytes"
    with pytest.raises(KeyError, match="allgather"):
        schema.COMM_BYTES.of("allgather")
    assert schema.tracker_peak_column("temp") == "mem_tracker_peak_temp_bytes"
    with pytest.raises(KeyError, match="not declared"):
        schema.get_column("mem_tracker_peak_total_bytes")
    assert all(c.doc and c.unit and c.source for c in schema.COLUMNS.values())


def test_the_docs_table_is_generated_from_the_declarations():
    text = MEASUREMENTS_DOC.read_text()
    start = text.index(schema.DOCS_BEGIN) + len(schema.DOCS_BEGIN)
    assert text[start : text.index(schema.DOCS_END)].strip() == schema.docs_table(), (
        "regenerate it: python -m fsdpbench.core.schema --write-docs"
    )
    assert schema.documented_columns(text) == set(schema.COLUMNS)


def test_every_column_of_a_real_case_and_of_the_synthetic_run_is_declared_and_documented(
    one_case_run, tmp_path
):
    write_synthetic_run(tmp_path / "synthetic")
    written = set(load_results(one_case_run).columns) | set(load_results(tmp_path / "synthetic").columns)
    assert schema.undeclared(sorted(written)) == []
    assert written - schema.documented_columns(MEASUREMENTS_DOC.read_text()) == set()


def test_what_a_cpu_case_measures_reaches_its_case_row(one_case_run):
    rows = load_results(one_case_run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        case = case_frame(rows).iloc[0]
    rank = rows.iloc[0]
    assert case[schema.THROUGHPUT_SAMPLES] == pytest.approx(2 / (case[schema.CASE_STEP_TIME] / 1e3))
    assert case[schema.ACHIEVED_TFLOPS] == pytest.approx(
        case[schema.FLOPS_PER_STEP] / (rank[schema.STEP_TIME] / 1e3) / 1e12
    )
    assert case[schema.MFU] is None or np.isnan(case[schema.MFU])  # no datasheet peak for a CPU
    assert case[schema.BARE_STEP_TIME] > 0
    assert case[schema.HARNESS_OVERHEAD_RATIO] == pytest.approx(
        rank[schema.STEP_TIME_MEAN] / rank[schema.BARE_STEP_TIME]
    )
    assert case[schema.HARNESS_LEFTOVERS] == ""  # the tracker and the profiler left nothing installed
    assert case[schema.CASE_MODEL_STEP_TIME] == pytest.approx(rank[schema.MODEL_STEP_TIME])
    assert schema.STEP_TIMES not in case  # per rank only, by declaration


def test_the_summary_shows_throughput_harness_overhead_and_says_mfu_is_not_meaningful_on_cpu(one_case_run):
    console = Console(record=True, width=250)
    print_summary(load_results(one_case_run), console)
    text = console.export_text()
    case = case_frame(load_results(one_case_run)).iloc[0]
    row = next(line for line in text.splitlines() if line.rstrip().endswith(case[schema.CASE_ID][-6:]))
    assert "samples/s" in text and f" {case[schema.THROUGHPUT_SAMPLES]:.1f} " in row  # its column's unit
    assert f"{case[schema.HARNESS_OVERHEAD_RATIO] - 1:+.1%}" in text and "harness overhead" in text
    assert NOT_MEANINGFUL_ON_CPU in text


def test_the_report_shows_throughput_harness_overhead_and_mfu_where_they_apply(one_case_run, tmp_path):
    from fsdpbench.report import write_report

    html = write_report([one_case_run], tmp_path / "report.html").read_text()
    case = case_frame(load_results(one_case_run)).iloc[0]
    assert f"{case[schema.THROUGHPUT_SAMPLES]:.1f} samples/s" in html
    assert "MFU, achieved TFLOP/s" in html and NOT_MEANINGFUL_ON_CPU in html
    assert (
        f"{case[schema.HARNESS_OVERHEAD_RATIO] - 1:+.1%} (bare {case[schema.BARE_STEP_TIME]:.1f} ms)" in html
    )


def _ranks(**columns: list) -> pd.DataFrame:
    n = len(next(iter(columns.values())))
    base = {schema.CASE_ID: ["c"] * n, schema.RANK: list(range(n)), schema.STATUS: [schema.OK] * n}
    return pd.DataFrame({**base, **columns})


def test_case_frame_takes_each_column_as_declared():
    rows = _ranks(
        step_time_ms=[10.0, 20.0],
        mfu=[0.5, 0.3],  # the slowest rank's, as its step time
        mem_rss_peak_bytes=[5, 3],  # max over ranks
        comm_total_bytes=[2.0, 4.0],  # mean over ranks
        mem_tracker_peak_bytes=[9, 7],  # the largest peak's rank: rank 0
        pred_peak_bytes=[18, 70],
        mem_tracker_peak_temp_bytes=[1, 2],
        model_step_time_ms=[25.0, 30.0],  # the rank the model finds slowest: rank 1 (not the measured one)
        model_compute_ms=[11.0, 12.0],
        case_model_step_time_ms=[30.0, 30.0],
        step_times_ms=[[10.0], [20.0]],  # per rank only
    )
    case = case_frame(rows).iloc[0]
    assert (case[schema.STEP_TIME], case[schema.SLOWEST_RANK], case[schema.MFU]) == (20.0, 1, 0.3)
    assert case[schema.SAMPLED_PEAK.of("rss")] == 5 and case[schema.COMM_TOTAL] == 3.0
    assert (case[schema.PEAK_RANK], case[schema.PRED_PEAK], case[schema.tracker_peak_column("temp")]) == (
        0,
        18,
        1,
    )
    assert case[schema.PRED_PEAK_ERR] == pytest.approx(1.0)  # (18 − 9) / 9, against the same rank
    assert (case[schema.MODEL_COMPUTE], case[schema.CASE_MODEL_STEP_TIME]) == (12.0, 30.0)
    assert case[schema.MODEL_STEP_ERR] == pytest.approx(0.5)
    assert schema.STEP_TIMES not in case


def test_case_frame_keeps_an_undeclared_column_and_says_so():
    rows = _ranks(step_time_ms=[1.0, 2.0], my_new_column_ms=[3.0, 4.0])
    with pytest.warns(UndeclaredColumnWarning, match="my_new_column_ms"):
        case = case_frame(rows).iloc[0]
    assert case["my_new_column_ms"] == 3.0


def test_the_summary_of_the_h100_rows_shows_mfu_and_achieved_tflops():
    rows = pd.read_parquet(REPO / "tests" / "data" / "gpu-h100" / "single_gpu_decoder-base_results.parquet")
    console = Console(record=True, width=250)
    print_summary(rows, console)
    text = console.export_text()
    ddp_fp32 = rows[rows[schema.CASE_ID] == "ddp_n1_decoder-base_none_pf0_fp32_b8_4581d4"].iloc[0]
    expected = f"{ddp_fp32[schema.MFU]:.1%} ({ddp_fp32[schema.ACHIEVED_TFLOPS]:.1f})"  # MFU (TFLOP/s)
    assert expected == "58.5% (39.2)" and expected in text
    assert "MFU (TFLOP/s)" in text and NOT_MEANINGFUL_ON_CPU not in text


def test_compute_throughput_and_overhead_read_as_text():
    from fsdpbench.core.formatting import fmt_compute, fmt_harness_overhead, fmt_throughput

    gpu = {schema.DEVICE: "cuda", schema.MFU: 0.412, schema.ACHIEVED_TFLOPS: 129.54}
    assert fmt_compute(gpu) == "41.2% MFU, 129.5 TFLOP/s"
    assert fmt_compute({**gpu, schema.MFU: None}) == "129.5 TFLOP/s"  # a GPU without a datasheet peak
    assert fmt_compute({**gpu, schema.DEVICE: "cpu"}) == NOT_MEANINGFUL_ON_CPU
    assert fmt_compute({schema.DEVICE: "cuda"}) == "—"
    assert fmt_throughput({schema.THROUGHPUT_SAMPLES: 80.0, schema.THROUGHPUT_TOKENS: 1280.0}) == (
        "80.0 samples/s (1,280 tokens/s)"
    )
    assert fmt_throughput({schema.THROUGHPUT_SAMPLES: float("nan")}) == "—"
    assert fmt_harness_overhead({schema.HARNESS_OVERHEAD_RATIO: 1.031, schema.BARE_STEP_TIME: 20.4}) == (
        "+3.1% (bare 20.4 ms)"
    )
    assert fmt_harness_overhead({}) == "—"


def test_a_field_added_to_case_appears_in_the_scenario_schema_and_the_columns_as_declared():
    """Case is the one declaration: the scenario's schema (pipeline/scenario.case_fields_model) and the
    configuration columns (schema.case_field_columns) are derived from its fields. A field added to a
    Case (here on a subclass, so the registry stays as it is) appears in both, with its doc, its column's
    name and the bounds it declares."""
    from pydantic import ValidationError

    from fsdpbench.core.case import Accepts, Case, case_field
    from fsdpbench.pipeline.scenario import case_fields_model

    @dataclasses.dataclass(kw_only=True)
    class Widened(Case):
        widgets: int = case_field(2, doc="widgets per rank", accepts=Accepts(gt=0, le=8), column="n_widgets")
        colour: str = case_field("red", doc="the widgets' colour", accepts=Accepts(choices=("red", "blue")))
        tags: tuple[str, ...] = case_field(
            (), doc="tags (comma-separated)", accepts=Accepts(items=Accepts(min_length=1))
        )
        note: str = case_field("", doc="set by the run, not by a scenario", accepts=None)

    columns = {c.name: c for c in schema.case_field_columns(Widened)}
    assert list(columns)[-4:] == ["n_widgets", "colour", "tags", "note"]
    assert columns["n_widgets"] == schema.Column(
        "n_widgets", schema.CONFIG, schema.Agg.SAME, "config", "widgets per rank"
    )
    assert columns["tags"].doc == "tags (comma-separated)" and columns["timed_steps"].doc == "timed steps"
    assert [c.name for c in schema.case_field_columns(Case)] == list(schema.CASE_FIELD_COLUMNS.values())

    model = case_fields_model(Widened)
    assert list(model.model_fields)[-3:] == ["widgets", "colour", "tags"]  # note: a scenario cannot set it
    assert model.model_validate({"widgets": 8, "colour": "blue", "tags": ["a", "b"]}).widgets == 8
    for bad, error in (
        ({"widgets": 9}, "less than or equal to 8"),
        ({"widgets": 0}, "greater than 0"),
        ({"widgets": True}, "valid integer"),  # strict: a bool is not an int
        ({"widgets": "3"}, "valid integer"),  # nor is a string
        ({"colour": "green"}, "'red' or 'blue'"),
        ({"tags": [""]}, "at least 1 character"),
        ({"note": "x"}, "Extra inputs are not permitted"),
        ({"scenario": "x"}, "Extra inputs are not permitted"),  # the scenario's name is its file's
    ):
        with pytest.raises(ValidationError, match=error):
            model.model_validate(bad)


def test_a_case_field_without_a_doc_or_a_scenario_bound_is_refused_by_both_derivations():
    from fsdpbench.core.case import Case
    from fsdpbench.pipeline.scenario import case_fields_model

    @dataclasses.dataclass(kw_only=True)
    class Undocumented(Case):
        widgets: int = 2

    with pytest.raises(TypeError, match="case field widgets has no doc"):
        schema.case_field_columns(Undocumented)
    with pytest.raises(TypeError, match="case field widgets has no doc"):
        case_fields_model(Undocumented)


def test_the_real_case_declares_the_scenario_schema_and_its_rows_columns():
    """The registry and the scenario schema are Case's: every field a column with the field's doc, every
    field but the scenario's name a scenario field; a case comes back from its columns unchanged."""
    from fsdpbench.core.case import Case, field_doc
    from fsdpbench.pipeline.scenario import CaseFields

    fields = dataclasses.fields(Case)
    assert list(CaseFields.model_fields) == [f.name for f in fields if f.name != "scenario"]
    for f in fields:
        col = schema.COLUMNS[schema.CASE_FIELD_COLUMNS[f.name]]
        assert (col.unit, col.agg, col.source, col.doc) == (
            schema.CONFIG,
            schema.Agg.SAME,
            "config",
            field_doc(f),
        )
    assert schema.CASE_FIELD_COLUMNS["steps"] == schema.TIMED_STEPS == "timed_steps"
    case = Case(model="mlp", strategy="zero3", world_size=4, wrap_classes=("Linear",), seed=7, lr=0.5)
    columns = schema.case_to_columns(case)
    assert schema.undeclared(columns) == []
    assert {schema.COLUMNS[c].agg for c in columns} == {schema.Agg.SAME}
    assert columns[schema.CASE_ID] == case.case_id and columns[schema.MODE] == "real"
    assert columns[schema.GLOBAL_BATCH_SIZE] == 16 and columns["wrap_classes"] == "Linear"
    assert schema.case_from_columns(columns) == case


def test_the_reports_contents_list_only_sections_with_content(one_case_run, tmp_path):
    import re

    from fsdpbench.report import write_report

    html = write_report([one_case_run], tmp_path / "report.html").read_text()
    nav = re.search(r"<nav>(.*?)</nav>", html, re.S).group(1)  # type: ignore[union-attr]
    missing = set(re.findall(r'data-missing="([^"]+)"', html))
    assert missing and "sweep" in missing  # one case: nothing swept, the section says so
    assert not any(f'href="#{key}"' in nav for key in missing)
    assert 'href="#glance"' in nav and 'href="#cases"' in nav
    assert "Sweeps" not in nav
