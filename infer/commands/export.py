"""``embserve export``: quantize a checkpoint (planned, sharded, streamed) and write an artifact."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.commands.common import _parse_table_dtypes, _parse_table_values, _print_progress, _with_dense_part
from infer.commands.planning import _add_planning_data_flags, _mapped_capacity, _precision_plan, _wants_precision
from infer.errors import ConfigError, EmbserveError

if TYPE_CHECKING:
    from infer.config import ModelSpec
    from infer.planner.types import ShardingPlan
    from infer.storage.sources import TableSource

logger = logging.getLogger(__name__)


def cmd_export(args: argparse.Namespace) -> int:
    from infer.artifact.export import export
    from infer.config import ModelSpec
    from infer.planner.row_ranges import KeptRanges
    from infer.quant.accuracy import accuracy_report, format_accuracy
    from infer.quant.quantize import quantize
    from infer.storage.sources import read_tables

    _check_export_out(Path(args.out), args.force)
    if bool(args.weights) == bool(args.from_torchrec):
        raise ConfigError("give the tables with exactly one of --weights CKPT and --from-torchrec PATH")
    overrides = _parse_table_dtypes(args.table_dtype)
    spec = _stated_pooling(ModelSpec.load(args.spec).with_data_types(args.dtype, overrides), args)
    # the precision planner measures each table's error on its rows: the tables are needed before the plan
    # the rows' ranges read to price blocks are kept for ranking the block tables the plan chooses (one pass)
    planned_from = KeptRanges(_export_source(args, spec)) if _wants_precision(args) else None
    plan = _export_plan(args, spec, planned_from)
    if plan is not None:
        source = f"the plan {args.plan!r}" if args.plan else f"the plan made with --constraints {args.constraints!r}"
        _check_plan_data_types(plan, args.dtype, overrides, source)
        # the plan may have chosen per-table data types (constraints): quantize to those, and say so
        for table in plan.tables:
            declared = spec.table(table.table).data_type
            if declared != table.data_type:
                logger.warning(
                    "table %s: the spec says %s, %s is sized for %s; exporting %s",
                    table.table,
                    declared.value,
                    source,
                    table.data_type.value,
                    table.data_type.value,
                )
        spec = spec.with_data_types(overrides={t.table: t.data_type for t in plan.tables})
    spec, block_orders = _plan_blocks(args, spec, plan, planned_from)
    if planned_from is not None:
        planned_from.release()
    # inputs are checked in the order the pipeline uses them: spec, plan, tables, then the dense part
    _check_dense_flags(spec, args.dense_arch, args.no_dense, args.spec)
    tables = _export_source(args, spec)
    spec = _with_dense_part(spec, args.dense_arch)
    if _streams(args, plan, spec):
        return _export_streaming(args, spec, tables, plan, block_orders)
    weights = read_tables(tables, spec)
    model = quantize(spec, weights, progress=_print_progress, block_orders=block_orders)
    print(format_accuracy(accuracy_report(spec, weights, model)))
    if plan is not None:
        from infer.planner.stats import format_stats
        from infer.shard.builder import shard_model

        print()
        print(format_stats(plan))
        if block_orders is not None and plan.topology.world_size == 1:
            # one device, tables in precision blocks: the model is exported whole (the plan is in the stats above)
            plan = None
        elif plan.topology.world_size > plan.topology.local_world_size:
            from infer.artifact.hosts import export_hosts

            out = export_hosts(model, args.out, plan, weights=args.weights_format)
            hosts = plan.topology.world_size // plan.topology.local_world_size
            print(f"exported {out} ({hosts} hosts x {plan.topology.local_world_size} devices)")
            return 0
        if plan is not None:
            model = shard_model(model, plan)
    out = export(
        model,
        args.out,
        plan=plan,
        onnx=args.onnx,
        onnx_pooling=args.onnx_pooling,
        pt2=args.pt2,
        weights=args.weights_format,
    )
    dense = "with its dense part" if spec.dense_arch is not None else "lookups only"
    print(
        f"exported {out}"
        + (f" ({plan.topology.world_size} shards)" if plan is not None else "")
        + (" with model.onnx" if args.onnx else "")
        + (" with model.pt2" if args.pt2 else "")
        + f", {dense}"
    )
    return 0


def _stated_pooling(spec: ModelSpec, args: argparse.Namespace) -> ModelSpec:
    """The spec with every table's pooling stated, by the spec itself, --pooling, or the pooled layout that
    --dense-arch records (saved from ``infer.from_torchrec``); else a ``ConfigError`` naming each table left
    unstated and how to state it: a guessed pooling serves a MEAN-trained table summed without an error."""
    flags = _parse_table_values(args.pooling, "--pooling", "TABLE=POOLING, e.g. category=mean")
    stated = {t.name: t.pooling.value for t in spec.tables if t.pooling_stated}
    for name, pooling in flags.items():
        if stated.get(name, pooling.lower()) != pooling.lower():
            logger.warning("table %s: the spec says %s pooling, --pooling says %s; exporting %s", name,
                           stated[name], pooling.lower(), pooling.lower())  # fmt: skip
    spec = spec.with_pooling(flags)
    if spec.unstated_pooling and args.dense_arch:
        from infer.interop.dense_arch import recorded_pooling

        recorded = recorded_pooling(args.dense_arch)
        spec = spec.with_pooling({name: recorded[name] for name in spec.unstated_pooling if name in recorded})
    example = spec.unstated_pooling[0] if spec.unstated_pooling else ""
    spec.require_stated_pooling(
        f'set "pooling" to "sum" or "mean" for each in {args.spec!r} (as the model\'s EmbeddingBagConfig.pooling '
        f"says), or pass --pooling TABLE=sum|mean for each (e.g. --pooling {example}=mean); a --dense-arch saved "
        "from infer.from_torchrec(model).dense_arch states it too"
    )
    return spec


def _streams(args: argparse.Namespace, plan: ShardingPlan | None, spec: ModelSpec) -> bool:
    """A mapped export of one CPU host without ONNX or pt2 streams its tables (never holds them all); a model with
    tables in precision blocks sharded over several devices is exported in memory (the streamed writer places
    blocks unsharded; on one device the plan is only printed)."""
    one_cpu_host = plan is None or (
        not plan.topology.is_cuda and plan.topology.local_world_size >= plan.topology.world_size
    )
    sharded_blocks = plan is not None and plan.topology.world_size > 1 and bool(spec.block_tables)
    return args.weights_format == "mapped" and not args.onnx and not args.pt2 and one_cpu_host and not sharded_blocks


def _export_streaming(
    args: argparse.Namespace,
    spec: ModelSpec,
    source: TableSource,
    plan: ShardingPlan | None,
    block_orders: dict[str, Any] | None = None,
) -> int:
    """Stream the tables into a mapped artifact; tables in precision blocks go in ranked by ``block_orders``
    (the model is then exported whole, on one device, as the in-memory path exports it: the plan is only printed)."""
    from infer.artifact.stream import export_streaming

    if plan is not None:
        from infer.planner.stats import format_stats

        print(format_stats(plan))
        print()
    if block_orders is not None:
        plan = None
    for table in spec.tables:
        held = ", ".join(f"{b.rows:,} {b.data_type.value}" for b in table.blocks) or table.data_type.value
        print(f"  {table.name:<24} {held:<5} {table.num_embeddings:>13,} x {table.embedding_dim}")
    done = export_streaming(spec, source, args.out, plan, progress=_print_progress, block_orders=block_orders)
    dense = "with its dense part" if spec.dense_arch is not None else "lookups only"
    print(
        f"exported {done.path}"
        + (f" ({plan.topology.world_size} shards)" if plan is not None else "")
        + f", {dense}: streamed {done.tables} tables ({done.rows:,} rows, {done.weight_bytes / 1e9:.2f} GB of "
        f"weights) in {done.seconds:.1f}s, {done.rows / max(done.seconds, 1e-9):,.0f} rows/s; peak RSS "
        f"{done.peak_rss_bytes / 1e9:.2f} GB, peak anonymous RSS {done.peak_rss_anon_bytes / 1e9:.2f} GB"
    )
    _print_streamed_accuracy(spec, source, done.path)
    return 0


def _print_streamed_accuracy(spec: ModelSpec, source: TableSource, out: Path) -> None:
    """The accuracy table of a streamed export, which never holds a table whole: the artifact just written
    answers a probe batch, against fp32 pooled from only the probe's rows of the source."""
    from infer.artifact.load import load
    from infer.quant.accuracy import format_accuracy, sampled_accuracy_report

    started = time.monotonic()
    runtime = load(out, verify="none")  # written a moment ago; its sizes are still checked
    report = sampled_accuracy_report(spec, source, runtime.lookup)
    print(
        f"\naccuracy of the exported artifact vs fp32 (probe batch of 256 bags x 20 ids per feature; only its rows "
        f"read from the source, {time.monotonic() - started:.1f}s):"
    )
    print(format_accuracy(report))


