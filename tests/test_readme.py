"""The README's Python blocks run as written, in order, as one session."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import torch

from server.launch import spawn_server
from tests.server.support import free_port

README = Path(__file__).resolve().parent.parent / "README.md"
README_ADDRESS = "127.0.0.1:50051"
README_HTTP_ADDRESS = "127.0.0.1:8000"  # the Open Inference Protocol's REST example (--http-port 8000)


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3, "README lost its python examples"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}  # later blocks use the names of earlier ones
    server = None
    http_port = free_port()
    try:
        for block in blocks:
            if README_ADDRESS in block or README_HTTP_ADDRESS in block:
                # the serving examples talk to one server on the quickstart artifact
                if server is None:
                    artifact = tmp_path / "artifacts" / "quickstart"
                    server, port = spawn_server(artifact, "--http-port", str(http_port))
                block = block.replace(README_ADDRESS, f"127.0.0.1:{port}")
                block = block.replace(README_HTTP_ADDRESS, f"127.0.0.1:{http_port}")
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
    assert torch.equal(torch.from_numpy(namespace["oip_pooled"].copy()), expected)  # Triton's clients, same bits
