"""MkDocs hook: fills every ``<!-- generated: NAME -->`` of a page from the code (docs/generate.py), so the CLI,
protos, metrics and error kinds are documented once, where they are defined."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE):  # the repository (infer, server) and docs/ (generate)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import generate  # noqa: E402


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return generate.expand(markdown)
