"""No function or method of the package above cyclomatic complexity 20, as radon counts it: a function
that branches more than that is split along its parts (phases, methods, cases) into named functions."""

from __future__ import annotations

from pathlib import Path

from radon.complexity import cc_visit

from tests.test_architecture import PACKAGE

MAX_COMPLEXITY = 20


def complexities(root: Path = PACKAGE) -> dict[tuple[str, str], int]:
    """(module path under the package, qualified name) → radon's cyclomatic complexity, every function
    and method, nested ones included."""
    out: dict[tuple[str, str], int] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for block in cc_visit(path.read_text()):
            blocks = [block, *getattr(block, "methods", []), *getattr(block, "closures", [])]
            for b in blocks:
                if getattr(b, "is_method", False) or not hasattr(b, "methods"):
                    out[(rel, b.fullname)] = b.complexity
    return out


def too_complex(found: dict[tuple[str, str], int]) -> list[str]:
    return sorted(
        f"{path}:{name} has complexity {cc}" for (path, name), cc in found.items() if cc > MAX_COMPLEXITY
    )


def test_no_function_above_the_limit() -> None:
    assert too_complex(complexities()) == []


def test_the_check_sees_a_complex_function(tmp_path: Path) -> None:
    branches = "\n".join(f"    if x == {i}:\n        return {i}" for i in range(MAX_COMPLEXITY))
    (tmp_path / "deep.py").write_text(f"def deep(x):\n{branches}\n    return -1\n")
    (tmp_path / "flat.py").write_text("class K:\n    def m(self, x):\n        return x if x else 0\n")
    found = complexities(tmp_path)
    assert found == {("deep.py", "deep"): MAX_COMPLEXITY + 1, ("flat.py", "K.m"): 2}
    assert too_complex(found) == ["deep.py:deep has complexity 21"]
