"""No import circle anywhere in ``infer`` and ``server``: every import counts, at the top of a module, inside a
function, under ``if TYPE_CHECKING:`` and through ``importlib.import_module("literal")`` (tests/test_layout.py
and tests/server/test_import_graph.py keep the rooms' directions; this walk spans both packages at once)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.import_cycles import find_cycle

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("infer", "server")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    paths = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "proto" in path.relative_to(ROOT).parts[1:2]:  # server/proto: generated stubs, a test pins them
                continue
            paths[_module_name(path)] = path
    return paths


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _targets(node: ast.AST, modules: set[str]) -> set[str]:
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        if node.level or not _ours(module):  # relative: the house writes none; such an import is not followed
            return set()
        submodules = {f"{module}.{alias.name}" for alias in node.names} & modules
        return submodules or {module}
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if _ours(alias.name)}
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and _ours(node.args[0].value)
    ):
        return {node.args[0].value}
    return set()


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of infer/server it imports, anywhere in it. ``from package import module`` counts
    as importing the module; a module importing its own package (``__init__``) is left out (the package
    re-exporting its modules is not a circle)."""
    paths = _modules()
    names = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets |= _targets(node, names)
        graph[name] = {t for t in targets if t in names and t != name and not name.startswith(t + ".")}
    return graph


def test_the_walk_sees_every_kind_of_import():
    graph = import_graph()
    assert "infer.artifact.load" in graph["server.cli"]  # top level
    assert "server.app" in graph["server.cli"]  # inside a function
    assert "infer.artifact.kernel_types" in graph["infer.artifact.kernel_attributes"]  # under TYPE_CHECKING
    assert "server.cli" in graph["infer.commands.common"]  # importlib.import_module("server.cli")
    assert "infer.commands.demo" in graph["infer.cli"]  # ``from infer.commands import demo``


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_infer_and_server():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])
