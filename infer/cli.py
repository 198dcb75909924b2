"""The ``embserve`` command line: demo, export, inspect, run."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from infer.errors import EmbserveError

if TYPE_CHECKING:
    from infer.config import ModelSpec
    from infer.planner.types import ShardingPlan

logger = logging.getLogger(__name__)


def _print_progress(name: str, done: int, total: int) -> None:
    line = f"  quantizing {name:<16} {done:>10,}/{total:,} rows ({100 * done / total:5.1f}%)"
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if done == total else "", flush=True)
    elif done == total:
        print(line, flush=True)


def _parse_table_dtypes(items: Sequence[str]) -> dict[str, str]:
    overrides = {}
    for item in items:
        name, sep, dtype = item.partition("=")
        if not sep or not name or not dtype:
            raise EmbserveError(f"--table-dtype {item!r} must look like NAME=DTYPE, e.g. user_id=fp16")
        overrides[name] = dtype
    return overrides


def cmd_demo(args: argparse.Namespace) -> int:
    from infer.demo import demo_spec
    from infer.export import export
    from infer.quant import accuracy_report, format_accuracy, quantize
    from infer.reference import random_weights

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
    return _demo_serve(out)


def _demo_serve(artifact: Path) -> int:
    """Serve the demo artifact on a free loopback port, query it, compare with in-process, stop with SIGTERM."""
    import signal

    import torch

    from infer.export import load
    from infer.quant import probe_batch
    from server.app import spawn_server
    from server.client import EmbserveClient

    print("\nserving the artifact over gRPC (loopback) and querying it with the Python client:", flush=True)
    server, port = spawn_server(artifact)
    try:
        runtime = load(artifact)
        batch = probe_batch(runtime.spec, batch_size=8, ids_per_bag=10, seed=3)
        with EmbserveClient(f"127.0.0.1:{port}") as client:
            started = time.perf_counter()
            pooled = client.lookup(batch)
            elapsed = time.perf_counter() - started
            dense = torch.randn(8, runtime.spec.num_dense_features, generator=torch.Generator().manual_seed(4))
            scores = client.predict(batch, dense)
        same = torch.equal(pooled, runtime.lookup(batch)) and torch.equal(scores, runtime.predict(batch, dense))
        print(f"  server on 127.0.0.1:{port}: lookup [8, {pooled.shape[1]}] in {1e3 * elapsed:.1f} ms")
        print(f"  scores {[round(v, 4) for v in scores.tolist()]}")
        print(f"  equal to the in-process runtime: {same}")
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    print(f"  server stopped on SIGTERM with exit code {code}")
    return 0 if code == 0 and same else 1


def cmd_export(args: argparse.Namespace) -> int:
    from infer.config import ModelSpec
    from infer.export import export
    from infer.quant import accuracy_report, format_accuracy, load_checkpoint, quantize

    spec = ModelSpec.load(args.spec).with_data_types(args.dtype, _parse_table_dtypes(args.table_dtype))
    plan = _export_plan(args, spec)
    if plan is not None:
        # the plan may have chosen per-table data types (constraints): quantize to those
        spec = spec.with_data_types(overrides={t.table: t.data_type for t in plan.tables})
    weights = load_checkpoint(args.weights, spec)
    model = quantize(spec, weights, progress=_print_progress)
    print(format_accuracy(accuracy_report(spec, weights, model)))
    if plan is not None:
        from infer.planner.stats import format_stats
        from infer.shard.builder import shard_model

        print()
        print(format_stats(plan))
        model = shard_model(model, plan)
    out = export(model, args.out, plan=plan)
    print(f"exported {out}" + (f" ({plan.topology.world_size} shards)" if plan is not None else ""))
    return 0


def _export_plan(args: argparse.Namespace, spec: ModelSpec) -> ShardingPlan | None:
    """The plan to shard with: read from --plan, made for --world-size, or none (unsharded)."""
    from infer.planner.planner import EmbeddingPlanner
    from infer.planner.types import ComputeDevice, ShardingPlan, Topology, load_constraints, parse_bytes

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise EmbserveError("--device cuda needs a CUDA device on this host; export with --device cpu")
    if args.plan:
        try:
            text = Path(args.plan).read_text()
        except OSError as err:
            raise EmbserveError(f"cannot read plan {args.plan!r}: {err.strerror}") from None
        return ShardingPlan.from_json(text)
    if not args.world_size:
        return None
    topology = Topology(
        args.world_size,
        ComputeDevice(args.device),
        (parse_bytes(args.device_memory),) if args.device_memory else (),
    )
    constraints = load_constraints(args.constraints, spec) if args.constraints else {}
    return EmbeddingPlanner(topology).plan(spec, constraints)


def cmd_inspect(args: argparse.Namespace) -> int:
    from infer.manifest import Manifest

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
    print(f"sharding     {sharding}")
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
    print()
    print(f"{'feature':<20} {'table':<16} {'columns':>12}")
    for f in spec.features:
        print(f"{f.name:<20} {f.table:<16} {f'{f.column_start}:{f.column_end}':>12}")
    print()
    for entry in manifest.files:
        print(f"file {entry.name:<12} {entry.bytes:>14,} bytes  sha256 {entry.sha256}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import torch

    from infer.export import load
    from infer.quant import probe_batch

    started = time.monotonic()
    device_map = dict(item.split("=", 1) for item in args.device_map.split(",")) if args.device_map else None
    runtime = load(args.artifact, device_map=device_map)
    print(f"loaded {args.artifact} (checksums verified) in {time.monotonic() - started:.2f}s")
    batch = probe_batch(runtime.spec, batch_size=args.batch_size, ids_per_bag=args.ids_per_bag, seed=1)
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
    from infer.planner.planner import EmbeddingPlanner
    from infer.planner.stats import format_stats, plot_plan
    from infer.planner.types import ComputeDevice, Topology, load_constraints, parse_bytes

    spec = demo_spec() if args.spec == "demo" else ModelSpec.load(args.spec)
    spec = spec.with_data_types(args.dtype, _parse_table_dtypes(args.table_dtype))
    topology = Topology(
        args.world_size,
        ComputeDevice(args.compute_device),
        (parse_bytes(args.device_memory),) if args.device_memory else (),
        host_memory=parse_bytes(args.host_memory) if args.host_memory else 0,
    )
    constraints = load_constraints(args.constraints, spec) if args.constraints else {}
    plan = EmbeddingPlanner(topology, args.batch_size).plan(spec, constraints)
    print(format_stats(plan))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(plan.to_json())
    print(f"\nwrote {out}")
    if args.plot:
        print(f"wrote {plot_plan(plan, args.plot)}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from server.app import ServerConfig, serve
    from server.auth import read_token_file

    config = ServerConfig(
        host=args.host,
        port=args.port,
        max_batch_size=args.max_batch_size,
        max_delay_us=args.max_delay_us,
        max_queue=args.max_queue,
        workers=args.workers,
        intra_op_threads=args.intra_op_threads,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        metrics_port=args.metrics_port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        auth_token=read_token_file(args.auth_token_file) if args.auth_token_file else None,
        drain_seconds=args.drain_seconds,
    )
    return asyncio.run(serve(args.artifact, config))


def cmd_query(args: argparse.Namespace) -> int:
    import torch

    from infer.config import ModelSpec, TableConfig
    from infer.quant import probe_batch
    from server.auth import read_token_file
    from server.client import EmbserveClient

    token = read_token_file(args.token_file) if args.token_file else None
    root = Path(args.tls_root).read_bytes() if args.tls_root else None
    with EmbserveClient(args.address, token=token, root_certificates=root, timeout=args.timeout) as client:
        metadata = client.metadata()
        print(
            f"model {metadata.model_version}: {len(metadata.tables)} tables, features {list(metadata.feature_order)}, "
            f"output dim {metadata.output_dim}"
        )
        if args.features:
            features = json.loads(args.features)
        else:
            spec = ModelSpec(
                tuple(
                    TableConfig(t.name, t.num_embeddings, t.embedding_dim, tuple(t.feature_names))
                    for t in metadata.tables
                )
            )
            features = probe_batch(spec, batch_size=args.batch_size, ids_per_bag=args.ids_per_bag, seed=args.seed)
        started = time.perf_counter()
        pooled = client.lookup(features, fp16=args.fp16)
        elapsed = time.perf_counter() - started
        print(f"lookup: output {list(pooled.shape)} in {1e3 * elapsed:.2f} ms")
        for column in metadata.columns[: args.show]:
            values = [round(v, 4) for v in pooled[0, column.start : min(column.end, column.start + 4)].tolist()]
            print(f"  row 0 {column.feature:<20} [{column.start}:{column.end}] {values} ...")
        if metadata.has_dense and not args.features:
            dense = torch.randn(
                pooled.shape[0], metadata.num_dense_features, generator=torch.Generator().manual_seed(0)
            )
            scores = client.predict(features, dense)
            print(f"predict: first scores {[round(v, 4) for v in scores[:5].tolist()]}")
    return 0


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
    exp.add_argument("--weights", required=True, help="checkpoint: {table_name: fp32 tensor} saved with torch.save")
    exp.add_argument("--out", required=True, help="artifact folder to write")
    exp.add_argument("--dtype", default=None, help="data type for every table (int8, int4, int2, fp16, fp32)")
    exp.add_argument("--table-dtype", action="append", default=[], metavar="NAME=DTYPE", help="per-table data type")
    exp.add_argument("--world-size", type=int, default=0, help="shard over this many devices (planned)")
    exp.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="device kind of the shards")
    exp.add_argument("--device-memory", default=None, help="memory per device for planning, e.g. 16GB")
    exp.add_argument("--constraints", default=None, help="planner constraints JSON")
    exp.add_argument("--plan", default=None, help="shard with this plan JSON (from embserve plan)")
    exp.set_defaults(func=cmd_export)

    ins = sub.add_parser("inspect", help="print an artifact's manifest")
    ins.add_argument("artifact")
    ins.add_argument("--json", action="store_true", help="print the raw manifest JSON")
    ins.set_defaults(func=cmd_inspect)

    plan = sub.add_parser("plan", help="plan table placement on the devices of one host")
    plan.add_argument("--spec", required=True, help="model spec JSON, or 'demo' for the built-in demo model")
    plan.add_argument("--world-size", type=int, required=True, help="number of devices")
    plan.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GB (default: per kind)")
    plan.add_argument("--host-memory", default=None, help="host memory for UVM placements, e.g. 1TB")
    plan.add_argument("--compute-device", choices=["cuda", "cpu"], default="cuda")
    plan.add_argument("--batch-size", type=int, default=512)
    plan.add_argument("--constraints", default=None, help="JSON {table_name: {constraint: value}}")
    plan.add_argument("--dtype", default=None, help="data type for every table")
    plan.add_argument("--table-dtype", action="append", default=[], metavar="NAME=DTYPE")
    plan.add_argument("--out", required=True, help="plan JSON to write")
    plan.add_argument("--plot", default=None, help="PNG with per-device memory and cost bars")
    plan.set_defaults(func=cmd_plan)

    srv = sub.add_parser("serve", help="serve an artifact over gRPC (SIGTERM drains, then exits 0)")
    srv.add_argument("artifact")
    srv.add_argument("--host", default="0.0.0.0")
    srv.add_argument("--port", type=int, default=50051)
    srv.add_argument("--max-batch-size", type=int, default=4096, help="examples per batched forward")
    srv.add_argument("--max-delay-us", type=int, default=1000, help="how long a request waits to be batched")
    srv.add_argument("--max-queue", type=int, default=1024, help="queued requests before RESOURCE_EXHAUSTED")
    srv.add_argument("--workers", type=int, default=0, help="concurrent forwards (0: cores / CPU shards)")
    srv.add_argument("--intra-op-threads", type=int, default=0, help="torch threads per forward (0: auto)")
    srv.add_argument("--max-message-mb", type=int, default=64)
    srv.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    srv.add_argument("--tls-cert", default=None)
    srv.add_argument("--tls-key", default=None)
    srv.add_argument("--auth-token-file", default=None, help="require 'authorization: Bearer <token>'")
    srv.add_argument("--drain-seconds", type=float, default=30.0)
    srv.set_defaults(func=cmd_serve)

    qry = sub.add_parser("query", help="query a server: metadata and one lookup")
    qry.add_argument("address", help="host:port")
    qry.add_argument("--features", default=None, help='JSON {"feature": [[ids], ...]}; default: a random batch')
    qry.add_argument("--batch-size", type=int, default=4)
    qry.add_argument("--ids-per-bag", type=int, default=5)
    qry.add_argument("--seed", type=int, default=0)
    qry.add_argument("--fp16", action="store_true", help="ask for fp16 output")
    qry.add_argument("--show", type=int, default=4, help="features to print")
    qry.add_argument("--token-file", default=None)
    qry.add_argument("--tls-root", default=None, help="PEM root certificate of a TLS server")
    qry.add_argument("--timeout", type=float, default=30.0)
    qry.set_defaults(func=cmd_query)

    run = sub.add_parser("run", help="load an artifact and time lookups on a random batch")
    run.add_argument("artifact")
    run.add_argument("--batch-size", type=int, default=512)
    run.add_argument("--ids-per-bag", type=int, default=20)
    run.add_argument("--iterations", type=int, default=10)
    run.add_argument("--device-map", default=None, metavar="FROM=TO,...", help="e.g. cuda:0=cpu,cuda:1=cpu")
    run.set_defaults(func=cmd_run)
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
