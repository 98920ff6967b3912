"""The layers of simkit (ARCHITECTURE.md): no import cycles, import-linter contracts kept,
modules of one idea.

The import graph is built statically by grimp (the library under import-linter), so imports
inside functions count as much as those at the top of a module: a cycle hidden in a lazy import
is still a cycle. ``if TYPE_CHECKING:`` imports are not imports at run time and are left out.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: lines above which a module must say in its docstring why it is not split
MAX_LINES = 800


def _graph():
    return grimp.build_graph("simkit", exclude_type_checking_imports=True)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), and the modules
    that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_inside_simkit():
    graph = _graph()
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    cycles = _cycles(edges)
    details = []
    for component in cycles:
        members = set(component)
        for m in component:
            for target in sorted(edges[m] & members):
                line = graph.get_import_details(importer=m, imported=target)
                where = f"line {line[0]['line_number']}" if line else ""
                details.append(f"{m} -> {target} ({where})")
    assert not cycles, "import cycles:\n" + "\n".join(details)


def test_import_linter_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.fail("lint-imports not found next to the Python executable: pip install -e '.[dev]'")
    out = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "broken" in out.stdout and "0 broken" in out.stdout


def test_long_modules_say_why():
    long = []
    for path in sorted((ROOT / "simkit").rglob("*.py")):
        text = path.read_text("utf-8")
        name = path.relative_to(ROOT).as_posix()
        if text.count("\n") > MAX_LINES and "not split" not in text[: text.find('"""', 3)]:
            long.append(f"{name} ({text.count(chr(10))} lines)")
    assert not long, (
        f"modules above {MAX_LINES} lines without a reason ('not split: ...') in their docstring: "
        + ", ".join(long)
    )
