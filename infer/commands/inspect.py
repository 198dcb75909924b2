"""``embserve inspect``: print (and verify) an artifact's manifest."""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.commands.common import _gb_rate

if TYPE_CHECKING:
    from infer.config import ModelSpec

logger = logging.getLogger(__name__)


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
    """``inspect``: each table held in precision blocks (issue 43), its blocks most precise first (the rows ranked
    first: most read by a sample, or of largest range) with rows and bytes, and its id remap's bytes (one int32 a
    row per feature)."""
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
        print(f"{'':<16} {t.name} in blocks, precise first: {', '.join(parts)}; id remap {remap}")


def add_parser(sub: Any) -> None:
    """The ``inspect`` subcommand."""
    ins = sub.add_parser("inspect", help="print an artifact's manifest")
    ins.add_argument("artifact", help="artifact folder")
    ins.add_argument("--json", action="store_true", help="print the raw manifest JSON")
    ins.add_argument("--verify", action="store_true", help="also check every file's size and checksums (and time it)")
    ins.set_defaults(func=cmd_inspect)
