"""The server's modules import each other one way: no cycles, lazy (function-level) imports included; a request
reads in one direction: protocol adapter (``server/adapters/``, each protocol its own room) -> the one shared
pipeline (``server/pipeline.py`` and the pieces beside it) -> adapter."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.import_cycles import find_cycle

SERVER = Path(__file__).resolve().parents[2] / "server"


def _imports(path: Path, modules: frozenset[str] | set[str] = frozenset()) -> set[str]:
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


def test_the_walk_sees_the_server_modules_and_their_imports():
    graph = _graph()
    assert "server.app" in graph and "server.adapters.v1.service" in graph["server.app"]
    assert "server.adapters.v1.codec" in graph["server.client"]  # ``from server.adapters.v1 import codec``


def test_no_import_cycle_among_server_modules():
    cycle = find_cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# ---------------------------------------------------------------------------------------- one way through
# each protocol's room; the OIP core (the protocol's calls and its tensor codec) is shared by OIP gRPC and REST
ROOMS = {
    "embserve.v1": ("server.adapters.v1",),
    "OIP core": ("server.adapters.oip.core", "server.adapters.oip.codec"),
    "OIP gRPC": ("server.adapters.oip.grpc_service",),
    "OIP REST": ("server.adapters.oip.rest_server",),
}
SHARED_WITH = {"OIP gRPC": {"OIP core"}, "OIP REST": {"OIP core"}}
FRONT_DOORS = ("embserve.v1", "OIP gRPC", "OIP REST")  # the rooms a request enters by
SHARED = ("server.pipeline", "server.validated", "server.batcher", "server.wire")  # the pipeline's pieces


def _room(module: str) -> str | None:
    for room, prefixes in ROOMS.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return room
    return None


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    pending = [start]
    while pending:
        for child in graph[pending.pop()]:
            if child not in seen:
                seen.add(child)
                pending.append(child)
    return seen


def test_every_protocol_has_its_room_under_server_adapters():
    graph = _graph()
    empty = [room for room in ROOMS if not any(_room(m) == room for m in graph)]
    assert not empty, f"no module in the rooms {empty}"
    loose = [m for m in graph if m.startswith("server.adapters.") and _room(m) is None]
    assert not loose, f"adapter modules in no room: {loose}"


def test_adapters_go_through_the_pipeline_and_never_through_each_other():
    graph = _graph()
    crossings = sorted(
        (module, target)
        for module, targets in graph.items()
        if (room := _room(module)) is not None
        for target in targets
        if (other := _room(target)) is not None and other != room and other not in SHARED_WITH.get(room, set())
    )
    assert not crossings, f"adapters importing another protocol's room: {crossings}"
    for room in FRONT_DOORS:
        modules = [m for m in graph if _room(m) == room]
        assert any("server.pipeline" in graph[m] for m in modules), f"{room} does not call the pipeline"


def test_the_pipeline_imports_no_adapter():
    graph = _graph()
    for shared in SHARED:
        assert shared in graph, f"no module {shared}"
        reached = sorted(m for m in _reach(graph, shared) if m.startswith("server.adapters"))
        assert not reached, f"{shared} reaches the adapters {reached}"


def test_a_crossing_between_rooms_is_seen():
    graph = {"server.adapters.oip.rest_server": {"server.adapters.v1.service"}, "server.adapters.v1.service": set()}
    room, target = "server.adapters.oip.rest_server", "server.adapters.v1.service"
    assert _room(room) == "OIP REST" and _room(target) == "embserve.v1"
    assert _room(target) not in SHARED_WITH["OIP REST"] and target in _reach(graph, room)
