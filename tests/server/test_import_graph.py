"""The server's modules import each other one way: no cycles, lazy (function-level) imports included."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"


def _imports(path: Path, modules: set[str] = frozenset()) -> set[str]:  # type: ignore[assignment]
    """The ``server.*`` modules a file imports anywhere in it (top level or inside functions); ``from package
    import module`` counts as importing the module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and (node.module + ".").startswith("server."):
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            found |= submodules or {node.module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("server.")}
    return found


def _graph() -> dict[str, set[str]]:
    modules = {
        "server." + ".".join(path.relative_to(SERVER).with_suffix("").parts): path
        for path in SERVER.rglob("*.py")
        if "proto" not in path.relative_to(SERVER).parts and path.name != "__init__.py"
    }
    names = set(modules)
    return {name: {m for m in _imports(path, names) if m in modules and m != name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return path[path.index(child) :] + [child]
            if child not in state:
                found = visit(child)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_walk_sees_the_server_modules_and_their_imports():
    graph = _graph()
    assert "server.app" in graph and "server.adapters.v1.service" in graph["server.app"]
    assert "server.adapters.v1.codec" in graph["server.client"]  # ``from server.adapters.v1 import codec``


def test_no_import_cycle_among_server_modules():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
