"""The hot-row cache's flags (``embserve run`` and ``embserve serve``)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.errors import ConfigError

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def add_hot_rows_arguments(parser: argparse.ArgumentParser) -> None:
    """``--hot-rows N --hot-rows-sample FILE`` (``embserve run`` and ``embserve serve``)."""
    parser.add_argument(
        "--hot-rows",
        type=int,
        default=None,
        metavar="N",
        help="keep the N rows read most often in --hot-rows-sample in a resident cache in front of the mapped "
        "tables (a mapped artifact, torchscript backend)",
    )
    parser.add_argument(
        "--hot-rows-sample",
        default=None,
        metavar="FILE",
        help='ids seen in requests: JSON {"feature": [ids, ...]} or an .npz of one int array per feature '
        "(the format of plan/export --sample-ids)",
    )


def hot_rows_of(args: argparse.Namespace, artifact: str | Path) -> dict[str, Any] | None:
    """The hot-row cache's rows the flags ask for (``infer.artifact.paged.hot_rows_from_sample``), or None;
    ``ConfigError`` naming the flag and the fix for N < 1 or one flag without the other."""
    if args.hot_rows is None and args.hot_rows_sample is None:
        return None
    if args.hot_rows is None or args.hot_rows_sample is None:
        raise ConfigError("--hot-rows N and --hot-rows-sample FILE go together: pass both, or neither")
    if args.hot_rows < 1:
        raise ConfigError(f"--hot-rows must be at least 1, got {args.hot_rows}; pass the rows the cache may hold")
    from infer.artifact.manifest import Manifest
    from infer.artifact.paged import hot_rows_from_sample

    spec = Manifest.read(Path(artifact)).spec
    return hot_rows_from_sample(spec, args.hot_rows_sample, args.hot_rows)


def describe_hot_rows(runtime: Any) -> str | None:
    """One line on the runtime's hot-row cache (rows, tables, bytes), or None without one."""
    cache = getattr(runtime.module, "cache", None)
    if cache is None:
        return None
    rows = sum(int(h.numel()) for h in cache.hot)
    return f"hot-row cache: {rows} rows of {len(cache.hot)} tables resident ({cache.weight_bytes} bytes)"
