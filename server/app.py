"""Create, run and stop the embserve gRPC server (grpc.aio).

``create_server`` builds a started server and returns it with its port (tests bind port 0);
``serve`` runs one until SIGTERM/SIGINT, then drains: health NOT_SERVING at once, calls still served for
``drain_grace_s`` (so load balancers move away) or until traffic stopped for ``drain_quiet_s``, then no new calls
and every accepted one finished. Starting one in a subprocess (demo, tests, benchmarks) is ``server.launch``'s job.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from infer.artifact.load import load
from infer.artifact.runtime import Runtime
from infer.errors import ConfigError
from infer.features import SparseFeatures
from server.adapters.oip.core import OpenInference
from server.adapters.oip.grpc_service import add_to_server as add_open_inference
from server.adapters.oip.rest_server import RestServer
from server.adapters.v1.service import SERVICE_NAME, InferenceServicer, add_to_server
from server.auth import BearerTokenInterceptor
from server.batcher import MAX_MERGE_EXAMPLES
from server.health import DrainingHealthServicer
from server.metrics import ServerMetrics, profile_line
from server.pipeline import Pipeline
from server.ports import Port, cannot_bind, probe
from server.repository import Repository, is_repository, open_repository
from server.workers import SERVING_LINE

__all__ = ["SERVING_LINE", "ServerConfig", "RunningServer", "create_server", "serve", "serve_until", "check_ports"]

logger = logging.getLogger(__name__)

# Stopping waits until no call arrived for this long (each refused with UNAVAILABLE), then closes the port.
_QUIET_S = 0.1
# how long a stop keeps a REST connection open whose last answer said keep-alive: its client may be sending on it
# (a thread of a loaded client can wait this long between an answer and its next request)
_REST_LINGER_S = 1.0
# how often the grace looks again while a call is in flight
_POLL_S = 0.01


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    max_batch_size: int = 4096  # examples per batched forward (and per request)
    max_merge_examples: int = MAX_MERGE_EXAMPLES  # requests merge into one forward up to this many examples
    max_delay_us: int = 1000  # how long a request waits for others to batch with
    max_queue: int = 1024  # requests waiting; beyond it callers get RESOURCE_EXHAUSTED
    forward_threads: int = 0  # concurrent forwards; 0 -> this process's cores // CPU shards of the model (>= 1)
    intra_op_threads: int = 0  # torch threads per forward; 0 -> cores // (forward threads x CPU shards), >= 1
    threads: int = 0  # example ranges a CPU kernel splits a batch into; 0 -> cores // (forwards x CPU kernels)
    # server processes of one instance (`embserve serve --workers N`, server/workers.py): each one's share of the
    # cores is cores // processes, and it binds the instance's ports with SO_REUSEPORT (the instance owns them)
    processes: int = 1
    max_message_bytes: int = 64 * 1024 * 1024
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: any free port
    metrics_host: str | None = None  # None: the gRPC host
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None
    drain_grace_s: float = 5.0  # after SIGTERM: NOT_SERVING but still serving, for load balancers to notice
    drain_quiet_s: float = 0.25  # ... ended early once no call arrived for this long and none is in flight
    drain_seconds: float = 30.0  # then: at most this long for accepted calls to finish
    warmup_batches: int = 3
    # Open Inference Protocol (server/adapters/oip/)
    model_name: str | None = None  # the OIP model name; None: the artifact's folder name
    http_port: int | None = None  # None: no REST endpoint; 0: any free port
    http_host: str | None = None  # None: the gRPC host
    poll_s: float | None = None  # a repository: look for new versions this often (None: only on load calls)
    version_policy: str = "latest:1"  # a repository: "latest:N" or "versions:1,3"
    verify: str = "full"  # checksums at load: "full" (every file's sha256) or "none" (sizes only)
    batch_wait: str = "overlap"  # "overlap": wait max_delay_us only while callers overlap; "always": every request
    profile_s: float | None = None  # log the pipeline's per-stage breakdown every this many seconds (--profile)


# the ports the processes of one instance share (SO_REUSEPORT, held by the instance); each has its own metrics port
SHARED_ROLES = ("gRPC", "HTTP")


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    servicer: InferenceServicer
    pipeline: Pipeline
    health: DrainingHealthServicer
    metrics: ServerMetrics
    metrics_port: int | None = None
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    oip: OpenInference | None = None
    http_port: int | None = None
    profiler: asyncio.Task[None] | None = None

    async def drain(self, grace_s: float, timeout_s: float, quiet_s: float = 0.0, exiting: bool = False) -> None:
        """NOT_SERVING now; keep serving for ``grace_s``, or until no call arrived for ``quiet_s`` and
        none is in flight (traffic moved away, or there was none); then stop (``stop``)."""
        await self.health.enter_graceful_shutdown()
        if self.oip is not None:
            self.oip.is_ready = False  # the Open Inference Protocol's readiness says the same
        if grace_s > 0 and not self.stopped.is_set():
            logger.info("draining: NOT_SERVING, still serving for up to %.1f s (until %.2f s quiet)", grace_s, quiet_s)
            ended = await self._grace(grace_s, quiet_s)
            logger.info("draining: %s", ended)
        await self.stop(timeout_s, exiting=exiting)

    def _last_arrival(self) -> float:
        http = self.oip.http if self.oip is not None else None
        return max(self.pipeline.last_arrival, http.last_arrival if http is not None else 0.0)

    def _idle(self) -> bool:
        http = self.oip.http if self.oip is not None else None
        return self.pipeline.in_flight == 0 and (http is None or http.in_flight == 0)

    async def _grace(self, grace_s: float, quiet_s: float) -> str:
        """Wait out the grace; returns why it ended. Health checks are no traffic: they do not extend it."""
        deadline = time.monotonic() + grace_s
        while True:
            now = time.monotonic()
            if now >= deadline:
                return f"the grace of {grace_s:.1f} s is over"
            quiet = now - self._last_arrival()
            if quiet >= quiet_s and self._idle():
                return f"no call for {quiet:.2f} s and none in flight: grace ended early"
            await asyncio.sleep(min(deadline - now, max(quiet_s - quiet, _POLL_S)))

    async def stop(self, timeout_s: float | None = None, exiting: bool = False) -> None:
        """Stop in this order, so that no call is ever cancelled:

        1. NOT_SERVING, health watches end;
        2. no new call is accepted: model calls get UNAVAILABLE (gRPC) or 503 (REST), the REST port closes
           and each REST connection closes after its next answer;
        3. every call accepted before that is answered (at most ``timeout_s`` seconds in all);
        4. the connections close (a REST connection kept alive before the stop once it is answered or went unused
           for ``_REST_LINGER_S``: its client may be sending on it). ``exiting`` (``embserve serve``: the
           process exits next): gRPC's close with the process, so a call sent in the last instant meets a
           closed connection (UNAVAILABLE).
           grpc's own stop (in-process servers) would cancel such a call: it sends GOAWAY and cancels every
           call that reached its transport and had no handler yet (CANCELLED); so it comes only after the
           refusals went quiet for ``_QUIET_S``, which clients that keep retrying at once may never give.
        """
        if self.stopped.is_set():
            return
        if self.profiler is not None:
            self.profiler.cancel()
        await self.health.enter_graceful_shutdown()
        if self.oip is not None:
            self.oip.is_ready = False
        await self.health.end_watches()  # health streams would otherwise hold the stop for its whole timeout
        deadline = time.monotonic() + (timeout_s or 0.0)
        self.pipeline.begin_closing()
        if self.oip is not None:
            self.oip.stop_accepting()
        await self._answer_accepted(deadline)
        if not exiting:
            await self.pipeline.quiesce(_QUIET_S, _left(deadline))
            await self.server.stop(None if timeout_s is None else _left(deadline))
        if self.oip is not None:
            await self.oip.close(_left(deadline), _REST_LINGER_S)
        await self.pipeline.close()
        await asyncio.to_thread(self.metrics.close)
        self.stopped.set()

    async def _answer_accepted(self, deadline: float) -> None:
        """Wait until every accepted gRPC and REST call is answered, or the deadline passes."""
        http = self.oip.http if self.oip is not None else None

        async def answered() -> None:
            # a gRPC call refused while closing never waits (so none starts to be in flight any more)
            await self.pipeline.drained()
            if http is not None:
                await http.wait_answered()

        try:
            await asyncio.wait_for(answered(), _left(deadline))
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            logger.warning("stopping: calls still in flight after the drain's timeout (--drain-seconds)")


# awaited by a worker process once warm, before it reports SERVING (server/workers.py: all at once)
ReadyGate = Callable[[RunningServer], Awaitable[None]]


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def exit_process(code: int) -> NoReturn:
    """Leave at once, everything already stopped: skip the interpreter's teardown of torch and its libraries
    (~0.45 s here, more on a loaded host), and let the kernel close what grpc still holds."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cpu_shards(runtime: Runtime) -> int:
    return runtime.manifest.world_size if all(d == "cpu" for d in runtime.manifest.devices) else 1


