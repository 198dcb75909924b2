"""``embserve demo``: quantize, export, load, run and serve the built-in demo model."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from infer.commands.common import _print_progress, _server_cli

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def cmd_demo(args: argparse.Namespace) -> int:
    from infer.artifact.export import export
    from infer.demo import demo_spec
    from infer.quant.accuracy import accuracy_report, format_accuracy
    from infer.quant.quantize import quantize
    from infer.weights import random_weights

    spec = demo_spec()
    print(f"demo model: {len(spec.tables)} tables, {len(spec.feature_names)} features, output dim {spec.output_dim}")
    started = time.monotonic()
    weights = random_weights(spec, seed=args.seed)
    print(f"generated seeded fp32 weights in {time.monotonic() - started:.1f}s")
    started = time.monotonic()
    model = quantize(spec, weights, progress=_print_progress)
    print(f"quantized in {time.monotonic() - started:.1f}s\n")
    print("accuracy vs fp32 (probe batch of 256 bags x 20 ids per feature):")
    print(format_accuracy(accuracy_report(spec, weights, model)))
    del weights
    started = time.monotonic()
    out = export(model, args.out)
    print(f"\nexported {out} in {time.monotonic() - started:.1f}s")
    print("loading the artifact in a fresh process and running a batch:")
    sys.stdout.flush()
    command = [sys.executable, "-m", "infer.cli", "run", str(out), "--batch-size", str(args.batch_size)]
    code = subprocess.call(command)
    if code != 0 or args.no_serve:
        return code
    server_cli = _server_cli()
    if server_cli is None:
        print("\nthe server package is not installed: skipping the gRPC serving step")
        return 0
    return int(server_cli.serve_demo(out))


def add_parser(sub: Any) -> None:
    """The ``demo`` subcommand."""
    demo = sub.add_parser("demo", help="quantize, export, load and run the built-in demo model")
    demo.add_argument("--out", default="artifacts/demo", help="artifact folder")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random fp32 tables")
    demo.add_argument("--batch-size", type=int, default=512, help="examples per batch of the timed run")
    demo.add_argument("--no-serve", action="store_true", help="skip the gRPC serving step")
    demo.set_defaults(func=cmd_demo)
