"""What several subcommands share: progress lines, NAME=VALUE flags, the dense part, rates, server.cli."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from infer.errors import EmbserveError

if TYPE_CHECKING:
    from infer.config import ModelSpec

logger = logging.getLogger(__name__)


def _print_progress(name: str, done: int, total: int) -> None:
    line = f"  quantizing {name:<16} {done:>10,}/{total:,} rows ({100 * done / total:5.1f}%)"
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if done == total else "", flush=True)
    elif done == total:
        print(line, flush=True)


def _parse_table_dtypes(items: Sequence[str]) -> dict[str, str]:
    return _parse_table_values(items, "--table-dtype", "NAME=DTYPE, e.g. user_id=fp16")


def _parse_table_values(items: Sequence[str], flag: str, form: str) -> dict[str, str]:
    values = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise EmbserveError(f"{flag} {item!r} must look like {form}")
        values[name] = value
    return values


def _with_dense_part(spec: ModelSpec, dense_arch: str | None) -> ModelSpec:
    """Attach --dense-arch (checked against the spec: its call, and the pooled layout it records)."""
    if not dense_arch:
        return spec
    from infer.interop.dense_arch import load_dense_arch

    return spec.with_dense_arch(load_dense_arch(dense_arch, spec), spec.num_dense_features)


def _gb_rate(total_bytes: int, seconds: float) -> str:
    rate = total_bytes / seconds / 1e9 if seconds > 0 else float("inf")
    return f"{total_bytes / 1e9:.2f} GB in {seconds:.2f}s, {rate:.2f} GB/s"


def _server_cli() -> ModuleType | None:
    """``server.cli`` (serve and query subcommands), loaded only when the CLI runs: ``infer`` itself never
    imports ``server``, and a host with the library alone still gets every other subcommand."""
    try:
        return importlib.import_module("server.cli")
    except ModuleNotFoundError as err:
        if err.name not in ("server", "server.cli"):
            raise
        return None