def _check_export_out(out: Path, force: bool) -> None:
    """An existing non-empty --out is replaced only with --force."""
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"--out {str(out)!r} exists and is not empty; pass --force to replace it, or choose a new folder"
        )


def _check_plan_data_types(plan: ShardingPlan, dtype: str | None, overrides: dict[str, str], source: str) -> None:
    """--dtype/--table-dtype must agree with the plan's data types (the plan's memory was sized for those):
    a disagreement is an error naming the table, never a silent choice of one of them."""
    from infer.config import DataType

    for table in plan.tables:
        flag_value = overrides.get(table.table, dtype)
        if flag_value is None or DataType.parse(flag_value) == table.data_type:
            continue
        flag = f"--table-dtype {table.table}={flag_value}" if table.table in overrides else f"--dtype {flag_value}"
        raise ConfigError(
            f"table {table.table!r}: {flag} disagrees with {source}, which is sized for "
            f"{table.data_type.value}; drop the flag, or re-plan with it (`embserve plan ... {flag}`)"
        )


def _check_dense_flags(spec: ModelSpec, dense_arch: str | None, no_dense: bool, spec_file: str) -> None:
    """The dense flags agree with each other and the spec: one that declares dense features needs --dense-arch
    unless --no-dense says otherwise. (The file itself is read after the tables, in pipeline order.)"""
    if dense_arch and no_dense:
        raise ConfigError("--dense-arch and --no-dense contradict each other; give one")
    if not dense_arch and spec.num_dense_features > 0 and not no_dense:
        raise ConfigError(
            f"spec {spec_file!r} declares num_dense_features={spec.num_dense_features} but no dense part was given: "
            "pass --dense-arch FILE (TorchScript or torch.export, taking (dense [B, n], pooled [B, d])), "
            "or --no-dense to export lookups only"
        )


