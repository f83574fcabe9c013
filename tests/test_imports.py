"""fedexp's modules import one another without cycles (issue 22).

Every ``import`` / ``from ... import`` of a fedexp module inside fedexp, at module level or
inside a function (a deferred import is still a dependency), except under
``if TYPE_CHECKING:`` (annotations only), is an edge; the graph must be acyclic. A package's
``__init__`` is the package's node; ``from a.b import c`` of a module ``c`` depends on
``a.b.c`` only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fedexp"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.AST, here: str, is_package: bool, modules: set[str] | None = None
) -> set[str]:
    """What ``tree`` (module ``here``) imports; ``from pkg import mod`` of a module in
    ``modules`` depends on ``pkg.mod``, not on ``pkg``'s ``__init__``."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = here.split(".") if is_package else here.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names}
            if modules is None or not subs <= modules:
                out.add(base)
            out.update(subs & modules if modules is not None else subs)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    """fedexp module -> the fedexp modules it imports."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        deps = _imports(tree, name, path.name == "__init__.py", set(files))
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_fedexp_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


#: fedexp's modules that import nothing of fedexp, which the contract may use
LEAVES = {"fedexp.transfer"}


def test_the_contract_imports_nothing_of_the_engine():
    """Only leaves: ``fedexp.transfer`` (host tensors onto the device) imports no fedexp."""
    graph = import_graph()
    deps = graph["fedexp.contract"]
    assert not any(d.startswith("fedexp.") and d not in LEAVES for d in deps), deps
    assert all(not graph[leaf] for leaf in LEAVES), {leaf: graph[leaf] for leaf in LEAVES}


@pytest.mark.parametrize(
    "graph, cyclic",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
        ({"a": {"a2"}, "a2": set(), "b": {"b"}}, True),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, cyclic):
    assert (find_cycle(graph) is not None) == cyclic


def test_deferred_imports_count_and_type_checking_ones_do_not():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from fedexp.x import A\n"
        "def f():\n    from fedexp.y import B\n"
    )
    deps = _imports(tree, "fedexp.z", False)
    assert "fedexp.y" in deps and "fedexp.x" not in deps
