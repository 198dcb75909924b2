"""Every shell command of the README and the docs pages that is runnable as written (not a synopsis: see
``tests/test_readme.py``'s ``SYNOPSIS``) runs here, page by page, each page in its own scratch folder; or it is run
as written by another test, which is named and checked to run the same words; or it is in ``NOT_RUN`` with the
reason and where it is covered instead. A page command that is none of these, or a ``NOT_RUN`` entry no page has
any more, fails.

Servers (``embserve serve ...``, ``--native``) start in the background, are waited for (their "serving on port"
line), serve the commands the page then runs against them (``perf_analyzer``), and stop on SIGTERM with exit 0.
The only changes to a command before it runs are in ``substitute``.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.workers import SERVING_LINE
from tests.server.support import LineReader, free_port
from tests.test_readme import FENCE, ROOT, SHELL, SYNOPSIS, commands, pages

PAGE_PORTS = ("50051", "8000", "9090")  # the pages' gRPC, REST and metrics ports

# Commands that cannot run in the suite: command -> (why, where it is covered instead).
NOT_RUN: dict[str, tuple[str, str]] = {
    "make test": ("it is the suite itself", "make test"),
    "source .venv/bin/activate": (
        "it changes the calling shell only; the suite's interpreter is already the venv's (.venv/bin/python)",
        "tests/test_readme_five_minutes.py::test_five_minute_path_runs (the path's other commands, in that venv)",
    ),
    "make demo": (
        "22 s: eight tables up to 1,000,000 rows, served by both servers; its recipe is `$(BIN)/embserve demo`",
        "tests/test_cli.py::test_demo_runs_end_to_end (`embserve demo` in a subprocess)",
    ),
    "make server": (
        "it runs make's cmake build in the tree whose binaries the suite's other workers run; make test's cpp phase "
        "builds the same embserve-server (CPP_TARGETS=all)",
        "make test's cpp phase; tests/server's native cases run the binary",
    ),
    "grpcurl -plaintext 127.0.0.1:50051 list": (
        "grpcurl is not installed by make test",
        "tests/server/test_lifecycle.py::test_reflection_lists_the_service (the reflection list call grpcurl makes)",
    ),
    "python bench/perf_analyzer.py --concurrency 1 2 4 8 16": (
        "a benchmark: 8 tables of 200,000 rows, 1,000 requests per window at five concurrencies",
        "tests/server/test_perf_analyzer.py (its input data and perf_analyzer command, from bench/perf_analyzer.py)",
    ),
    "python -m server.group.launch --nnodes 2 --nproc-per-node 1 --node-rank '$HOST_INDEX' --master-addr HOST0 "
    "--master-port 29500 -m infer.cli serve artifacts/big --port 50051 --collective-timeout-s 30": (
        "one command per host, on two hosts",
        "tests/distributed/test_launch.py::test_sigterm_to_either_launcher_exits_0_everywhere (both hosts on loopback)",
    ),
    "torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --max-restarts 3 "
    "-m infer.cli serve artifacts/big --port 50051": (
        "one command per host, on two hosts",
        "tests/distributed/test_launch.py::test_a_killed_worker_is_restarted_and_the_group_serves_again (c10d, "
        "restarts)",
    ),
    "python bench/loadgen.py '>' main.jsonl": (
        "a benchmark (minutes of LoadGen scenarios)",
        "tests/bench/test_loadgen.py::test_loadgen_answers_every_sample_with_the_runtimes_output",
    ),
    "python bench/loadgen.py --baseline main.jsonl": (
        "a benchmark, against the previous line's output",
        "tests/bench/test_loadgen.py::test_loadgen_answers_every_sample_with_the_runtimes_output",
    ),
    "python bench/loadgen.py --protocols oip --scenarios server --workers 1 2": (
        "a benchmark (one and two worker processes under LoadGen's server scenario)",
        "tests/bench/test_loadgen.py::test_loadgen_answers_every_sample_with_the_runtimes_output",
    ),
    "python bench/server.py --methods lookup --workers 1 2": (
        "a benchmark (clients against one and two worker processes)",
        "tests/server/test_workers.py (the same --workers 2 server, answers and metrics)",
    ),
}


def substitute(command: str, ports: dict[str, int]) -> list[str]:
    """The one place a page command is changed before it runs: the pages' ports 50051 / 8000 / 9090 become free
    ones; ``HOST0`` (the first host) becomes 127.0.0.1 and ``$PWD`` the checkout; ``embserve`` is the suite's
    interpreter's (``-m infer.cli``: the venv's); ``perf_analyzer`` is ``make test``'s (.venv/bin/perf_analyzer),
    measuring concurrency 2 only over 50-request windows instead of 1 to 16 over 500, and not waiting for
    stable latencies (``-s 1000 --max-trials 3``, as bench/perf_analyzer.py: a shared host never holds them within
    10 %): the same requests and protocol, a load that always ends; the suite measures nothing."""
    for page_port, port in ports.items():
        command = re.sub(rf"\b{page_port}\b", str(port), command)
    command = command.replace("HOST0", "127.0.0.1").replace("$PWD", str(ROOT))
    words = shlex.split(command)
    if words[0] == "embserve":
        return [sys.executable, "-m", "infer.cli", *words[1:]]
    if words[0] == "perf_analyzer":
        from bench.perf_analyzer import find_perf_analyzer

        binary = find_perf_analyzer()
        if binary is None:
            pytest.skip("no perf_analyzer (make test installs .venv/bin/perf_analyzer)")
        load = {"--concurrency-range": "2:2", "--measurement-request-count": "50"}
        changed = [load.get(before, word) for before, word in zip(words, words[1:], strict=False)]
        return [binary, *changed, "-s", "1000", "--max-trials", "3"]
    return words


def page_commands() -> list[tuple[Path, str]]:
    """Every runnable (non-synopsis) shell command, in page order."""
    return [
        (page, command)
        for page, block in _shell_blocks()
        for command in commands(block)
        if not SYNOPSIS.search(_without_names(command))
    ]


def _shell_blocks() -> list[tuple[Path, str]]:
    return [(page, body) for page in pages() for lang, body in FENCE.findall(page.read_text()) if lang in SHELL]


def _without_names(command: str) -> str:
    """A command without its environment variables and CMake cache names, which are upper case but no
    placeholder (``$PWD``, ``-DCMAKE_PREFIX_PATH=``)."""
    return re.sub(r"\$[A-Z_]+|-D[A-Z_]+=", "", command)


# --- commands other tests run as written -----------------------------------------------------------------------


def _five_minute_path() -> list[str]:
    from tests.test_readme_five_minutes import _five_minute_path

    return _five_minute_path()


def _consumer_commands() -> list[str]:
    """The cmake and my_server commands tests/cpp/test_consumer.py's consumer test runs, read from its source with
    its names written as the page writes them (its build folder is the page's build/consumer, its artifact the
    page's artifacts/quickstart)."""
    source = ROOT / "tests" / "cpp" / "test_consumer.py"
    names = {
        "CONSUMER": "cpp_loader/examples/consumer",
        "INSTALL": "$PWD/cpp_loader/build/install",
        "build": "build/consumer",
        "unsharded_artifact": "artifacts/quickstart",
    }
    from tests.cpp.conftest import INSTALL

    assert INSTALL == ROOT / "cpp_loader" / "build" / "install"
    assert (ROOT / names["CONSUMER"]).is_dir()
    [test] = [
        node
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.FunctionDef)
        and node.name == "test_consumer_project_builds_against_the_package_and_runs"
    ]

    def word(node: ast.expr) -> str:
        if isinstance(node, ast.Constant):
            return str(node.value)
        if isinstance(node, ast.Name):
            return names[node.id]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str":
            return word(node.args[0])
        if isinstance(node, ast.BinOp):  # build / "my_server"
            return f"{word(node.left)}/{word(node.right)}"
        if isinstance(node, ast.JoinedStr):
            return "".join(word(v.value) if isinstance(v, ast.FormattedValue) else str(v.value) for v in node.values)
        raise AssertionError(f"test_consumer runs a word this test cannot read: {ast.unparse(node)}")

    found = []
    for node in ast.walk(test):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_cmake":
            found.append(shlex.join(["cmake", *map(word, node.args)]))
        elif isinstance(node, ast.List) and node.elts and "my_server" in ast.unparse(node.elts[0]):
            found.append(shlex.join(map(word, node.elts)))
    # the test builds optimized; the page leaves the build type to the reader
    return [command.replace(" -DCMAKE_BUILD_TYPE=Release", "") for command in found]


