"""The package's layers, lowest first: a module imports only modules of its own package or of a lower
layer — module-level and function-level imports alike (``test_architecture.import_graph`` reads them all).
docs/architecture.md draws the same order; change both together."""

from __future__ import annotations

from pathlib import Path

from tests.test_architecture import PACKAGE, import_graph

# one layer a line, lowest first
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),  # torch-free: the case, the column registry, units, numbers, safe files
    ("models",),
    ("strategies",),
    ("metrics",),  # what a rank measures: trackers, samplers, allocator, timing, the trace
    ("engine",),  # what one rank runs: the parallel model, its step, the phases, emulation
    ("predictors",),  # (case, rank) → a prediction; starts no process
    ("hosttuning",),  # opt-in CPU-host tuning at the moments the worker offers
    ("analysis",),  # rows → verdicts, torch-free
    ("store",),  # the run directory's files: results, run.json, environment
    ("pipeline",),  # scenario → cases → launched ranks → stored rows
    ("report",),
    ("commands", "cli", "__main__"),
)


def layer_of(module: str) -> int:
    """The layer of ``fsdpbench.<package>…``; the package's own ``__init__`` is the core."""
    parts = module.split(".")
    if len(parts) == 1:
        return 0
    for index, packages in enumerate(LAYERS):
        if parts[1] in packages:
            return index
    raise AssertionError(f"{module}: its package is in no layer of tests/test_layers.py")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a higher layer, as 'importer -> imported'."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(module):
                found.append(f"{module} -> {target}")
    return found


def test_every_import_points_down_the_layers():
    graph = import_graph()
    assert len(graph) > 80  # the whole package was read
    assert upward_imports(graph) == []


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    for name in sorted(packages | modules):
        assert layer_of(f"fsdpbench.{name}") >= 0


def test_the_check_finds_a_function_level_import_up_the_layers(tmp_path: Path):
    pkg = tmp_path / "fsdpbench"
    for sub in ("core", "engine", "predictors"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "units.py").write_text("")
    (pkg / "predictors" / "model.py").write_text("from fsdpbench.core.units import x\n")
    (pkg / "engine" / "checkpoint.py").write_text("def f():\n    from fsdpbench.predictors.model import y\n")
    assert upward_imports(import_graph(pkg)) == ["fsdpbench.engine.checkpoint -> fsdpbench.predictors.model"]
