"""The README's five-minute path, from a TorchRec model to a served and queried one, run as a user copies it
(its own file, so the suite's workers run it beside tests/test_readme.py)."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys

import pytest

from server.launch import spawn_server
from tests.server.support import free_port
from tests.test_readme import FENCE, README, ROOT, commands


def _five_minute_path() -> list[str]:
    text = README.read_text()
    section = text[text.index("## From a TorchRec model to a served one") :]
    [(_, block)] = FENCE.findall(section)[:1]
    return commands(block)


def test_five_minute_path_is_short():
    assert len(_five_minute_path()) <= 10
    assert len(README.read_text().splitlines()) <= 200


@pytest.mark.slow
def test_five_minute_path_runs(tmp_path, monkeypatch, capsys):
    """The README's commands as a user copies them, in a fresh folder: the training stand-in in its own
    process, ``embserve serve`` in the background (the README says: a second terminal), the others in process
    (the suite's interpreter is the activated venv)."""
    from infer.cli import main

    monkeypatch.chdir(tmp_path)
    port = free_port()
    server = None
    try:
        for command in _five_minute_path():
            words = shlex.split(command.replace("50051", str(port)))
            if words[0] == "source":
                continue
            if words[0] == "python":
                subprocess.run([sys.executable, str(ROOT / words[1]), *words[2:]], check=True, timeout=600)
            elif words[:2] == ["embserve", "serve"]:
                server, bound = spawn_server(tmp_path / words[2], *words[3:5])
                assert bound == port
            else:
                assert main(words[1:]) == 0, command
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=60) == 0
    out = capsys.readouterr().out
    assert "lookup: output [4, 96]" in out and "predict: first scores" in out
