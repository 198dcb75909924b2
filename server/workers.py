"""One ``embserve serve`` instance, N server processes on one port (``--workers N``).

The instance (this process: no model, no grpc) claims the gRPC and REST ports (``server.ports.claim``: a
per-port lock and a held SO_REUSEPORT socket, so an unrelated server is still refused), then starts N workers,
each a plain ``embserve serve`` of the same artifact that binds those ports with SO_REUSEPORT; the kernel spreads
connections over them. The weights are mapped read-only, so the workers share one copy in the page cache.

The lines a worker and the instance print on stdout are the protocol between them (and with ``server.launch``):
a worker prints ``WARM_LINE`` once warm and waits for ``GO`` on stdin before it reports SERVING, so the instance
is SERVING only when every worker is; then it prints ``SERVING_LINE`` and one ``WORKER_LINE`` per worker.
SIGTERM (or SIGINT) to the instance is passed to every worker, each drains, and the instance exits 0 once all
did. A worker that exits on its own fails the instance: the others drain (NOT_SERVING at once) and it exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from infer.errors import ConfigError
from server.ports import Port, PortClaim, claim

logger = logging.getLogger(__name__)

# printed by `embserve serve` (one process, or the instance of --workers N) once it serves, followed by the port
SERVING_LINE = "embserve: serving on port"
# a worker, once warm: "<WARM_LINE> <metrics port or 0>"; it waits for GO on stdin before it reports SERVING
WARM_LINE = "embserve: worker warm, metrics port"
GO = "serve"
# the instance, after SERVING_LINE, once per worker: "<WORKER_LINE> <index> pid <pid> metrics port <port or 0>"
WORKER_LINE = "embserve: worker"
# the hidden flag that makes `embserve serve` a worker of an instance: the value is "<index>/<workers>"
WORKER_FLAG = "--worker-of-instance"
# Linux prctl: a worker gets SIGTERM when the instance dies, so it never serves on alone (its stdin's end is the
# portable second line of defence: ``_stop_with_the_instance``)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker is told: its index among ``workers``, and its own metrics port (None: none)."""

    index: int
    workers: int
    metrics_port: int | None

    def options(self) -> list[str]:
        """The worker's own ``embserve serve`` flags (``parse_worker_flag`` reads the first back)."""
        metrics = ["--metrics-port", str(self.metrics_port)] if self.metrics_port is not None else []
        return [WORKER_FLAG, f"{self.index}/{self.workers}", *metrics]


def parse_worker_flag(value: str) -> tuple[int, int]:
    """``"<index>/<workers>"`` -> (index, workers)."""
    index, _, workers = value.partition("/")
    return int(index), int(workers)


async def wait_for_go(metrics_port: int | None) -> None:
    """A worker's ready gate (``server.app.create_server``): say it is warm, then wait until every worker is."""
    print(f"{WARM_LINE} {metrics_port or 0}", flush=True)
    line = await asyncio.to_thread(sys.stdin.readline)
    if line.strip() != GO:  # the instance closed our stdin: it stops (or died), and our SIGTERM is on its way
        logger.info("the instance stops before every worker was warm: waiting for the stop")
        await asyncio.get_running_loop().create_future()
    threading.Thread(target=_stop_with_the_instance, name="embserve-instance-watch", daemon=True).start()


def _stop_with_the_instance() -> None:
    """Our stdin ends when the instance closes it (it stops us) or dies (killed: PR_SET_PDEATHSIG may not
    reach us, e.g. in a sandbox): either way this worker drains and exits instead of serving on alone."""
    sys.stdin.read()
    logger.info("the instance is gone or stopping: this worker drains")
    os.kill(os.getpid(), signal.SIGTERM)


def refuse_conflicts(artifact: str, workers: int) -> None:
    """What ``--workers N`` (N > 1) cannot serve is refused here, naming the flag and what to do."""
    from server.group.leader import is_multi_host
    from server.repository import is_repository

    if workers < 1:
        raise ConfigError(f"--workers {workers}: give at least 1 server process")
    if workers > 1 and is_multi_host(artifact):
        raise ConfigError(
            f"--workers {workers}: {artifact} is a multi-host artifact, served by one process per host under "
            "torchrun; serve it without --workers"
        )
    if workers > 1 and is_repository(artifact):
        raise ConfigError(
            f"--workers {workers} serves one artifact; {artifact} is a model repository (versions loaded and "
            "swapped at run time, per process): serve it with --workers 1, or serve one version's folder"
        )