def _export_source(args: argparse.Namespace, spec: ModelSpec) -> TableSource:
    """The tables of --weights (a torch.save checkpoint, memory-mapped; safetensors; a DCP folder) or
    --from-torchrec, as a source read table by table."""
    from infer.storage.sources import open_source

    return open_source(args.weights or args.from_torchrec, spec, torchrec=bool(args.from_torchrec))


def _plan_blocks(
    args: argparse.Namespace, spec: ModelSpec, plan: ShardingPlan | None, planned_from: TableSource | None = None
) -> tuple[ModelSpec, dict[str, Any] | None]:
    """The spec with the precision blocks the plan chose (its ``planner.precision`` record), and each block
    table's rows ranked as the plan priced them (what ``quantize`` fills the blocks with): hottest first by
    --sample-ids, or largest range first by the rows themselves (``infer.planner.row_ranges``: from the ranges the
    plan was made with when ``planned_from`` kept them); none: unchanged."""
    from infer.planner.blocks import RANKED_BY_RANGES
    from infer.planner.row_ranges import ranking_of

    rows = ((plan.planner.get("precision") or {}).get("tables") or []) if plan is not None else []
    chosen = {row["table"]: row["blocks"] for row in rows if row.get("blocks")}
    if not chosen:
        return spec, None
    by_ranges = [row["table"] for row in rows if row.get("blocks") and ranking_of(row) == RANKED_BY_RANGES]
    by_sample = [name for name in chosen if name not in by_ranges]
    if by_sample and not getattr(args, "sample_ids", None):
        raise ConfigError(
            f"the plan holds table {by_sample[0]!r} in precision blocks, which are filled with the rows the "
            "sample reads most: give the --sample-ids the plan was made with"
        )
    from infer.config import ModelSpec
    from infer.planner.access import load_sample_ids
    from infer.planner.blocks import block_orders_from_sample
    from infer.planner.row_ranges import block_orders_from_ranges

    tables = tuple(t.with_blocks([(b["rows"], b["data_type"]) for b in chosen[t.name]]) if t.name in chosen else t
                   for t in spec.tables)  # fmt: skip
    spec = ModelSpec(tables, spec.num_dense_features, spec.dense_arch)
    ranked_from = planned_from if planned_from is not None else _export_source(args, spec)
    orders = block_orders_from_ranges(spec, ranked_from, by_ranges) if by_ranges else {}
    if by_sample:
        orders |= block_orders_from_sample(spec, load_sample_ids(args.sample_ids, spec), by_sample)
    return spec, orders


