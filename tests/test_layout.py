"""The library's rooms import in one direction: ``infer.storage`` (where bytes live) sits below
``infer.artifact`` and imports nothing from it; ``infer.artifact.load`` does not import ``hosts``; no module of
``infer`` is part of an import cycle (imports inside functions included, those for annotations only left out)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the infer modules it imports; ``from package import module`` counts as importing the module
    (a package's ``__init__`` re-exporting its modules is not a cycle)."""
    paths = {_module_name(path): path for path in sorted((ROOT / "infer").rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("infer"):
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & paths.keys()
                targets.update(submodules or {node.module})
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name.startswith("infer"))
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:`` (imports for annotations only never run)."""
    nodes: list[ast.AST] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))
    return nodes


def test_storage_imports_nothing_from_artifact() -> None:
    graph = _imports()
    upward = {(m, t) for m, targets in graph.items() if m.startswith("infer.storage") for t in targets}
    assert not {(m, t) for m, t in upward if t.startswith("infer.artifact")}


def test_load_does_not_import_hosts() -> None:
    assert "infer.artifact.hosts" not in _imports()["infer.artifact.load"]


def test_format_back_ends_live_in_their_room() -> None:
    loose = [p.name for p in (ROOT / "infer" / "artifact").glob("*.py") if p.stem.startswith(("onnx_", "pt2_"))]
    assert loose == []


def test_no_import_cycles_in_infer() -> None:
    graph = _imports()
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1 and not _is_package_of(target, node):
                cycles.append(stack[stack.index(target) :] + [target] if target in stack else [node, target])
            elif target not in state:
                visit(target, [*stack, target])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == []


def _is_package_of(package: str, module: str) -> bool:
    return module.startswith(package + ".")
