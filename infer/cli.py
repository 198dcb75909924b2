"""The ``embserve`` command line: demo, export, inspect, plan, run (and serve, query from ``server.cli``)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from infer.artifact.load import BACKENDS
from infer.errors import ConfigError, EmbserveError

if TYPE_CHECKING:
    from infer.config import ModelSpec
    from infer.planner.access import AccessSample
    from infer.planner.planner import EmbeddingPlanner
    from infer.planner.precision import PrecisionPlan
    from infer.planner.types import ParameterConstraints, ShardingPlan, Topology
    from infer.storage.sources import TableSource

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


def cmd_export(args: argparse.Namespace) -> int:
    from infer.artifact.export import export
    from infer.config import ModelSpec
    from infer.quant.accuracy import accuracy_report, format_accuracy
    from infer.quant.quantize import quantize
    from infer.storage.sources import read_tables

    _check_export_out(Path(args.out), args.force)
    if bool(args.weights) == bool(args.from_torchrec):
        raise ConfigError("give the tables with exactly one of --weights CKPT and --from-torchrec PATH")
    overrides = _parse_table_dtypes(args.table_dtype)
    spec = _stated_pooling(ModelSpec.load(args.spec).with_data_types(args.dtype, overrides), args)
    # the precision planner measures each table's error on its rows: the tables are needed before the plan
    plan = _export_plan(args, spec, _export_source(args, spec) if _wants_precision(args) else None)
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
    spec, block_orders = _plan_blocks(args, spec, plan)
    # inputs are checked in the order the pipeline uses them: spec, plan, tables, then the dense part
    _check_dense_flags(spec, args.dense_arch, args.no_dense, args.spec)
    tables = _export_source(args, spec)
    spec = _with_dense_part(spec, args.dense_arch)
    if _streams(args, plan) and block_orders is None:
        return _export_streaming(args, spec, tables, plan)
    weights = read_tables(tables, spec)
    model = quantize(spec, weights, progress=_print_progress, block_orders=block_orders)
    print(format_accuracy(accuracy_report(spec, weights, model)))
    if plan is not None:
        from infer.planner.stats import format_stats
        from infer.shard.builder import shard_model

        print()
        print(format_stats(plan))
        if block_orders is not None:
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


def _streams(args: argparse.Namespace, plan: ShardingPlan | None) -> bool:
    """A mapped export of one CPU host without ONNX or pt2 streams its tables (never holds them all)."""
    one_cpu_host = plan is None or (
        not plan.topology.is_cuda and plan.topology.local_world_size >= plan.topology.world_size
    )
    return args.weights_format == "mapped" and not args.onnx and not args.pt2 and one_cpu_host


def _export_streaming(args: argparse.Namespace, spec: ModelSpec, source: TableSource, plan: ShardingPlan | None) -> int:
    from infer.artifact.stream import export_streaming

    if plan is not None:
        from infer.planner.stats import format_stats

        print(format_stats(plan))
        print()
    for table in spec.tables:
        print(f"  {table.name:<24} {table.data_type.value:<5} {table.num_embeddings:>13,} x {table.embedding_dim}")
    done = export_streaming(spec, source, args.out, plan, progress=_print_progress)
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


# --- issue 12 (TorchRec import): export's safety checks and the `spec` subcommand -------------------------


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


def _with_dense_part(spec: ModelSpec, dense_arch: str | None) -> ModelSpec:
    """Attach --dense-arch (checked against the spec: its call, and the pooled layout it records)."""
    if not dense_arch:
        return spec
    from infer.interop.dense_arch import load_dense_arch

    return spec.with_dense_arch(load_dense_arch(dense_arch, spec), spec.num_dense_features)


def cmd_spec(args: argparse.Namespace) -> int:
    from infer.interop.torchrec import spec_from_checkpoint

    spec = spec_from_checkpoint(args.from_torchrec)
    text = spec.to_json() + "\n"
    if args.out is None:
        print(text, end="")
        if spec.unstated_pooling:
            print(_unstated_pooling_hint(spec, "the spec"), file=sys.stderr)
        return 0
    out = Path(args.out)
    if out.exists() and not args.force:
        raise ConfigError(f"{str(out)!r} exists; pass --force to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if spec.unstated_pooling:
        print(
            f"wrote {out}: {len(spec.tables)} tables, one feature per table named like it, int8, "
            f"num_dense_features {spec.num_dense_features}; edit feature names and data types before exporting"
        )
        print(_unstated_pooling_hint(spec, str(out)))
    else:
        print(
            f"wrote {out}: {len(spec.tables)} tables with their features and pooling as the model's "
            f"EmbeddingBagConfigs say, int8, num_dense_features {spec.num_dense_features}; edit data types before "
            "exporting (the tables' rows come from a state dict or DCP folder: --from-torchrec)"
        )
    return 0


def _unstated_pooling_hint(spec: ModelSpec, spec_file: str) -> str:
    return (
        f"pooling: null for {list(spec.unstated_pooling)}: a state dict does not record it, and export refuses to "
        f'guess; set each table\'s "pooling" in {spec_file} to "sum" or "mean" as its EmbeddingBagConfig.pooling '
        "says (TorchRec's default is sum), or pass --pooling TABLE=sum|mean to export"
    )


def _export_source(args: argparse.Namespace, spec: ModelSpec) -> TableSource:
    """The tables of --weights (a torch.save checkpoint, memory-mapped; safetensors; a DCP folder) or
    --from-torchrec, as a source read table by table."""
    from infer.storage.sources import open_source

    return open_source(args.weights or args.from_torchrec, spec, torchrec=bool(args.from_torchrec))


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
        measured = measure_eval_errors(model_spec, source, load_eval_sample(args.eval, model_spec), measure)
    else:
        measured = measure_errors(spec, source, sample)
    print(f"error measure: {measure}" + (" (each table alone quantized, on the eval sample)" if args.eval else ""))
    print(format_errors(measured))
    budget = parse_bytes(args.memory_budget) if args.memory_budget is not None else None
    topology = planner.topology
    joint = topology.world_size > 1 and not topology.pages_weights
    device_budgets = planner.device_budgets(spec, constraints) if joint else None
    precision = plan_precision(spec, measured, budget, args.error_budget, constraints, sample, topology.row_alignment,
                               device_budgets=device_budgets, eval_measure=measure if args.eval else None,
                               blocks=_blocks_allowed(args, topology))  # fmt: skip
    print()
    print(format_precision(precision.to_dict(), frontier=True))
    if args.frontier:
        print(f"wrote {plot_frontier(precision.to_dict(), args.frontier)}")
    return precision


def _blocks_allowed(args: argparse.Namespace, topology: Topology) -> bool:
    """Precision blocks (issue 43) are priced when --sample-ids says which rows are hot, the error is the pooled
    one (not --eval) and the model goes on one device (sharding does not serve them yet)."""
    return bool(getattr(args, "sample_ids", None)) and not getattr(args, "eval", None) and topology.world_size == 1


def _plan_blocks(
    args: argparse.Namespace, spec: ModelSpec, plan: ShardingPlan | None
) -> tuple[ModelSpec, dict[str, Any] | None]:
    """The spec with the precision blocks the plan chose (its ``planner.precision`` record), and each block
    table's rows ranked hottest first by --sample-ids (what ``quantize`` fills the blocks with); none: unchanged."""
    rows = ((plan.planner.get("precision") or {}).get("tables") or []) if plan is not None else []
    chosen = {row["table"]: row["blocks"] for row in rows if row.get("blocks")}
    if not chosen:
        return spec, None
    if not getattr(args, "sample_ids", None):
        raise ConfigError(
            f"the plan holds table {next(iter(chosen))!r} in precision blocks, which are filled with the rows the "
            "sample reads most: give the --sample-ids the plan was made with"
        )
    from infer.config import ModelSpec
    from infer.planner.access import load_sample_ids
    from infer.planner.blocks import block_orders_from_sample

    tables = tuple(t.with_blocks([(b["rows"], b["data_type"]) for b in chosen[t.name]]) if t.name in chosen else t
                   for t in spec.tables)  # fmt: skip
    spec = ModelSpec(tables, spec.num_dense_features, spec.dense_arch)
    return spec, block_orders_from_sample(spec, load_sample_ids(args.sample_ids, spec))


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