def _worker_ports(metrics_port: int | None, workers: int) -> list[int | None]:
    """Each worker's own /metrics port: ``--metrics-port M`` gives worker i port M + i (0: each a free one)."""
    if metrics_port is None:
        return [None] * workers
    return [metrics_port + index if metrics_port else 0 for index in range(workers)]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    import ctypes

    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class _Worker:
    def __init__(self, spec: WorkerSpec, command: list[str]) -> None:
        self.spec = spec
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=_die_with_parent
        )
        assert self.process.stdout is not None and self.process.stdin is not None
        self.stdout = self.process.stdout
        self.stdin = self.process.stdin
        self.buffer = b""
        self.warm_metrics_port: int | None = None
        self.serving = False
        self.exited = False

    def lines(self, data: bytes) -> list[str]:
        self.buffer += data
        *complete, self.buffer = self.buffer.split(b"\n")
        return [line.decode(errors="replace") for line in complete]

    def go(self) -> None:
        try:
            self.stdin.write(f"{GO}\n".encode())
            self.stdin.flush()
        except OSError:  # it exited; its stdout's end says so
            pass

    def stop(self) -> None:
        """SIGTERM (it drains); its stdin closes, so a worker waiting for GO gives up."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.stdin.close()
        except OSError:
            pass


def serve_workers(artifact: str, worker_options: list[str], config: Any, workers: int) -> int:
    """Run an instance of ``workers`` server processes until SIGTERM/SIGINT (0) or a worker's failure (1).
    ``worker_options``: the ``embserve serve`` flags every worker gets (not the ports: given here)."""
    claims: list[PortClaim] = [claim(Port("gRPC", config.host, config.port, "--port"))]
    if config.http_port is not None:
        claims.append(claim(Port("HTTP", config.http_host or config.host, config.http_port, "--http-port")))
    grpc_port = claims[0].port.port
    command = [sys.executable, "-m", "infer.cli", "serve", artifact, "--python", *worker_options]
    command += ["--port", str(grpc_port)]
    if config.http_port is not None:
        command += ["--http-port", str(claims[1].port.port)]
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    stopping: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    signal.set_wakeup_fd(wakeup_write)
    started: list[_Worker] = []
    try:
        for index, metrics_port in enumerate(_worker_ports(config.metrics_port, workers)):
            spec = WorkerSpec(index, workers, metrics_port)
            started.append(_Worker(spec, [*command, *spec.options()]))
        logger.info("instance on port %d: %d workers (pids %s)", grpc_port, workers, [w.process.pid for w in started])
        return _supervise(started, grpc_port, wakeup_read, stopping)
    finally:
        for worker in started:
            worker.stop()
        for worker in started:
            worker.process.wait()
        for held in claims:
            held.close()
        signal.set_wakeup_fd(-1)
        os.close(wakeup_read)
        os.close(wakeup_write)


def _supervise(workers: list[_Worker], port: int, wakeup: int, stopping: list[int]) -> int:
    """The instance's loop: starting (WARM lines, then GO to all, then SERVING lines), serving, stopping."""
    selector = selectors.DefaultSelector()
    selector.register(wakeup, selectors.EVENT_READ, None)
    for worker in workers:
        selector.register(worker.stdout, selectors.EVENT_READ, worker)
    failed: str | None = None
    went = announced = False
    passed_on = 0  # the signals in ``stopping`` passed on to the workers
    while any(not w.exited for w in workers):
        for key, _ in selector.select():
            if key.data is None:
                os.read(wakeup, 512)
                continue
            worker = key.data
            data = os.read(worker.stdout.fileno(), 65536)
            if not data:
                selector.unregister(worker.stdout)
                worker.exited = True
                code = worker.process.wait()
                if not stopping and failed is None:
                    failed = f"worker {worker.spec.index} (pid {worker.process.pid}) exited with code {code}"
                    logger.error("%s: the instance stops (NOT_SERVING, every other worker drains), exit 1", failed)
                    _stop_all(workers)
                continue
            for line in worker.lines(data):
                _read_line(worker, line)
        if len(stopping) > passed_on and not all(w.exited for w in workers):
            logger.info("signal %d: every worker drains", stopping[-1])
            passed_on = len(stopping)
            _stop_all(workers)
        if not announced and failed is None and not stopping:
            if not went and all(w.warm_metrics_port is not None for w in workers):
                went = True
                for worker in workers:
                    worker.go()
            if all(w.serving for w in workers):
                announced = True
                print(f"{SERVING_LINE} {port}", flush=True)
                for worker in workers:
                    spec, pid = worker.spec, worker.process.pid
                    print(f"{WORKER_LINE} {spec.index} pid {pid} metrics port {worker.warm_metrics_port}", flush=True)
    codes = [w.process.returncode for w in workers]
    if failed is not None:
        return 1
    if any(codes):
        logger.error("workers exited with codes %s", codes)
        return 1
    return 0


def _read_line(worker: _Worker, line: str) -> None:
    if line.startswith(WARM_LINE):
        worker.warm_metrics_port = int(line.rsplit(" ", 1)[1])
    elif line.startswith(SERVING_LINE):
        worker.serving = True
    elif line:
        print(line, flush=True)  # anything else a worker prints is the user's to see


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        if not worker.exited:
            worker.stop()
