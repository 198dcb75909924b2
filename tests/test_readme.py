"""The README's Python blocks run as written, in order, as one session."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
README_ADDRESS = "127.0.0.1:50051"


def _serve(artifact: Path) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "infer.cli", "serve", str(artifact), "--host", "127.0.0.1", "--port", "0"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()
    assert "serving on port" in line, line
    return server, f"127.0.0.1:{line.rsplit(' ', 1)[1].strip()}"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3, "README lost its python examples"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}  # later blocks use the names of earlier ones
    server = None
    try:
        for block in blocks:
            if README_ADDRESS in block:
                # the serving example talks to a server on the quickstart artifact
                server, address = _serve(tmp_path / "artifacts" / "quickstart")
                block = block.replace(README_ADDRESS, address)
            exec(compile(block, str(README), "exec"), namespace)
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=60) == 0
    assert (tmp_path / "artifacts" / "quickstart" / "manifest.json").is_file()
    assert (tmp_path / "artifacts" / "quickstart-sharded" / "plan.json").is_file()
    runtime = namespace["runtime"]
    expected = runtime.lookup({"user_id": [[1, 2, 3], [4]], "item_id": [[7], []], "last_item": [[8, 9], [10]]})
    assert server is not None and namespace["pooled"].equal(expected)
