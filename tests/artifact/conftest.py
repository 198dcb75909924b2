"""Tests marked ``large`` (over 2 GB of tables: about 70 s, 6 GB of memory, 5 GB of disk) run only when
``EMBSERVE_LARGE_TESTS=1``; otherwise they are deselected (not skipped) so ``make test`` stays fast."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("EMBSERVE_LARGE_TESTS") == "1":
        return
    large = [item for item in items if "large" in item.keywords]
    if large:
        config.hook.pytest_deselected(items=large)
        items[:] = [item for item in items if "large" not in item.keywords]
