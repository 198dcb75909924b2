"""The server's subcommands of ``embserve`` (serve, query) and the demo's serving step.

``infer.cli`` loads this module when the command line runs, so ``infer`` never imports ``server``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from infer.artifact.backends import BACKENDS
from infer.errors import ConfigError
from server.workers import WORKER_FLAG


def _workers_arg(text: str) -> int:
    if text == "auto":
        return max(1, os.cpu_count() or 1)
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of server processes, or auto") from None


# flags the instance of --workers N sets for each worker itself (the ports it owns, the worker's metrics port)
_INSTANCE_FLAGS = ("--workers", "--port", "--http-port", "--metrics-port", WORKER_FLAG)


def _worker_options(args: argparse.Namespace) -> list[str]:
    """The ``embserve serve`` flags given to the instance, as its workers get them (not the ports)."""
    options: list[str] = []
    for action in args.parser._actions:
        if not action.option_strings or action.dest in ("help",) or action.option_strings[0] in _INSTANCE_FLAGS:
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            options.append(action.option_strings[0])
        else:
            options += [action.option_strings[-1], str(value)]
    return options


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import signal
    import sys

    # Until the server's event loop takes the signals over, a SIGTERM while loading ends the process quietly.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    from server.native import exec_native, refuse_whole_artifact_flags, runs_native

    refuse_whole_artifact_flags(args)

    if runs_native(args):
        exec_native(args)  # never returns: the process becomes embserve-server
    from server.app import ServerConfig, exit_process, serve
    from server.auth import read_token_file
    from server.workers import parse_worker_flag, refuse_conflicts, serve_workers, wait_for_go

    processes = parse_worker_flag(args.worker_of_instance)[1] if args.worker_of_instance else args.workers
    if not args.worker_of_instance:
        refuse_conflicts(args.artifact, args.workers)

    config = ServerConfig(
        host=args.host,
        port=args.port,
        max_batch_size=args.max_batch_size,
        max_delay_us=args.max_delay_us,
        max_queue=args.max_queue,
        forward_threads=args.forward_threads,
        intra_op_threads=args.intra_op_threads,
        threads=args.threads,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        auth_token=read_token_file(args.auth_token_file) if args.auth_token_file else None,
        drain_grace_s=args.drain_grace_s,
        drain_quiet_s=args.drain_quiet_s,
        drain_seconds=args.drain_seconds,
        model_name=args.model_name,
        http_port=args.http_port,
        http_host=args.http_host,
        poll_s=args.poll_s,
        version_policy=args.version_policy,
        verify=args.verify,
        profile_s=args.profile,
        batch_wait=args.batch_wait,
        processes=processes,
        **({"max_merge_examples": args.max_merge_examples} if args.max_merge_examples else {}),
    )
    from server.group.leader import GroupConfig, is_multi_host
    from server.group.serve import serve_distributed

    wants_hot_rows = args.hot_rows is not None or args.hot_rows_sample is not None
    if is_multi_host(args.artifact):
        group = GroupConfig(collective_timeout_s=args.collective_timeout_s, failure_grace_s=args.failure_grace_s)
        # a broken group's peers may never answer: do not wait in process-group teardown at exit
        exit_process(serve_distributed(args.artifact, config, group))
    if not args.worker_of_instance and args.workers > 1:
        exit_process(serve_workers(args.artifact, _worker_options(args), config, args.workers))
    gate = None
    if args.worker_of_instance:
        gate = lambda running: wait_for_go(running.metrics_port)  # noqa: E731
        for handler in logging.getLogger().handlers:  # the instance's workers log to one stderr: say which
            handler.setFormatter(
                logging.Formatter(f"%(levelname)s worker {args.worker_of_instance} %(name)s: %(message)s")
            )
    artifact: Any = args.artifact
    if args.backend != "torchscript" or wants_hot_rows or args.prefetch != "auto":
        from infer.artifact.load import load
        from infer.commands.hot_rows import describe_hot_rows, hot_rows_of

        hot_rows = hot_rows_of(args, args.artifact)
        artifact = load(
            args.artifact, backend=args.backend, verify=args.verify, hot_rows=hot_rows, prefetch=args.prefetch
        )
        cache = describe_hot_rows(artifact)
        if cache is not None:
            print(cache, file=sys.stderr, flush=True)  # stdout's first line is the serving line
    # exits from the event loop once stopped; returns only when stopped during start-up
    exit_process(asyncio.run(serve(artifact, config, exiting=True, ready_gate=gate)))


def cmd_query(args: argparse.Namespace) -> int:
    import torch

    from infer.config import ModelSpec, TableConfig
    from infer.features import SparseFeatures
    from server.auth import read_token_file
    from server.client import EmbserveClient

    token = read_token_file(args.token_file) if args.token_file else None
    root = Path(args.tls_root).read_bytes() if args.tls_root else None
    if args.protocol == "oip":
        return _query_oip(args, token, root)
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
            features = SparseFeatures.random(
                spec, batch_size=args.batch_size, ids_per_bag=args.ids_per_bag, seed=args.seed
            )
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


def _query_oip(args: argparse.Namespace, token: str | None, root: bytes | None) -> int:
    """``embserve query --protocol oip``: the same metadata and lookup (and predict) over OIP."""
    import torch

    from infer.features import SparseFeatures
    from server.client import EmbserveClient
    from server.oip_client import spec_of

    client = EmbserveClient(
        args.address, token=token, root_certificates=root, timeout=args.timeout, protocol="oip",
        model=args.model, version=args.model_version,
    )  # fmt: skip
    with client:
        metadata = client.metadata()
        spec = spec_of(metadata)
        print(
            f"model {metadata.name} (versions {list(metadata.versions)}, {metadata.platform}): "
            f"features {list(spec.feature_names)}, output dim {spec.output_dim}"
        )
        features = (
            json.loads(args.features)
            if args.features
            else SparseFeatures.random(spec, batch_size=args.batch_size, ids_per_bag=args.ids_per_bag, seed=args.seed)
        )
        started = time.perf_counter()
        pooled = client.lookup(features, fp16=args.fp16)
        print(f"infer (embeddings): output {list(pooled.shape)} in {1e3 * (time.perf_counter() - started):.2f} ms")
        for feature in spec.features[: args.show]:
            start, end = feature.column_start, feature.column_end
            values = [round(v, 4) for v in pooled[0, start : min(end, start + 4)].tolist()]
            print(f"  row 0 {feature.name:<20} [{start}:{end}] {values} ...")
        num_dense = int(metadata.properties.get("num_dense_features", "0"))
        if num_dense and not args.features:
            dense = torch.randn(pooled.shape[0], num_dense, generator=torch.Generator().manual_seed(0))
            scores = client.predict(features, dense)
            print(f"infer (scores): first scores {[round(v, 4) for v in scores[:5].tolist()]}")
    return 0


def serve_demo(artifact: Path) -> int:
    """Serve the demo artifact on a free loopback port, query it, compare with in-process, stop with SIGTERM: with
    the Python server (``embserve serve --python``), then (when it is built) with the native binary, which ``embserve
    serve`` runs by default (``--native`` here, so that a broken build fails rather than falls back)."""
    import torch

    from infer.artifact.load import load
    from infer.features import SparseFeatures
    from server.native import BINARY, find_binary

    runtime = load(artifact)
    batch = SparseFeatures.random(runtime.spec, batch_size=8, ids_per_bag=10, seed=3)
    dense = torch.randn(8, runtime.spec.num_dense_features, generator=torch.Generator().manual_seed(4))
    expected = (runtime.lookup(batch), runtime.predict(batch, dense))
    servers: list[tuple[str, tuple[str, ...]]] = [("with the Python server (embserve serve --python)", ("--python",))]
    try:
        find_binary()
        servers.append((f"with the native binary {BINARY} (embserve serve, its default)", ("--native",)))
    except ConfigError:
        pass
    ok = True
    for how, flags in servers:
        print(f"\nserving the artifact {how} and querying it with the Python client:", flush=True)
        ok = _serve_and_query(artifact, flags, batch, dense, expected) and ok
    if len(servers) == 1:
        print(f"  ({BINARY} is not built: `make server` builds it, and the demo then serves with it too)")
    return 0 if ok else 1


def _serve_and_query(artifact: Path, flags: tuple[str, ...], batch: Any, dense: Any, expected: tuple[Any, Any]) -> bool:
    """One server of the demo: started with ``flags``, asked for ``batch``'s lookups and predictions, compared with
    ``expected`` bit for bit, stopped with SIGTERM; True when it answered equal and exited 0."""
    import signal

    import torch

    from server.client import EmbserveClient
    from server.launch import spawn_server

    # The dense part's matmuls round differently with another intra-op thread count: the server runs its
    # forwards with this process's count, so its answers can be compared bit for bit.
    threads = str(torch.get_num_threads())
    server, port = spawn_server(artifact, *flags, "--drain-grace-s", "1", "--intra-op-threads", threads)
    same = False
    try:
        with EmbserveClient(f"127.0.0.1:{port}") as client:
            started = time.perf_counter()
            pooled = client.lookup(batch)
            elapsed = time.perf_counter() - started
            scores = client.predict(batch, dense)
        same = torch.equal(pooled, expected[0]) and torch.equal(scores, expected[1])
        print(f"  server on 127.0.0.1:{port}: lookup [8, {pooled.shape[1]}] in {1e3 * elapsed:.1f} ms")
        print(f"  scores {[round(v, 4) for v in scores.tolist()]}")
        print(f"  equal to the in-process runtime: {same}")
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    print(f"  server stopped on SIGTERM with exit code {code}")
    return code == 0 and same


def add_subcommands(subcommands: Any) -> None:
    """Register ``serve`` and ``query`` on the ``embserve`` parser's subcommands."""
    srv = subcommands.add_parser(
        "serve",
        help="serve an artifact over gRPC and REST (SIGTERM drains, then exits 0)",
        description="Serve an artifact or a model repository: embserve.v1 and OIP over gRPC, OIP REST with "
        "--http-port. The native binary embserve-server runs it where it is built (make server); the Python server "
        "runs with --python, where the binary is not built, or where a request needs what only it serves (multi-host "
        "artifacts, --workers, --backend onnxruntime, --profile, --hot-rows of a sharded artifact): one line on stderr "
        "then says why.",
    )
    srv.add_argument("artifact", help="an artifact folder, or a repository REPO/<model>/<version>/ of artifacts")
    server_kind = srv.add_mutually_exclusive_group()
    server_kind.add_argument(
        "--native",
        action="store_true",
        help="serve with the native C++ binary embserve-server, refusing a flag it does not take by name (without "
        "--native or --python: the binary where it is built and takes every flag given, else the Python server)",
    )
    server_kind.add_argument(
        "--python",
        action="store_true",
        help="serve with the Python server (every flag: --workers, multi-host artifacts, --backend onnxruntime, "
        "--profile, --hot-rows of a sharded artifact)",
    )
    srv.add_argument("--host", default="0.0.0.0", help="address to bind (every interface; 127.0.0.1: this host only)")
    srv.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port); refused when in use")
    srv.add_argument("--max-batch-size", type=int, default=4096, help="examples per batched forward")
    srv.add_argument("--max-delay-us", type=int, default=1000, help="how long a request waits to be batched")
    srv.add_argument(
        "--max-merge-examples",
        type=int,
        default=0,
        help="requests merge into one forward up to this many examples (0: the server's default)",
    )
    srv.add_argument(
        "--batch-wait",
        choices=("overlap", "always"),
        default="overlap",
        help="overlap: a request waits --max-delay-us for company only while callers overlap (a lone caller is "
        "served at once); always: every request waits",
    )
    srv.add_argument(
        "--profile",
        type=float,
        nargs="?",
        const=10.0,
        default=None,
        metavar="N",
        help="log the pipeline's time per stage (decode, queue, merge, lookup, split, encode) every N s (10)",
    )
    srv.add_argument("--max-queue", type=int, default=1024, help="queued requests before RESOURCE_EXHAUSTED")
    srv.add_argument(
        "--workers",
        type=_workers_arg,
        default=1,
        help="server processes on the one port (auto: one per core); the instance owns the port, the workers map "
        "the same weights and share it (SO_REUSEPORT)",
    )
    srv.add_argument(WORKER_FLAG, default=None, help=argparse.SUPPRESS)  # a worker of an instance: "<index>/<N>"
    srv.add_argument(
        "--forward-threads", type=int, default=0, help="concurrent forwards per process (0: its cores / CPU shards)"
    )
    srv.add_argument("--intra-op-threads", type=int, default=0, help="torch threads per forward (0: auto)")
    srv.add_argument(
        "--threads",
        type=int,
        default=0,
        help="ranges a CPU kernel splits a batch into (0: cores / (forward threads x kernels))",
    )
    srv.add_argument(
        "--max-message-mb", type=int, default=64, help="largest request or response (gRPC message, REST body)"
    )
    srv.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (0: any free port)")
    srv.add_argument("--metrics-host", default=None, help="/metrics host (default: --host)")
    srv.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS (with --tls-key; both or neither)")
    srv.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    srv.add_argument("--auth-token-file", default=None, help="require 'authorization: Bearer <token>'")
    srv.add_argument(
        "--drain-grace-s",
        type=float,
        default=5.0,
        help="after SIGTERM: at most this long NOT_SERVING while still serving, for load balancers to move away",
    )
    srv.add_argument(
        "--drain-quiet-s",
        type=float,
        default=0.25,
        help="the grace ends early once no call arrived for this long and none is in flight "
        "(set it to --drain-grace-s to always wait the whole grace)",
    )
    srv.add_argument(
        "--drain-seconds", type=float, default=30.0, help="then: the longest wait for accepted calls to finish"
    )
    srv.add_argument(
        "--backend",
        choices=BACKENDS,
        default="torchscript",
        help="run model.pt (fbgemm), model.onnx (onnxruntime; export with --onnx) or model.pt2 (AOTInductor; --pt2)",
    )
    srv.add_argument(
        "--collective-timeout-s",
        type=float,
        default=30.0,
        help="multi-host artifacts (under torchrun): a rank that does not answer within this long fails the group",
    )
    srv.add_argument(
        "--failure-grace-s",
        type=float,
        default=2.0,
        help="multi-host: after a failure, seconds of NOT_SERVING and UNAVAILABLE before exiting 1",
    )
    srv.add_argument("--http-port", type=int, default=None, help="Open Inference Protocol REST port (0: any)")
    srv.add_argument("--http-host", default=None, help="REST host (default: --host)")
    srv.add_argument("--model-name", default=None, help="OIP model name of an artifact (default: its folder name)")
    srv.add_argument("--poll-s", type=float, default=None, help="a repository: look for new versions this often")
    srv.add_argument("--version-policy", default="latest:1", help="a repository: 'latest:N' or 'versions:1,3'")
    srv.add_argument(
        "--verify",
        choices=("full", "none"),
        default="full",
        help="checksums at load: full (every file's sha256, chunks in parallel) or none (sizes only)",
    )
    from infer.commands.hot_rows import add_hot_rows_arguments

    add_hot_rows_arguments(srv)
    srv.add_argument(
        "--prefetch",
        choices=("auto", "on", "off"),
        default="auto",
        help="read each batch's pages of a mapped artifact ahead of the kernel (madvise): auto (when the plan pages "
        "a table), on, off",
    )
    srv.set_defaults(func=cmd_serve, parser=srv)

    qry = subcommands.add_parser("query", help="query a server: metadata and one lookup")
    qry.add_argument("address", help="host:port")
    qry.add_argument("--features", default=None, help='JSON {"feature": [[ids], ...]}; default: a random batch')
    qry.add_argument("--batch-size", type=int, default=4, help="examples of the random batch (without --features)")
    qry.add_argument("--ids-per-bag", type=int, default=5, help="ids per bag of the random batch")
    qry.add_argument("--seed", type=int, default=0, help="seed of the random batch")
    qry.add_argument("--fp16", action="store_true", help="ask for fp16 output")
    qry.add_argument("--show", type=int, default=4, help="features to print")
    qry.add_argument("--token-file", default=None, help="file holding the bearer token (serve --auth-token-file)")
    qry.add_argument("--tls-root", default=None, help="PEM root certificate of a TLS server")
    qry.add_argument("--timeout", type=float, default=30.0, help="seconds each call may take")
    qry.add_argument("--protocol", choices=("v1", "oip"), default="v1", help="oip: the Open Inference Protocol")
    qry.add_argument("--model", default=None, help="oip: the model's name (its artifact or repository folder name)")
    qry.add_argument("--model-version", default="", help="oip: the version (default: the newest)")
    qry.set_defaults(func=cmd_query)
