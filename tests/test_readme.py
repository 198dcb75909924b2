"""The README's Python blocks run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}  # the blocks read as one session: later ones use earlier names
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert (tmp_path / "artifacts" / "quickstart" / "manifest.json").is_file()
    assert (tmp_path / "artifacts" / "quickstart-sharded" / "plan.json").is_file()
