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
    tree: ast.AST,
    here: str,
    is_package: bool,
    modules: set[str] | None = None,
    annotations: bool = False,
) -> set[str]:
    """What ``tree`` (module ``here``) imports; ``from pkg import mod`` of a module in
    ``modules`` depends on ``pkg.mod``, not on ``pkg``'s ``__init__``. ``annotations``:
    the imports under ``if TYPE_CHECKING:`` count too."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not annotations:
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


def import_graph(annotations: bool = False) -> dict[str, set[str]]:
    """fedexp module -> the fedexp modules it imports (``annotations``: type-only ones too)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        deps = _imports(tree, name, path.name == "__init__.py", set(files), annotations)
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


def test_the_streams_import_nothing_of_fedexp():
    """``fedexp.streams`` is a bottom module: every layer draws from it (issue 71)."""
    assert not import_graph()["fedexp.streams"]


#: The modules outside ``fedexp/engine`` that may import a part of the engine, and which
#: parts (prefixes of module names); docs/design.md, "Layers", says why for each. Any other
#: import of the engine from outside it runs back up a layer and fails the test below.
ENGINE_IMPORTS_ALLOWED = {
    # the local solver (and the pool it gathers from) is the layer below the algorithms
    "fedexp.algorithms.": ("fedexp.engine.solver.", "fedexp.engine.clients.pool"),
    # the command line and the sweeps run the engine: the layer above it
    "fedexp.cli": ("fedexp.engine.",),
    "fedexp.sweep.": ("fedexp.engine.",),
    # the federated split builds the engine's pooled client table
    "fedexp.data.federated": ("fedexp.engine.clients.pool",),
    # the simulated clock is one of the round's stages (chosen when the engine is built)
    "fedexp.system.clock": ("fedexp.engine.round.stages",),
}


def _engine_imports() -> dict[str, set[str]]:
    """Module outside ``fedexp.engine`` -> the parts of the engine it imports."""
    engine = ("fedexp.engine", "fedexp.engine.")
    return {
        module: {d for d in deps if d == engine[0] or d.startswith(engine[1])}
        for module, deps in import_graph().items()
        if not (module == engine[0] or module.startswith(engine[1]))
    }


def test_nothing_outside_the_engine_imports_it_but_the_documented_few():
    back_up = {
        module: [d for d in deps if not _allowed(module, d)]
        for module, deps in _engine_imports().items()
    }
    assert not {m: d for m, d in back_up.items() if d}, "imports of the engine run back up"


def _allowed(module: str, dep: str) -> bool:
    return any(
        module.startswith(importer) and dep.startswith(parts)
        for importer, parts in ENGINE_IMPORTS_ALLOWED.items()
    )


def test_every_allowed_import_of_the_engine_is_still_made():
    """No stale entry: each of ENGINE_IMPORTS_ALLOWED's importers imports what it may."""
    found = _engine_imports()
    for importer, parts in ENGINE_IMPORTS_ALLOWED.items():
        made = [d for m, deps in found.items() if m.startswith(importer) for d in deps]
        assert any(d.startswith(parts) for d in made), importer


def test_a_runs_figures_import_one_another_without_a_circle_even_for_types():
    """plots -> drawer -> canvas -> pca, plots -> pca: no circle, type-only imports counted."""
    graph = import_graph(annotations=True)
    figures = {m: {d for d in deps if d.startswith("fedexp.figures")} for m, deps in graph.items()}
    assert find_cycle({m: d for m, d in figures.items() if m.startswith("fedexp.figures")}) is None
    assert "fedexp.figures.pca" in figures["fedexp.figures.canvas"]  # (the walk saw its import)


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
    assert "fedexp.x" in _imports(tree, "fedexp.z", False, annotations=True)
