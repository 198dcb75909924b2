"""``embserve plan``: plan table placement on the devices of one host."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.commands.common import _parse_table_dtypes
from infer.commands.planning import _add_planning_data_flags, _mapped_capacity, _precision_plan

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def cmd_plan(args: argparse.Namespace) -> int:
    from infer.config import ModelSpec
    from infer.demo import demo_spec
    from infer.planner.access import load_sample_ids
    from infer.planner.planner import EmbeddingPlanner
    from infer.planner.stats import format_stats, plot_plan
    from infer.planner.types import Topology, load_constraints
    from infer.planner.utils import parse_bytes
    from infer.storage.sources import open_source

    spec = demo_spec() if args.spec == "demo" else ModelSpec.load(args.spec)
    spec = spec.with_data_types(args.dtype, _parse_table_dtypes(args.table_dtype))
    # this host's devices and memory unless the flags say otherwise; the plan's stats say which
    topology = Topology.detect(
        args.world_size,
        args.compute_device,
        parse_bytes(args.device_memory) if args.device_memory else None,
        host_memory=parse_bytes(args.host_memory) if args.host_memory else 0,
        mapped_capacity=_mapped_capacity(args.mapped_capacity, Path(args.out).parent),
    )
    constraints = load_constraints(args.constraints, spec) if args.constraints else {}
    sample = load_sample_ids(args.sample_ids, spec) if args.sample_ids else None
    tables = open_source(args.weights, spec) if args.weights else None
    planner = EmbeddingPlanner(topology, args.batch_size)
    precision = _precision_plan(args, spec, tables, constraints, sample, planner)
    plan = planner.plan(spec, constraints, sample, precision)
    print(format_stats(plan))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(plan.to_json())
    print(f"\nwrote {out}")
    if args.plot:
        print(f"wrote {plot_plan(plan, args.plot)}")
    return 0


def add_parser(sub: Any) -> None:
    """The ``plan`` subcommand."""
    plan = sub.add_parser("plan", help="plan table placement on the devices of one host")
    plan.add_argument("--spec", required=True, help="model spec JSON, or 'demo' for the built-in demo model")
    plan.add_argument("--world-size", type=int, required=True, help="number of devices")
    plan.add_argument(
        "--device-memory",
        default=None,
        help="memory per device, e.g. 80GB (default: this host's: each CUDA device's, or RAM / CPU devices)",
    )
    plan.add_argument("--host-memory", default=None, help="host memory for UVM placements, e.g. 1TB")
    plan.add_argument(
        "--compute-device",
        choices=["cuda", "cpu"],
        default=None,
        help="default: cuda where this host has CUDA, else cpu",
    )
    plan.add_argument("--batch-size", type=int, default=512, help="examples per request the cost model prices")
    plan.add_argument("--constraints", default=None, help="JSON {table_name: {constraint: value}}")
    _add_planning_data_flags(plan)
    plan.add_argument("--dtype", default=None, help="data type for every table")
    plan.add_argument("--table-dtype", action="append", default=[], metavar="NAME=DTYPE", help="per-table data type")
    plan.add_argument(
        "--weights", default=None, help="checkpoint {table: fp32 tensor} to measure error on (default: N(0,1) rows)"
    )
    plan.add_argument(
        "--dense-arch", default=None, metavar="FILE", help="with --eval: the dense part (TorchScript or torch.export)"
    )
    plan.add_argument("--out", required=True, help="plan JSON to write")
    plan.add_argument("--plot", default=None, help="PNG with per-device memory and cost bars")
    plan.set_defaults(func=cmd_plan)