def _make_test_phases() -> list[str]:
    """``make X`` for each phase ``make test`` runs (``timed-X`` runs ``$(MAKE) X``)."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("\ntest:\n") : makefile.index("\nsetup:")]
    assert "$(MAKE) --no-print-directory $*" in makefile
    return [f"make {phase}" for phase in re.findall(r"\btimed-([\w-]+)", recipe)]


def run_elsewhere() -> dict[str, str]:
    """Page command -> the test that runs exactly it (computed from that test, so they cannot drift apart)."""
    five_minutes = "tests/test_readme_five_minutes.py::test_five_minute_path_runs"
    covered = {command: five_minutes for command in _five_minute_path() if not command.startswith("source ")}
    covered |= {command: "tests/cpp/test_consumer.py (consumer build and run)" for command in _consumer_commands()}
    covered |= {command: "make test (its phase)" for command in _make_test_phases()}
    return covered


def test_every_page_command_runs_or_says_why_not():
    """Each runnable command is run here (RUN_HERE), run by a named test, or listed in NOT_RUN; NOT_RUN and
    RUN_HERE name only commands a page still has."""
    on_pages = {command for _, command in page_commands()}
    elsewhere = run_elsewhere()
    unaccounted = on_pages - set(RUN_HERE) - set(elsewhere) - set(NOT_RUN)
    assert not unaccounted, f"page commands that neither run in the suite nor are in NOT_RUN: {sorted(unaccounted)}"
    assert set(NOT_RUN) <= on_pages, f"NOT_RUN lists commands no page has: {sorted(set(NOT_RUN) - on_pages)}"
    assert set(RUN_HERE) <= on_pages, f"RUN_HERE lists commands no page has: {sorted(set(RUN_HERE) - on_pages)}"
    assert not set(NOT_RUN) & (set(RUN_HERE) | set(elsewhere)), "a command both runs and is listed as not run"
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo: $(STAMP)\n\t$(BIN)/embserve demo\n" in makefile  # NOT_RUN's make demo: what test_cli runs
    assert re.search(r"\nserver:.*\n(\t.*\n)*\tcmake --build \$\(CPP_BUILD\) -j2 --target embserve-server\n", makefile)
    for _, where in NOT_RUN.values():
        path, _, name = where.partition(" ")[0].partition("::")
        if path.startswith("tests/"):
            assert (ROOT / path).exists(), where
            assert not name or f"def {name}(" in (ROOT / path).read_text(), where


def test_the_synopsis_rule_leaves_names_alone():
    assert not SYNOPSIS.search(_without_names("cmake -S a -B b -DCMAKE_PREFIX_PATH=$PWD/x"))
    assert SYNOPSIS.search(_without_names("embserve run DIR [--batch-size 512]"))
    assert substitute("embserve query 127.0.0.1:50051 --x 8000", {"50051": 1, "8000": 2})[3:] == [
        "query",
        "127.0.0.1:1",
        "--x",
        "2",
    ]


# --- the commands run here, with what each page assumes ---------------------------------------------------------


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    """artifacts/quickstart as the quickstart page's first python block exports it (two tables, 15k rows), for
    the pages that serve it."""
    folder = tmp_path_factory.mktemp("quickstart")
    page = ROOT / "docs" / "quickstart.md"
    block = next(body for lang, body in FENCE.findall(page.read_text()) if lang == "python")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        exec(compile(block, str(page), "exec"), {"__name__": "quickstart"})
    return folder / "artifacts" / "quickstart"


def _torchrec_page(folder: Path, quickstart: Path) -> None:
    """ckpt_dir (a DCP folder) and dense.pt of the smallest TorchRec DLRM: two 100-row tables of dim 8, 4 dense
    features, dense arch [8], over arch [8, 1]."""
    import torch.distributed.checkpoint as dcp
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM

    from infer.interop.torchrec import from_torchrec

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=n, num_embeddings=100, embedding_dim=8, feature_names=[n]) for n in "ab"]
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables),
        dense_in_features=4,
        dense_arch_layer_sizes=[8],
        over_arch_layer_sizes=[8, 1],
    ).eval()
    dcp.save(dlrm.state_dict(), checkpoint_id=str(folder / "ckpt_dir"), no_dist=True)
    torch.jit.save(torch.jit.script(from_torchrec(dlrm).dense_arch), str(folder / "dense.pt"))


def _edit_spec(folder: Path) -> None:
    """The torchrec page's "edit spec.json" step between its two commands: each table's pooling stated (sum)."""
    spec = json.loads((folder / "spec.json").read_text())
    for table in spec["tables"]:
        table["pooling"] = "sum"
    (folder / "spec.json").write_text(json.dumps(spec))


def _multihost_page(folder: Path, quickstart: Path) -> None:
    """spec.json and ckpt.pt ({table: fp32 rows}) of the smallest model --hosts 2 --devices-per-host 4 places:
    eight 64-row tables of dim 8."""
    from infer.config import ModelSpec, TableConfig

    spec = ModelSpec(tuple(TableConfig(f"t{i}", 64, 8, (f"f{i}",)) for i in range(8)))
    (folder / "spec.json").write_text(spec.to_json())
    torch.save({t.name: torch.randn(t.num_embeddings, t.embedding_dim) for t in spec.tables}, folder / "ckpt.pt")


def _serving_page(folder: Path, quickstart: Path) -> None:
    """artifacts/quickstart, and input.json of its valid requests (bench/perf_analyzer.py's write_input_data)."""
    from bench.perf_analyzer import write_input_data
    from infer.artifact.load import load

    (folder / "artifacts").mkdir()
    (folder / "artifacts" / "quickstart").symlink_to(quickstart)
    write_input_data(load(quickstart).spec, folder / "input.json", batch_size=4, steps=2)


def _cpp_page(folder: Path, quickstart: Path) -> None:
    from infer.errors import ConfigError
    from server.native import find_binary

    try:
        find_binary()
    except ConfigError as err:  # make test builds it (its cpp phase)
        pytest.skip(f"no embserve-server: {err}")
    (folder / "artifacts").mkdir()
    (folder / "artifacts" / "quickstart").symlink_to(quickstart)


PREREQUISITES = {"torchrec.md": _torchrec_page, "multihost.md": _multihost_page, "serving.md": _serving_page,
                 "cpp.md": _cpp_page}  # fmt: skip
AFTER = {"embserve spec --from-torchrec ckpt_dir --out spec.json": _edit_spec}

# What each command run here must leave behind (besides exit 0).
RUN_HERE: dict[str, str] = {
    "embserve spec --from-torchrec ckpt_dir --out spec.json": "spec.json",
    "embserve export --spec spec.json --from-torchrec ckpt_dir --out artifacts/dlrm --dense-arch dense.pt "
    "--world-size 2": "artifacts/dlrm/manifest.json",
    "embserve serve artifacts/quickstart --port 50051 --http-port 8000": "",
    "perf_analyzer -m quickstart -i grpc -u 127.0.0.1:50051 --input-data input.json --concurrency-range 1:16:2 "
    "--measurement-mode count_windows --measurement-request-count 500": "",
    "embserve export --spec spec.json --weights ckpt.pt --out artifacts/big --hosts 2 --devices-per-host 4": (
        "artifacts/big/manifest.json"
    ),
    "embserve export --spec spec.json --weights ckpt.pt --out artifacts/ha --hosts 3 --replicas 2": (
        "artifacts/ha/manifest.json"
    ),
    "embserve serve artifacts/quickstart --native --port 50051 --metrics-port 9090": "",
}


def _pages_run_here() -> list[str]:
    return sorted({page.name for page, command in page_commands() if command in RUN_HERE})


def _start(words: list[str], folder: Path, log: Path) -> subprocess.Popen[str]:
    with log.open("w") as err:
        server = subprocess.Popen(words, cwd=folder, stdout=subprocess.PIPE, stderr=err, text=True)
    reader = LineReader(server.stdout)  # bounded: a server that hangs before serving fails the test, not the run
    try:
        reader.wait_for(SERVING_LINE, timeout=120)
        assert reader.lines[0].startswith(SERVING_LINE), reader.lines[0]  # its first line, as a user sees it
    except AssertionError as err:
        server.kill()
        server.wait()
        pytest.fail(f"`{shlex.join(words)}` did not serve: {err}\n{log.read_text()[-3000:]}")
    return server


@pytest.fixture
def folder(page_name: str, quickstart: Path, tmp_path: Path) -> Path:
    """A scratch folder holding what the page assumes (PREREQUISITES)."""
    folder = tmp_path / "work"
    folder.mkdir()
    PREREQUISITES.get(page_name, lambda *_: None)(folder, quickstart)
    return folder


@pytest.mark.parametrize("page_name", _pages_run_here())
def test_page_commands_run(page_name, folder, tmp_path, monkeypatch):
    """The page's runnable commands in order, in its scratch folder."""
    from infer.cli import main

    monkeypatch.chdir(folder)
    ports = {page_port: free_port() for page_port in PAGE_PORTS}
    servers: list[subprocess.Popen[str]] = []
    ran = []
    try:
        for page, command in page_commands():
            if page.name != page_name or command not in RUN_HERE:
                continue
            words = substitute(command, ports)
            if words[3:4] == ["serve"]:
                servers.append(_start(words, folder, tmp_path / f"server{len(servers)}.log"))
            elif words[:3] == [sys.executable, "-m", "infer.cli"]:
                assert main(words[3:]) == 0, command  # in process: the suite's interpreter is the venv's
            else:
                done = subprocess.run(words, cwd=folder, capture_output=True, text=True, timeout=300)
                assert done.returncode == 0, f"`{command}`:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
                assert not command.startswith("perf_analyzer") or "Throughput:" in done.stdout, done.stdout[-3000:]
            if RUN_HERE[command]:
                assert (folder / RUN_HERE[command]).exists(), command
            if command in AFTER:
                AFTER[command](folder)
            ran.append(command)
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)
        codes = [server.wait(timeout=60) for server in servers]
    assert codes == [0] * len(servers)
    assert ran