def _cores(config: ServerConfig) -> int:
    """This process's share of the cores: all of them, or 1/N each for the N processes of one instance."""
    return max(1, (os.cpu_count() or 1) // max(1, config.processes))


def _workers(runtime: Runtime, config: ServerConfig) -> int:
    if config.forward_threads > 0:
        return config.forward_threads
    return max(1, _cores(config) // _cpu_shards(runtime))


def _set_intra_op_threads(runtime: Runtime, workers: int, config: ServerConfig) -> None:
    """Concurrent forwards (and CPU shards) already fill the cores: torch's own pool would only oversubscribe."""
    threads = config.intra_op_threads or max(1, _cores(config) // (workers * _cpu_shards(runtime)))
    if torch.get_num_threads() != threads:
        logger.info("intra-op threads %d -> %d (%d workers)", torch.get_num_threads(), threads, workers)
        torch.set_num_threads(threads)


async def _warm_up(servicer: InferenceServicer, batches: int) -> None:
    """Run a few batches on the forward threads before reporting SERVING (first calls pay one-time costs);
    they skip the queue and the batching delay, so start-up does not grow with ``max_delay_us``."""
    spec = servicer.spec
    for seed in range(batches):
        features = SparseFeatures.random(spec, batch_size=min(64, servicer.max_batch_size), ids_per_bag=8, seed=seed)
        await servicer.lookups.run_now(features)
        if servicer.predictions is not None:
            dense = torch.zeros(features.batch_size, spec.num_dense_features)
            await servicer.predictions.run_now(features, dense)


def _route_v1(servicer: InferenceServicer, oip: OpenInference, name: str, repository: Repository | None) -> None:
    """embserve.v1 calls that name a model: with a repository, the v1 service follows the first model's newest
    version; with one artifact, only ``name`` version "1" (or empty) is found."""
    if repository is not None:
        repository.attach_v1(servicer)
        servicer.route = repository.v1_for
        return
    models = oip.models

    def route(model_name: str, version: str) -> InferenceServicer:
        models.find(model_name or name, version)  # NOT_FOUND for another model or version
        return servicer

    servicer.route = route


def _always_wait(config: ServerConfig) -> bool:
    if config.batch_wait not in ("overlap", "always"):
        raise ConfigError(f"batch_wait {config.batch_wait!r}: use 'overlap' or 'always'")
    return config.batch_wait == "always"


async def _log_profile(metrics: ServerMetrics, every_s: float) -> None:
    """``--profile``: every ``every_s`` seconds, log where the requests of that interval spent their time."""
    before, started = metrics.stage_totals(), time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        after, now = metrics.stage_totals(), time.monotonic()
        logger.info("%s", profile_line(before, after, now - started))
        before, started = after, now


def _ports(config: ServerConfig) -> list[Port]:
    ports = [Port("gRPC", config.host, config.port, "--port")]
    if config.http_port is not None:
        ports.append(Port("HTTP", config.http_host or config.host, config.http_port, "--http-port"))
    if config.metrics_port is not None:
        ports.append(Port("metrics", config.metrics_host or config.host, config.metrics_port, "--metrics-port"))
    return ports


def check_ports(config: ServerConfig) -> None:
    """Refuse a port in use (or one given to two roles) with a ``ConfigError`` naming it: done before loading."""
    ports = _ports(config)
    for index, port in enumerate(ports):
        for other in ports[:index]:
            if port.port and port.port == other.port:
                raise ConfigError(f"{other.flag} and {port.flag} are both {port.port}; give each its own port")
        if not (config.processes > 1 and port.role in SHARED_ROLES):  # the instance probed and holds those
            probe(port)


def _bind(add_port: Callable[[], int], config: ServerConfig) -> int:
    """grpc's add_*_port, with a failure named: ``in_use`` when something listens there."""
    grpc_port = _ports(config)[0]
    try:
        port = add_port()
    except RuntimeError:  # grpc raises "Failed to bind to address ..." (older versions return 0)
        port = 0
    if port == 0:
        probe(grpc_port)  # raises "gRPC port P is in use" when that is why
        raise cannot_bind(grpc_port, "grpc could not bind it (GRPC_VERBOSITY=debug says why)")
    return port


async def create_server(
    artifact: str | Path | Runtime, config: ServerConfig = ServerConfig(), ready_gate: ReadyGate | None = None
) -> RunningServer:
    """Load (or take) a runtime, start a server on ``config.host:config.port`` and warm it up; ``ready_gate``
    (a worker of a multi-process instance) is awaited after the warm-up, before the server reports SERVING."""
    check_ports(config)  # before loading: a port in use is refused at once, whatever the model's size
    metrics = ServerMetrics()
    repository = None
    if isinstance(artifact, Runtime):
        runtime = artifact
    elif is_repository(artifact):  # REPO/<model>/<version>/ (server/repository.py)
        repository = await open_repository(artifact, config, metrics)
        runtime = repository.default_runtime()
    else:
        runtime = load(artifact, verify=config.verify)
    workers = _workers(runtime, config)
    _set_intra_op_threads(runtime, workers, config)
    runtime.set_threads(config.threads or runtime.thread_budget(workers * max(1, config.processes)))
    pipeline = Pipeline(
        runtime,
        metrics,
        max_batch_size=config.max_batch_size,
        max_delay_s=config.max_delay_us / 1e6,
        max_queue=config.max_queue,
        workers=workers,
        max_merge_examples=config.max_merge_examples,
        always_wait=_always_wait(config),
    )
    metrics.in_flight.set_function(lambda: pipeline.in_flight)
    interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # grpc's default (1) lets a second server share a port that serves; the processes of one instance share
        # theirs, which the instance holds (server/workers.py), so an unrelated server is still refused
        ("grpc.so_reuseport", 1 if config.processes > 1 else 0),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    # adapter -> pipeline -> adapter: each protocol's adapter holds the one pipeline
    servicer = InferenceServicer(pipeline)
    add_to_server(servicer, server)
    name = config.model_name or runtime.path.name
    oip = add_open_inference(pipeline, server, name, config.max_queue, repository)
    _route_v1(servicer, oip, name, repository)
    health = DrainingHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{config.host}:{config.port}"
    if config.tls_cert or config.tls_key:
        if not (config.tls_cert and config.tls_key):
            raise ConfigError("TLS needs both --tls-cert and --tls-key (PEM files); give both or neither")
        credentials = grpc.ssl_server_credentials(
            [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())]
        )
        port = _bind(lambda: server.add_secure_port(address, credentials), config)
    else:
        port = _bind(lambda: server.add_insecure_port(address), config)
    await server.start()
    pipeline.start()
    oip.start()
    running = RunningServer(server, port, servicer, pipeline, health, metrics, oip=oip)
    try:
        if config.metrics_port is not None:
            running.metrics_port = metrics.serve_http(config.metrics_port, config.metrics_host or config.host)
        if config.http_port is not None:
            oip.http = RestServer(oip, config)  # REST -> the protocol's calls, never the other way round
            running.http_port = await oip.http.start(config.http_host or config.host, config.http_port)
        logger.info("warming up on port %d (%d batches)", port, config.warmup_batches)
        await _warm_up(servicer, config.warmup_batches)
        if ready_gate is not None:
            await ready_gate(running)
    except BaseException:
        # a server that cannot warm up (or is stopped while it does) must not stay bound to its port
        await asyncio.shield(running.stop(0))
        raise
    pipeline.ready = True
    oip.is_ready = True
    if config.profile_s is not None:
        running.profiler = asyncio.create_task(_log_profile(metrics, config.profile_s))
    metrics_port = running.metrics_port
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info(
        "serving %s on port %d (model %s, %d features, max batch %d, delay %d us)%s",
        runtime.path, port, servicer.version, len(runtime.feature_names), config.max_batch_size,
        config.max_delay_us, f", metrics on port {metrics_port}" if metrics_port else "",
    )  # fmt: skip
    return running


async def serve(
    artifact: str | Path | Runtime,
    config: ServerConfig = ServerConfig(),
    exiting: bool = False,
    ready_gate: ReadyGate | None = None,
) -> int:
    """Run until SIGTERM or SIGINT, then drain (``RunningServer.drain``) and return 0; ``exiting``: exit the
    process (0) from the event loop once stopped (``exit_process``), before asyncio's teardown could cancel
    a call that grpc still holds."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return await serve_until(stop, artifact, config, exiting, ready_gate)


async def serve_until(
    stop: asyncio.Event,
    artifact: str | Path | Runtime,
    config: ServerConfig,
    exiting: bool = False,
    ready_gate: ReadyGate | None = None,
) -> int:
    """Start a server, print ``SERVING_LINE``, and drain once ``stop`` is set. A stop during loading or
    warm-up ends the start-up cleanly instead (port released, 0 returned)."""
    starting = asyncio.ensure_future(create_server(artifact, config, ready_gate))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        logger.info("stopped during start-up")
        starting.cancel()
        try:
            await starting
        except asyncio.CancelledError:
            pass
        return 0
    stopping.cancel()
    running = starting.result()
    print(f"{SERVING_LINE} {running.port}", flush=True)
    await stop.wait()
    logger.info(
        "draining (grace up to %.1f s, then up to %.0f s for accepted calls)",
        config.drain_grace_s,
        config.drain_seconds,
    )
    await running.drain(config.drain_grace_s, config.drain_seconds, config.drain_quiet_s, exiting)
    logger.info("stopped")
    if exiting:
        exit_process(0)
    return 0