def _mapped_capacity(flag: str | None, folder: Path) -> tuple[int | None, str]:
    """--mapped-capacity: a size, 'unbounded', or by default the free disk where the artifact (or plan) goes."""
    from infer.planner.types import free_disk_bytes
    from infer.planner.utils import parse_bytes

    if flag is None:
        return free_disk_bytes(folder)
    if flag.strip().lower() == "unbounded":
        return None, "given"
    return parse_bytes(flag), "given"


def cmd_inspect(args: argparse.Namespace) -> int:
    from infer.artifact.manifest import PT2_TABLES_IN_WEIGHT_FILES, Manifest

    folder = Path(args.artifact)
    manifest = Manifest.read(folder)
    if args.json:
        print(manifest.to_json(), end="")
        return 0
    spec = manifest.spec
    print(f"artifact     {folder}")
    print(f"format       v{manifest.format_version}, embserve {manifest.embserve_version}")
    print(f"versions     torch {manifest.torch_version}, fbgemm_gpu {manifest.fbgemm_version}")
    print(f"devices      {', '.join(manifest.devices)}")
    sharding = f"{manifest.world_size} shards, plan in {manifest.plan_file}" if manifest.plan_file else "unsharded"
    if manifest.host_parts:
        sharding += f", {manifest.num_hosts} hosts x {manifest.devices_per_host} devices (hosts/<h>/model.pt)"
        if manifest.plan_file:
            from infer.planner.types import ShardingPlan

            replicas = ShardingPlan.from_json((folder / manifest.plan_file).read_text()).replicas
            if replicas > 1:
                sharding += f", every table on {replicas} hosts (--replicas {replicas}: survives {replicas - 1} lost)"
    print(f"sharding     {sharding}")
    cpu_kernels = len([k for k in manifest.kernels if k.device == "cpu"])
    if cpu_kernels:
        budget = max(1, (os.cpu_count() or 1) // cpu_kernels)
        print(f"threads      {cpu_kernels} CPU kernel(s); on this host each splits a batch over up to {budget} threads")
    if manifest.onnx is not None:
        onnx = manifest.onnx
        print(
            f"onnx         {onnx.model_file} (+ {', '.join(onnx.data_files)}), opset {onnx.opset}, onnx "
            f"{onnx.onnx_version}, onnxruntime {onnx.onnxruntime_version}, pooling {onnx.pooling}"
            + (f", dense part alone in {onnx.dense_file}" if onnx.dense_file else "")
        )
    if manifest.pt2 is not None:
        pt2 = manifest.pt2
        programs = "lookups + dense" if pt2.dense_program else "lookups"
        tables = "tables from the weight files" if pt2.tables == PT2_TABLES_IN_WEIGHT_FILES else "tables inside it"
        print(f"pt2          {pt2.file} (AOTInductor, {programs}; {tables}), torch {pt2.torch_version}, {pt2.device}")
    dense = f"yes ({spec.num_dense_features} dense features)" if manifest.has_dense else "no"
    print(f"dense part   {dense}")
    print(f"output       [batch, {spec.output_dim}] float32")
    print()
    print(f"{'table':<16} {'rows':>12} {'dim':>5} {'dtype':<6} {'pooling':<8} features")
    for t in spec.tables:
        print(
            f"{t.name:<16} {t.num_embeddings:>12,} {t.embedding_dim:>5} {t.data_type.value:<6} "
            f"{t.pooling.value:<8} {', '.join(t.feature_names)}"
        )
    _print_blocks(spec)
    print()
    print(f"{'feature':<20} {'table':<16} {'columns':>12}")
    for f in spec.features:
        print(f"{f.name:<20} {f.table:<16} {f'{f.column_start}:{f.column_end}':>12}")
    if manifest.plan_file:
        from infer.planner.stats import format_plan_choices
        from infer.planner.types import ShardingPlan

        summary = format_plan_choices(ShardingPlan.from_json((folder / manifest.plan_file).read_text()))
        if summary:
            print()
            print(summary)
    print()
    for entry in manifest.files:
        chunks = f" ({len(entry.chunks.sha256)} chunk digests)" if entry.chunks is not None else ""
        print(f"file {entry.name:<12} {entry.bytes:>14,} bytes  sha256 {entry.sha256}{chunks}")
    if args.verify:
        started = time.perf_counter()
        manifest.verify_files(folder)
        seconds = time.perf_counter() - started
        total = sum(e.bytes for e in manifest.files)
        print(f"\nchecksums verified: {len(manifest.files)} files, {_gb_rate(total, seconds)}")
    return 0


def _print_blocks(spec: ModelSpec) -> None:
    """``inspect``: each table held in precision blocks (issue 43), its blocks hottest first with rows and bytes, and
    its id remap's bytes (one int32 a row per feature)."""
    from infer.planner.blocks import remap_bytes
    from infer.planner.utils import format_bytes
    from infer.quant.rowwise import CPU_ROW_ALIGNMENT, table_bytes

    for t in spec.tables:
        if not t.blocks:
            continue
        parts = [
            f"{b.rows:,} rows {b.data_type.value} "
            f"({format_bytes(table_bytes(b.rows, t.embedding_dim, b.data_type, CPU_ROW_ALIGNMENT))})"
            for b in t.blocks
        ]
        remap = format_bytes(remap_bytes(t))
        print(f"{'':<16} {t.name} in blocks, hottest first: {', '.join(parts)}; id remap {remap}")


def _gb_rate(total_bytes: int, seconds: float) -> str:
    rate = total_bytes / seconds / 1e9 if seconds > 0 else float("inf")
    return f"{total_bytes / 1e9:.2f} GB in {seconds:.2f}s, {rate:.2f} GB/s"


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


def _server_cli() -> ModuleType | None:
    """``server.cli`` (serve and query subcommands), loaded only when the CLI runs: ``infer`` itself never
    imports ``server``, and a host with the library alone still gets every other subcommand."""
    try:
        return importlib.import_module("server.cli")
    except ModuleNotFoundError as err:
        if err.name not in ("server", "server.cli"):
            raise
        return None


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
        help="ids per feature from a sample of requests: JSON {feature: [ids]} or .npz (default: uniform rows)",
    )
    parser.add_argument(
        "--mapped-capacity",
        default=None,
        help="CPU: table bytes that may be paged from mapped files beyond RAM, e.g. 500GB, 0 (none) or unbounded "
        "(default: the free disk of the output folder)",
    )


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows every option's default: ``(default: 50051)`` after the help of an option whose default is a
    value (not None, not an empty list, not a flag's off), unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if shows_default(action) and "%(default)" not in text and f"default: {action.default}" not in text:
            text += " (default: %(default)s)"
        return text


def shows_default(action: argparse.Action) -> bool:
    """Whether ``action``'s help must show its default: an option with a value for a default (a flag's off, None,
    an empty list or string and suppressed help say nothing)."""
    default = action.default
    return (
        bool(action.option_strings)
        and action.help != argparse.SUPPRESS
        and action.nargs != 0  # store_true/store_false/store_const: absent is the default
        and default is not None
        and default is not argparse.SUPPRESS
        and default not in ("", [])
    )


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every parser and subparser (server.cli's too) formats its help with ``DefaultsHelpFormatter``."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embserve", description="Quantize, export and serve embedding tables.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="quantize, export, load and run the built-in demo model")
    demo.add_argument("--out", default="artifacts/demo", help="artifact folder (default: ./artifacts/demo)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--batch-size", type=int, default=512)
    demo.add_argument("--no-serve", action="store_true", help="skip the gRPC serving step")
    demo.set_defaults(func=cmd_demo)

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

    spc = sub.add_parser("spec", help="write a starting spec.json from a TorchRec checkpoint")
    spc.add_argument("--from-torchrec", required=True, metavar="PATH", help="state dict file or DCP folder")
    spc.add_argument("--out", default=None, help="spec JSON to write (default: print it)")
    spc.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    spc.set_defaults(func=cmd_spec)

    ins = sub.add_parser("inspect", help="print an artifact's manifest")
    ins.add_argument("artifact")
    ins.add_argument("--json", action="store_true", help="print the raw manifest JSON")
    ins.add_argument("--verify", action="store_true", help="also check every file's size and checksums (and time it)")
    ins.set_defaults(func=cmd_inspect)

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
    plan.add_argument("--batch-size", type=int, default=512)
    plan.add_argument("--constraints", default=None, help="JSON {table_name: {constraint: value}}")
    _add_planning_data_flags(plan)
    plan.add_argument("--dtype", default=None, help="data type for every table")
    plan.add_argument("--table-dtype", action="append", default=[], metavar="NAME=DTYPE")
    plan.add_argument(
        "--weights", default=None, help="checkpoint {table: fp32 tensor} to measure error on (default: N(0,1) rows)"
    )
    plan.add_argument(
        "--dense-arch", default=None, metavar="FILE", help="with --eval: the dense part (TorchScript or torch.export)"
    )
    plan.add_argument("--out", required=True, help="plan JSON to write")
    plan.add_argument("--plot", default=None, help="PNG with per-device memory and cost bars")
    plan.set_defaults(func=cmd_plan)

    server_cli = _server_cli()
    if server_cli is not None:
        server_cli.add_subcommands(sub)

    run = sub.add_parser("run", help="load an artifact and time lookups on a random batch")
    run.add_argument("artifact")
    run.add_argument("--batch-size", type=int, default=512)
    run.add_argument("--ids-per-bag", type=int, default=20)
    run.add_argument("--iterations", type=int, default=10)
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
    _show_defaults(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Root at WARNING keeps fbgemm's per-library load messages quiet; embserve's own logs at INFO.
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    for package in ("infer", "server"):
        logging.getLogger(package).setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return int(args.func(args))
    except EmbserveError as err:
        print(f"embserve: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"embserve: error: {err}", file=sys.stderr)
        return 2
    except _grpc_error() as err:
        print(f"embserve: error: {err.code().name}: {err.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 2


def _grpc_error() -> type[Exception]:
    """grpc.RpcError when grpc is loaded (query/serve), else a type nothing raises."""
    grpc = sys.modules.get("grpc")
    return grpc.RpcError if grpc is not None else _NeverRaised  # type: ignore[no-any-return]


class _NeverRaised(Exception):
    pass


if __name__ == "__main__":
    sys.exit(main())
