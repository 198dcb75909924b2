"""What plan and export share: the flags of the planning data, the precision planner, the mapped tier."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.commands.common import _with_dense_part
from infer.errors import ConfigError

if TYPE_CHECKING:
    from infer.config import DataType, ModelSpec
    from infer.planner.access import AccessSample
    from infer.planner.planner import EmbeddingPlanner
    from infer.planner.precision import PrecisionPlan
    from infer.planner.types import ParameterConstraints, Topology
    from infer.storage.sources import TableSource

logger = logging.getLogger(__name__)


def _add_planning_data_flags(parser: argparse.ArgumentParser) -> None:
    """Flags that plan and export share: what the requests read, the mapped tier of CPU devices, and the
    precision planner's budgets."""
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="choose every table's data type from its measured error so the tables fit this, e.g. 16GB",
    )
    parser.add_argument(
        "--error-budget",
        type=float,
        default=None,
        help="with it: the fewest bytes whose read-weighted relative error of pooled outputs is at most this "
        "(e.g. 0.01 for 1%%)",
    )
    parser.add_argument("--frontier", default=None, metavar="PNG", help="plot the error-vs-bytes frontier here")
    parser.add_argument(
        "--eval",
        default=None,
        metavar="FILE",
        help="evaluation sample with labels (torch.save dict: features {name: {ids, lengths}}, dense, labels): "
        "measure each table's error as the model's loss with it alone quantized (needs --weights and a dense part)",
    )
    parser.add_argument(
        "--error-measure",
        choices=["pooled", "output", "logloss", "auc"],
        default=None,
        help="what the budgets count: pooled (relative error of pooled outputs, read-weighted; the default without "
        "--eval), or with --eval the change in output, the rise in log loss (default) or the fall in AUC",
    )
    parser.add_argument(
        "--sample-ids",
        default=None,
        metavar="FILE",
        help="ids per feature from a sample of requests: JSON {feature: [ids]} or .npz (default: reads uniform over "
        "rows; with --memory-budget, precision blocks then hold each table's rows of largest range precise)",
    )
    parser.add_argument(
        "--mapped-capacity",
        default=None,
        help="CPU: table bytes that may be paged from mapped files beyond RAM, e.g. 500GB, 0 (none) or unbounded "
        "(default: the free disk of the output folder)",
    )


def _wants_precision(args: argparse.Namespace) -> bool:
    return args.memory_budget is not None or args.error_budget is not None or bool(getattr(args, "eval", None))


def _precision_plan(
    args: argparse.Namespace,
    spec: ModelSpec,
    tables: TableSource | None,
    constraints: Mapping[str, ParameterConstraints],
    sample: AccessSample | None,
    planner: EmbeddingPlanner,
) -> PrecisionPlan | None:
    """--memory-budget / --error-budget: every table's data type from its measured error (issue 28); on several
    devices that page nothing (CUDA, or CPU with --mapped-capacity 0) each table's device with it, every device
    within its memory."""
    if not _wants_precision(args):
        return None
    from infer.planner.precision import plan_precision
    from infer.planner.stats import format_precision, plot_frontier
    from infer.planner.utils import parse_bytes
    from infer.quant.measured_error import format_errors, measure_errors, rows_from_source, synthetic_normal_rows

    if args.dtype or args.table_dtype or getattr(args, "plan", None):
        raise ConfigError("--memory-budget/--error-budget choose every table's data type: drop --dtype, --table-dtype "
                          "and --plan (floors go in --constraints as min_data_type)")  # fmt: skip
    measure = args.error_measure or ("logloss" if args.eval else "pooled")
    if (measure == "pooled") == bool(args.eval):
        fix = "measures pooled outputs: drop --eval, or choose output, logloss or auc" if args.eval else (
            "needs an evaluation sample: give --eval FILE")  # fmt: skip
        raise ConfigError(f"--error-measure {measure} {fix}")
    if args.eval and tables is None:
        raise ConfigError("--eval measures the model on its own tables: give --weights")
    if tables is None:
        print("measuring error on synthetic N(0,1) rows (no --weights given)")
    # only the sampled rows are read from the tables' source: a table larger than RAM is never loaded whole
    source = rows_from_source(tables) if tables is not None else synthetic_normal_rows()
    if args.eval:
        from infer.quant.eval_error import load_eval_sample, measure_eval_errors

        # the model's loss depends on each table's pooling (the pooled error measure does not: a mean scales both)
        spec.require_stated_pooling(f'set "pooling" to "sum" or "mean" for each in {args.spec!r}, as the model says')

        model_spec = _with_dense_part(spec, getattr(args, "dense_arch", None))
        sampled = load_eval_sample(args.eval, model_spec)
        measured = measure_eval_errors(model_spec, source, sampled, measure, device_data_types(planner.topology))
    else:
        measured = measure_errors(spec, source, sample, device_data_types(planner.topology))
    print(f"error measure: {measure}" + (" (each table alone quantized, on the eval sample)" if args.eval else ""))
    print(format_errors(measured))
    budget = parse_bytes(args.memory_budget) if args.memory_budget is not None else None
    topology = planner.topology
    joint = topology.world_size > 1 and not topology.pages_weights
    device_budgets = planner.device_budgets(spec, constraints) if joint else None
    blocks = None
    if _blocks_allowed(args, topology):
        # ONNX does not serve blocks (``refuse_blocks``): with --sample-ids the blocks were asked for and such an
        # export is refused naming the flag; with a budget alone the rows' ranges rank none and whole tables are kept
        serves = not getattr(args, "onnx", False)
        why = "" if serves else "the --onnx form asked for does not serve blocks"
        blocks = _block_pricing(spec, tables if serves else None, sample, constraints, why)
    precision = plan_precision(spec, measured, budget, args.error_budget, constraints, sample, topology.row_alignment,
                               device_budgets=device_budgets, eval_measure=measure if args.eval else None,
                               blocks=blocks)  # fmt: skip
    print()
    print(format_precision(precision.to_dict(), frontier=True))
    if args.frontier:
        print(f"wrote {plot_frontier(precision.to_dict(), args.frontier)}")
    return precision


