"""The kvcache package's modules (and the checkout's ``benchmarks/``) import one another without
circles, the client and the daemon stand side by side: neither imports the other, even through
a third module, and kvcache never imports ``benchmarks`` (an installed kvcache has none).

A circle means two modules cannot be read, tested or moved apart, and it is usually
hidden rather than absent: an import moved into a function or under ``if TYPE_CHECKING:``
stops Python from failing at load time, but the two files still need each other. So
this test counts every ``import`` and ``from ... import`` written anywhere in a module
(top level, ``TYPE_CHECKING`` blocks, ``try``/``if`` branches and function bodies alike),
read with ``ast`` from the source, so nothing has to be imported to check.

An edge goes to the module that holds the name: ``from kvcache.x import y`` points at
``kvcache.x.y`` when that is a module (a submodule import) and at ``kvcache.x`` otherwise.
Importing a submodule also runs its package's ``__init__``; that implicit step is not
counted, since a module does not depend on its siblings by living beside them.

What the client and the daemon share (endpoints, key files, shared tensors, descriptor
passing) lives in ``kvcache.transport`` and ``kvcache.protocol``; an edge from one side to the
other means a shared mechanism was put on the wrong side.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = (REPO / "kvcache", REPO / "benchmarks")

# Circles fixed on another branch, tolerated here until it merges. Each entry is the set of
# modules in one circle; the lead deletes an entry once its fix is on main.
KNOWN_CIRCLES: list[frozenset[str]] = []  # none: a new circle is a design question, not a listing

# Packages that must not reach each other through any chain of imports, either way.
SEPARATE: list[tuple[str, str]] = [("kvcache.client", "kvcache.server")]


def _module_names() -> dict[str, Path]:
    """Dotted name of every module in the packages, ``.pyi`` stubs (the native module) included."""
    out: dict[str, Path] = {}
    for path in sorted(p for root in ROOTS for p in root.rglob("*.py*")):
        if path.suffix not in (".py", ".pyi"):
            continue
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.setdefault(".".join(parts), path)
    return out


def _imported_modules(tree: ast.AST, package: str, modules: dict[str, Path]) -> Iterator[str]:
    """The package modules that import statements anywhere in ``tree`` load."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if owner := _owner(alias.name, modules):
                    yield owner
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: ``from .x import y`` inside ``package``
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            for alias in node.names:
                child = f"{module}.{alias.name}"
                owner = child if child in modules else _owner(module, modules)
                if owner:
                    yield owner


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies inside; None outside the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (no self edges)."""
    modules = _module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = set(_imported_modules(tree, package, modules)) - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def crossing(graph: dict[str, set[str]], source: str, target: str) -> list[str] | None:
    """A chain of imports from a module of package ``source`` to one of package ``target``
    (breadth first, so the shortest), or None when there is none."""
    starts = sorted(m for m in graph if _inside(m, source))
    parent: dict[str, str | None] = dict.fromkeys(starts)
    queue = list(starts)
    while queue:
        node = queue.pop(0)
        if _inside(node, target):
            chain = [node]
            while (up := parent[chain[-1]]) is not None:
                chain.append(up)
            return chain[::-1]
        for child in sorted(graph.get(node, ())):
            if child not in parent:
                parent[child] = node
                queue.append(child)
    return None


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return "{" + ", ".join(component) + "}: " + "; ".join(edges)


def test_the_graph_sees_hidden_imports() -> None:
    """The walker must see imports in functions and under TYPE_CHECKING, or circles hide."""
    graph = import_graph()
    assert "kvcache._native" in graph["kvcache.context"]  # ``from kvcache import _native``
    assert "kvcache.storage.l2.redis.url" in graph["kvcache.config"]  # imported inside a method


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_import_circles() -> None:
    graph = import_graph()
    unexpected = [c for c in circles(graph) if frozenset(c) not in KNOWN_CIRCLES]
    assert not unexpected, "import circles in kvcache:\n" + "\n".join(_describe(c, graph) for c in unexpected)


def test_crossings_are_found() -> None:
    graph = {
        "kvcache.client.api": {"kvcache.transport.x"},
        "kvcache.transport.x": {"kvcache.server.auth"},
        "kvcache.server.auth": set(),
        "kvcache.server.daemon": {"kvcache.transport.x"},
    }
    assert crossing(graph, "kvcache.client", "kvcache.server") == [
        "kvcache.client.api", "kvcache.transport.x", "kvcache.server.auth",
    ]  # fmt: skip
    assert crossing(graph, "kvcache.server", "kvcache.client") is None


def test_client_and_server_do_not_import_each_other() -> None:
    graph = import_graph()
    for a, b in SEPARATE:
        assert any(_inside(m, a) for m in graph) and any(_inside(m, b) for m in graph), (a, b)
        for source, target in ((a, b), (b, a)):
            chain = crossing(graph, source, target)
            assert chain is None, f"{source} imports {target}: " + " -> ".join(chain or [])


def test_kvcache_does_not_import_the_checkouts_benchmarks() -> None:
    graph = import_graph()
    assert any(_inside(m, "benchmarks") for m in graph)
    assert crossing(graph, "kvcache", "benchmarks") is None