def _export_plan(args: argparse.Namespace, spec: ModelSpec, tables: TableSource | None = None) -> ShardingPlan | None:
    """The plan to shard with: read from --plan, made for --world-size, or none (unsharded); with a
    --memory-budget or --error-budget always a plan (one device unless told), which records the choice."""
    from infer.planner.access import load_sample_ids
    from infer.planner.planner import EmbeddingPlanner
    from infer.planner.replicas import place_replicas, replica_topology
    from infer.planner.types import ShardingPlan, Topology, load_constraints, require_devices_here
    from infer.planner.utils import parse_bytes

    if args.plan and _wants_precision(args):
        raise ConfigError("--plan fixes every table's data type: drop --memory-budget/--error-budget, or --plan")
    if args.plan:
        try:
            text = Path(args.plan).read_text()
        except OSError as err:
            raise EmbserveError(f"cannot read plan {args.plan!r}: {err.strerror}") from None
        plan = ShardingPlan.from_json(text)
        require_devices_here(plan.topology, f"the plan {args.plan!r}")
        return place_replicas(plan, args.replicas) if args.replicas > 1 else plan
    hosts = max(1, args.hosts)
    if args.replicas > 1 and hosts < 2:
        raise EmbserveError(f"--replicas {args.replicas} places each table on several hosts: give --hosts too")
    if hosts > 1 and args.world_size:
        raise EmbserveError("give either --world-size (one host) or --hosts with --devices-per-host, not both")
    devices = args.devices_per_host * hosts if hosts > 1 else args.world_size
    if not devices and not _wants_precision(args):
        return None
    devices = devices or 1
    topology = Topology.detect(
        devices,
        args.device,
        parse_bytes(args.device_memory) if args.device_memory else None,
        local_world_size=args.devices_per_host if hosts > 1 else 0,
        mapped_capacity=_mapped_capacity(args.mapped_capacity, Path(args.out)),
    )
    require_devices_here(topology, f"--device {args.device}")
    constraints = load_constraints(args.constraints, spec) if args.constraints else {}
    sample = load_sample_ids(args.sample_ids, spec) if args.sample_ids else None
    # with replicas, each host's own shards get 1 / replicas of its memory: the rest holds other hosts' shards
    planner = EmbeddingPlanner(replica_topology(topology, args.replicas) if args.replicas > 1 else topology)
    precision = _precision_plan(args, spec, tables, constraints, sample, planner)
    plan = planner.plan(spec, constraints, sample, precision)
    return place_replicas(plan, args.replicas, topology) if args.replicas > 1 else plan


def add_parser(sub: Any) -> None:
    """The ``export`` subcommand."""
    exp = sub.add_parser("export", help="quantize a checkpoint and export an artifact")
    exp.add_argument("--spec", required=True, help="model spec JSON (tables)")
    exp.add_argument(
        "--weights",
        default=None,
        help="the tables, named like the spec's: a torch.save checkpoint {table_name: fp32 tensor}, a .safetensors "
        "file, or a DCP folder (a mapped one-host CPU export streams them, a chunk of rows at a time)",
    )
    exp.add_argument("--out", required=True, help="artifact folder to write")
    exp.add_argument("--dtype", default=None, help="data type for every table (int8, int4, int2, fp16, fp32)")
    exp.add_argument("--table-dtype", action="append", default=[], metavar="NAME=DTYPE", help="per-table data type")
    exp.add_argument(
        "--pooling",
        action="append",
        default=[],
        metavar="TABLE=POOLING",
        help='per-table pooling (sum or mean), for tables whose spec says "pooling": null (a state dict does not '
        "record it) or to replace the spec's",
    )
    exp.add_argument("--world-size", type=int, default=0, help="shard over this many devices (planned)")
    exp.add_argument("--hosts", type=int, default=0, help="shard over this many hosts (one part per host)")
    exp.add_argument("--devices-per-host", type=int, default=1, help="devices of each host, with --hosts")
    exp.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="with --hosts: hold every table on this many hosts, so the group serves through a lost host",
    )
    exp.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="device kind of the shards")
    exp.add_argument(
        "--device-memory", default=None, help="memory per device for planning, e.g. 16GB (default: this host's)"
    )
    exp.add_argument("--constraints", default=None, help="planner constraints JSON")
    _add_planning_data_flags(exp)
    exp.add_argument("--plan", default=None, help="shard with this plan JSON (from embserve plan)")
    exp.add_argument(
        "--from-torchrec",
        default=None,
        metavar="PATH",
        help="take the tables from a TorchRec state dict file (any key prefix) or DCP folder instead of --weights",
    )
    exp.add_argument(
        "--dense-arch", default=None, metavar="FILE", help="dense part: TorchScript or torch.export (dense, pooled)"
    )
    exp.add_argument("--no-dense", action="store_true", help="export lookups only though the spec has dense features")
    exp.add_argument("--force", action="store_true", help="replace an existing, non-empty --out folder")
    exp.add_argument("--onnx", action="store_true", help="also write model.onnx (+ dense.onnx) for onnxruntime")
    exp.add_argument(
        "--pt2",
        action="store_true",
        help="also write model.pt2 (torch.export + AOTInductor; compiling takes about a minute)",
    )
    exp.add_argument("--onnx-pooling", default=None, help="ONNX pooling design: padded (default), prefix_sum, scatter")
    exp.add_argument(
        "--weights-format",
        choices=("embedded", "mapped"),
        default="mapped",
        help="mapped (default): each CPU weight buffer in a page-aligned file beside model.pt, mapped read-only "
        "at load by both loaders; embedded: every weight inside model.pt",
    )
    exp.set_defaults(func=cmd_export)
