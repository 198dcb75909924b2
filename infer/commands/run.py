"""``embserve run``: load an artifact and time lookups on a random batch."""

from __future__ import annotations

import argparse
import logging
import time
from typing import TYPE_CHECKING, Any

from infer.artifact.backends import BACKENDS
from infer.commands.common import _gb_rate
from infer.commands.hot_rows import add_hot_rows_arguments, describe_hot_rows, hot_rows_of

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def cmd_run(args: argparse.Namespace) -> int:
    import torch

    from infer.artifact.load import load
    from infer.features import SparseFeatures

    started = time.monotonic()
    device_map = dict(item.split("=", 1) for item in args.device_map.split(",")) if args.device_map else None
    hot_rows = hot_rows_of(args, args.artifact)
    runtime = load(
        args.artifact,
        device_map=device_map,
        threads=args.threads or None,
        backend=args.backend,
        verify=args.verify,
        hot_rows=hot_rows,
    )
    checked = "checksums verified" if args.verify == "full" else "sizes checked, checksums not verified"
    threads = f"; each CPU kernel splits a batch over up to {runtime.threads} threads" if runtime.threads > 1 else ""
    print(f"loaded {args.artifact} ({checked}, {runtime.backend}) in {time.monotonic() - started:.2f}s{threads}")
    seconds = runtime.library_seconds
    libraries = f" ({seconds:.2f}s of it loading fbgemm's operators)" if seconds >= 0.01 else ""
    included = "checksums included" if args.verify == "full" else "no checksums"
    print(f"load rate: {_gb_rate(runtime.load_bytes, runtime.load_seconds)}, {included}{libraries}")
    cache = describe_hot_rows(runtime)
    if cache is not None:
        print(cache)
    batch = SparseFeatures.random(runtime.spec, batch_size=args.batch_size, ids_per_bag=args.ids_per_bag, seed=1)
    pooled = runtime.lookup(batch)
    times = []
    for _ in range(args.iterations):
        started = time.perf_counter()
        runtime.lookup(batch)
        times.append(time.perf_counter() - started)
    best = min(times)
    lookups = batch.values.numel()
    print(f"lookup: batch {args.batch_size}, {lookups:,} ids -> output {list(pooled.shape)}")
    print(f"  best of {args.iterations}: {1e3 * best:.2f} ms ({lookups / best / 1e6:.1f} M lookups/s)")
    first = runtime.spec.features[0]
    sample = pooled[0, first.column_start : first.column_start + 6].tolist()
    print(f"  sample: row 0, feature {first.name!r}, first columns {[round(v, 4) for v in sample]}")
    if runtime.has_dense:
        dense = torch.randn(
            args.batch_size, runtime.spec.num_dense_features, generator=torch.Generator().manual_seed(2)
        )
        scores = runtime.predict(batch, dense)
        print(f"predict: scores {list(scores.shape)}, first 5 {[round(v, 4) for v in scores[:5].tolist()]}")
    return 0


def add_parser(sub: Any) -> None:
    """The ``run`` subcommand."""
    run = sub.add_parser("run", help="load an artifact and time lookups on a random batch")
    run.add_argument("artifact", help="artifact folder")
    run.add_argument("--batch-size", type=int, default=512, help="examples per random batch")
    run.add_argument("--ids-per-bag", type=int, default=20, help="ids per bag of the random batch")
    run.add_argument("--iterations", type=int, default=10, help="timed lookups; the best is printed")
    run.add_argument("--device-map", default=None, metavar="FROM=TO,...", help="e.g. cuda:0=cpu,cuda:1=cpu")
    run.add_argument(
        "--threads", type=int, default=0, help="ranges a CPU kernel splits a batch into (0: cores / kernels)"
    )
    run.add_argument(
        "--backend",
        choices=BACKENDS,
        default="torchscript",
        help="model.pt, model.onnx or model.pt2",
    )
    run.add_argument(
        "--verify",
        choices=("full", "none"),
        default="full",
        help="checksums at load: full (every file's sha256, chunks in parallel) or none (sizes only)",
    )
    add_hot_rows_arguments(run)
    run.set_defaults(func=cmd_run)