def device_data_types(topology: Topology) -> tuple[DataType, ...]:
    """The types the planner may choose: every measured type, less those fbgemm's kernel gets wrong on the
    topology's GPUs when this host has them (``infer.modules.cuda_probe``; each one left out is printed)."""
    from infer.modules.cuda_probe import kernel_type_error
    from infer.quant.measured_error import MEASURED_DATA_TYPES

    devices = sorted({topology.device_name(rank) for rank in range(topology.world_size)}) if topology.is_cuda else []
    kept = []
    for data_type in MEASURED_DATA_TYPES:
        errors = [e for e in (kernel_type_error(data_type, d) for d in devices) if e is not None]
        if errors:
            print(f"{data_type.value}: not offered: {errors[0]}")
        else:
            kept.append(data_type)
    return tuple(kept)


def _blocks_allowed(args: argparse.Namespace, topology: Topology) -> bool:
    """Precision blocks (issue 43) are priced when the error is the pooled one (not --eval); a block table is then
    placed table-wise, whole on one device. Which rows are hot comes from --sample-ids, or on one host from the
    rows' ranges (``_block_pricing``; a multi-host export ranks block tables by sampled ids only)."""
    one_host = topology.local_world_size >= topology.world_size
    return not getattr(args, "eval", None) and (one_host or bool(getattr(args, "sample_ids", None)))


def _block_pricing(
    spec: ModelSpec, tables: TableSource | None, sample: AccessSample | None,
    constraints: Mapping[str, ParameterConstraints], why_no_ranges: str = "",
) -> Callable[..., Any]:  # fmt: skip
    """``block_problem`` with its access model, said on one line: per table its sampled ids when --sample-ids has
    them, else (with the tables' rows at hand) reads uniform over rows with each row's error mass its range^2
    (``infer.planner.row_ranges``: one pass over the table's rows, skipped for a table --constraints fixes the
    type of; ``tables`` None with ``why_no_ranges`` says why they are not read); with neither, no blocks for the
    table."""
    from functools import partial

    from infer.planner.blocks import block_problem
    from infer.planner.row_ranges import range_access, ranked_by_sample

    by_sample = [t.name for t in spec.tables if ranked_by_sample(sample, t)]
    started = time.monotonic()
    free = [t.name for t in spec.tables if getattr(constraints.get(t.name), "data_type", None) is None]
    shares = range_access(spec, tables, sample, free) if tables is not None else {}
    if shares:
        by_ranges = f"{len(shares)} table(s) by their rows' ranges (reads uniform over rows, a row's error ~ range^2)"
        print(f"precision blocks: access model: {f'{len(by_sample)} table(s) by sampled ids, ' if by_sample else ''}"
              f"{by_ranges}{'' if by_sample else ': no --sample-ids says which rows are hot'}; row ranges read in "
              f"{time.monotonic() - started:.1f} s")  # fmt: skip
    elif by_sample:
        print(f"precision blocks: access model: sampled ids ({len(by_sample)} table(s))")
    elif why_no_ranges:
        print(f"precision blocks: not priced ({why_no_ranges}); whole tables")
    elif tables is None:
        print("precision blocks: not priced (no --sample-ids says which rows are hot, and no --weights whose rows' "
              "ranges rank them); give --sample-ids or --weights with --memory-budget to hold each table's hot rows "
              "precise and the rest small")  # fmt: skip
    else:
        print("precision blocks: not priced (--constraints fixes every table's data type)")
    return partial(block_problem, range_shares=shares)


def _mapped_capacity(flag: str | None, folder: Path) -> tuple[int | None, str]:
    """--mapped-capacity: a size, 'unbounded', or by default the free disk where the artifact (or plan) goes."""
    from infer.planner.types import free_disk_bytes
    from infer.planner.utils import parse_bytes

    if flag is None:
        return free_disk_bytes(folder)
    if flag.strip().lower() == "unbounded":
        return None, "given"
    return parse_bytes(flag), "given"
