"""The README's Python blocks run as written, in order, as one session."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from server.launch import spawn_server

README = Path(__file__).resolve().parent.parent / "README.md"
README_ADDRESS = "127.0.0.1:50051"


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
                server, port = spawn_server(tmp_path / "artifacts" / "quickstart")
                block = block.replace(README_ADDRESS, f"127.0.0.1:{port}")
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
