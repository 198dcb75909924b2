"""Every code block of the README and of every docs page runs, or is checked against what it names, so a page
that lies fails the suite. The pages are read in the site's order (README first, then mkdocs.yml's nav).

What each kind of block gets:

- ``python``: run as written, in order, as one session (later blocks, on later pages too, use the names of
  earlier ones, so the quickstart's exports are made once and reused). The serving examples, which talk to
  ``127.0.0.1:50051`` / ``:8000``, get one server on the quickstart artifact, on free ports.
- ``sh`` / ``bash`` (and unlabelled): each command is checked here. An ``embserve`` command that is runnable as
  written is parsed by the real parser; a synopsis (``[optional]``, ``...``, ``a|b``, UPPERCASE placeholders)
  may name only flags its subcommand has. ``make X`` needs a target X in the Makefile, ``python path.py`` an
  existing script, ``-m infer.cli ...`` (launchers) is an ``embserve`` command. Every runnable (non-synopsis)
  command also runs: ``tests/test_docs_commands.py`` runs each in a scratch folder (servers started, queried
  where the page queries them, stopped on SIGTERM), or names the test that runs the same words (the README's
  five-minute path: ``tests/test_readme_five_minutes.py``; the cmake consumer: ``tests/cpp/test_consumer.py``;
  ``make X`` phases: ``make test``), or lists it in its ``NOT_RUN`` table with the reason and where it is covered
  instead (``make test`` itself, two-host launches, benchmarks).
- ``json``: parses; a model spec (``"tables"``) loads as a ``ModelSpec``.
- ``cmake``: ``tests/cpp/test_consumer.py`` builds and configures them. ``text``: pictures and formats, shown.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
from pathlib import Path

import pytest
import torch

from infer.cli import build_parser
from server.launch import spawn_server
from tests.server.support import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_ADDRESS = "127.0.0.1:50051"
README_HTTP_ADDRESS = "127.0.0.1:8000"  # the Open Inference Protocol's REST example (--http-port 8000)
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", flags=re.S | re.M)
SHELL = ("sh", "bash", "")
SYNOPSIS = re.compile(r"\[|\.\.\.|\||\b[A-Z][A-Z_]{1,}\b")


def pages() -> list[Path]:
    """The README, then every docs page in the site's order (a page missing from the nav fails the build)."""
    nav = re.findall(r":\s*([\w/-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    return [README, *(ROOT / "docs" / name for name in nav)]


def blocks(languages: tuple[str, ...]) -> list[tuple[Path, str]]:
    return [(page, body) for page in pages() for lang, body in FENCE.findall(page.read_text()) if lang in languages]


def test_every_docs_page_is_in_the_nav():
    listed = {path.resolve() for path in pages()[1:]}
    assert listed == {path.resolve() for path in (ROOT / "docs").rglob("*.md")}


def test_every_block_has_a_known_language():
    known = {"python", "json", "cmake", "text", *SHELL}
    found = {(page.name, lang) for page in pages() for lang, _ in FENCE.findall(page.read_text())}
    assert {(name, lang) for name, lang in found if lang not in known} == set()


def test_readme_and_docs_python_blocks_run(tmp_path, monkeypatch):
    found = blocks(("python",))
    assert len(found) >= 8, "the pages lost their python examples"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}  # later blocks use the names of earlier ones
    server = None
    http_port = free_port()
    try:
        for page, block in found:
            if README_ADDRESS in block or README_HTTP_ADDRESS in block:
                # the serving examples talk to one server on the quickstart artifact
                if server is None:
                    artifact = tmp_path / "artifacts" / "quickstart"
                    server, port = spawn_server(artifact, "--http-port", str(http_port))
                block = block.replace(README_ADDRESS, f"127.0.0.1:{port}")
                block = block.replace(README_HTTP_ADDRESS, f"127.0.0.1:{http_port}")
            exec(compile(block, str(page), "exec"), namespace)
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=60) == 0
    assert (tmp_path / "artifacts" / "quickstart" / "manifest.json").is_file()
    assert (tmp_path / "artifacts" / "quickstart-sharded" / "plan.json").is_file()
    runtime = namespace["runtime"]
    expected = runtime.lookup({"user_id": [[1, 2, 3], [4]], "item_id": [[7], []], "last_item": [[8, 9], [10]]})
    assert server is not None and namespace["pooled"].equal(expected)
    assert torch.equal(torch.from_numpy(namespace["oip_pooled"].copy()), expected)  # Triton's clients, same bits


def commands(block: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [shlex.split(line, comments=True) for line in joined.splitlines()]
    return [shlex.join(words) for words in lines if words]


def _embserve_words(words: list[str]) -> list[str] | None:
    if words[0] == "embserve":
        return words[1:]
    if "-m" in words and words[words.index("-m") + 1 : words.index("-m") + 2] == ["infer.cli"]:
        return words[words.index("-m") + 2 :]
    return None


def _subparser(argv: list[str]):
    parser = build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    return choices[argv[0]]


def check_command(command: str) -> None:
    words = shlex.split(command)
    argv = _embserve_words(words)
    if argv is not None:
        assert argv, command
        if SYNOPSIS.search(command):
            flags = {re.sub(r"=.*", "", w.strip("[]")) for w in argv if w.lstrip("[").startswith("--")}
            known = set(_subparser(argv)._option_string_actions)
            assert flags <= known, f"{command!r} names flags that `embserve {argv[0]}` lacks: {flags - known}"
        else:
            try:
                build_parser().parse_args(argv)
            except SystemExit:
                pytest.fail(f"`{command}` does not parse")
    elif words[0] == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        assert set(words[1:]) <= targets, f"{command!r}: no such make target"
    elif words[0] in ("python", "python3") and words[1].endswith(".py"):
        assert (ROOT / words[1]).is_file(), f"{command!r}: no such script"


def test_shell_blocks_name_what_exists():
    checked = 0
    for page, block in blocks(SHELL):
        for command in commands(block):
            try:
                check_command(command)
            except AssertionError as err:
                raise AssertionError(f"{page.relative_to(ROOT)}: {err}") from None
            checked += 1
    assert checked >= 25


def test_check_command_catches_a_lie():
    with pytest.raises(AssertionError):
        check_command("embserve export --spec s.json --out DIR [--no-such-flag]")
    with pytest.raises(pytest.fail.Exception):
        check_command("embserve serve artifacts/x --port notanumber")
    with pytest.raises(AssertionError):
        check_command("make no-such-target")
    check_command("embserve run DIR [--batch-size 512]")


def test_json_blocks_parse_and_specs_load():
    from infer.config import ModelSpec

    found = blocks(("json",))
    assert found
    for _page, block in found:
        data = json.loads(block)
        if "tables" in data:
            ModelSpec.from_json(block)
