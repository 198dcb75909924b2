"""Opt-in pytest plugin: one line per AOTInductor compile, to check that each model kind compiles once a session.

``EMBSERVE_COMPILE_LOG=/tmp/compiles.txt python -m pytest -p tests.support.count_compiles -n 2 --dist loadfile ...``
appends ``worker pid function seconds test`` for every ``torch._inductor.aoti_compile_and_package`` and
``aot_compile`` call, from every xdist worker (``aoti_compile_and_package`` calls ``aot_compile`` itself, so one
single-program compile shows as both; a package of several programs shows as one ``aot_compile`` each). Without
the variable it does nothing. A measurement aid: no test depends on it.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

LOG_VARIABLE = "EMBSERVE_COMPILE_LOG"


def _counted(name: str, compile_fn: Callable[..., Any], log: str) -> Callable[..., Any]:
    @functools.wraps(compile_fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return compile_fn(*args, **kwargs)
        finally:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            test = os.environ.get("PYTEST_CURRENT_TEST", "")
            with open(log, "a") as out:
                out.write(f"{worker} {os.getpid()} {name} {time.monotonic() - started:.1f}s {test}\n")

    return counted


def pytest_configure() -> None:
    log = os.environ.get(LOG_VARIABLE)
    if not log:
        return
    import torch._inductor

    for name in ("aoti_compile_and_package", "aot_compile"):
        setattr(torch._inductor, name, _counted(name, getattr(torch._inductor, name), log))
