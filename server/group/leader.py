"""A multi-host artifact's group: one process per host (torchrun), joined in one torch.distributed group
(``join_group``); its configuration, failure and collectives. ``server.group.serve`` serves on it.

Every rank loads its own part (``infer.artifact.hosts.load_host_part``) and runs the gRPC front end
(``server.app``: validation, batching, health, drain) on its own port, on a ``Runtime`` whose module is a
``server.group.step.StepModel``: each rank's merged batches go through the group's step loop, in which every
rank sends every host only the ids its shards own and gets back only the columns each host computes
(``server.group``: routing, exchange, step). Hosts other than 0 take the dense part from host 0's file.

``DistributedModel`` and ``follow`` are the leader-driven protocol the step loop grew from: rank 0 alone
issues the collectives (a broadcast header, then the ids all-to-all, or the first design: every id broadcast
and the partial outputs summed by ``reduce``/``gather``) and the other ranks follow. Tests and
``bench/multihost.py`` drive batches through it without gRPC; the serving path uses its Runtime interface.

Failure: every collective has the group's timeout. When one fails (a rank died or hangs), the survivors
report NOT_SERVING, answer UNAVAILABLE, and exit 1 so torchrun (or the orchestrator) restarts the group; with
replicas in the plan they re-form the group among themselves and keep serving (``server.group.members``).
SIGTERM on any rank makes every rank drain its front end (accepted calls are answered) and exit 0.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.distributed as dist

from infer import request_rules as rules
from infer.artifact.hosts import HostPart
from infer.artifact.manifest import Manifest
from infer.errors import ArtifactError, EmbserveError, RequestError
from infer.features import check_dense_features
from infer.shard.hosts import finish_partial
from server.group.exchange import Exchange
from server.group.routing import full_request, group_routing, split_request
from server.pipeline import Failure as _Failure

logger = logging.getLogger(__name__)

# Header broadcast before every message: [op, num_ids, num_lengths, weighted, combine, values dtype, lengths dtype]
# followed by, per host, the bytes of its ids (all-to-all mode)
OP_STOP = 0
OP_FORWARD = 1
OP_PING = 2
HEADER_SIZE = 7
# How ids reach the hosts and outputs come back: every id broadcast and the partial outputs summed on the way
# (reduce) or gathered whole and summed by rank 0 (the first design, kept as a baseline); or each host's own
# ids and columns only (all-to-all, the default).
COMBINE_REDUCE = 0
COMBINE_GATHER = 1
COMBINE_ALL_TO_ALL = 2
_DTYPES = (torch.int64, torch.int32)
# printed by every rank other than 0 once it joined the group (tests and logs wait for it)
JOINED_LINE = "embserve: joined the group as rank"


class GroupFailure(EmbserveError):
    """A collective failed or timed out: a rank died or hangs. The group cannot serve any more."""


@dataclass(frozen=True)
class GroupConfig:
    collective_timeout_s: float = 30.0  # every collective of the serving steps fails after this long
    # forming the group waits this long for every rank (at least the collective timeout): after a restart the
    # ranks load their parts at different speeds
    join_timeout_s: float = 600.0
    failure_grace_s: float = 2.0  # after a failure: NOT_SERVING and UNAVAILABLE this long, then exit 1
    ping_interval_s: float = 0.0  # an idle rank 0 pings the group this often; 0 -> timeout / 3
    combine: int = COMBINE_ALL_TO_ALL  # the broadcast modes: bench/multihost.py compares them
    # with replicas, after a failed step the first survivor fixes the new members when every old member arrived,
    # or this long after one collective timeout from its last successful collective (``server.group.members``)
    reform_margin_s: float = 1.0


def is_multi_host(artifact: str | Path) -> bool:
    """Whether ``artifact`` is a multi-host artifact (its manifest lists host parts)."""
    folder = Path(artifact)
    if not folder.is_dir():
        return False
    try:
        return bool(Manifest.read(folder).host_parts)
    except ArtifactError:
        return False  # the one-host loader reports the manifest's problem


class _Collectives:
    """The tensors both sides exchange, on the group's device (cpu for gloo, cuda for NCCL)."""

    def __init__(self, device: str, num_hosts: int) -> None:
        self.device = device
        self.num_hosts = num_hosts
        self.header_bytes = (HEADER_SIZE + num_hosts) * 8

    def send_header(
        self,
        op: int,
        values: torch.Tensor | None,
        lengths: torch.Tensor | None,
        weighted: bool,
        combine: int = 0,
        host_bytes: list[int] | None = None,
    ) -> None:
        header = torch.zeros(HEADER_SIZE + self.num_hosts, dtype=torch.int64)
        if host_bytes is not None:
            header[HEADER_SIZE:] = torch.tensor(host_bytes, dtype=torch.int64)
        header[0] = op
        header[4] = combine
        if values is not None and lengths is not None:
            header[1] = values.numel()
            header[2] = lengths.numel()
            header[3] = int(weighted)
            header[5] = _DTYPES.index(values.dtype)
            header[6] = _DTYPES.index(lengths.dtype)
        dist.broadcast(header.to(self.device), src=0)

    def recv_header(self) -> list[int]:
        header = torch.zeros(HEADER_SIZE + self.num_hosts, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        return [int(x) for x in header.cpu().tolist()]

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == 0:  # both sides know the count from the header: nothing to send
            return tensor
        moved = tensor.to(self.device)
        dist.broadcast(moved, src=0)
        return moved

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        moved = partial.to(self.device)
        if moved.numel() > 0:
            dist.reduce(moved, dst=0, op=dist.ReduceOp.SUM)
        return moved

    def gather_sum(self, partial: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """The alternative to ``reduce``: every partial sent whole to rank 0, which adds them in rank order."""
        moved = partial.to(self.device).contiguous()
        if moved.numel() == 0:
            return moved
        if rank != 0:
            dist.gather(moved, dst=0)
            return moved
        pieces = [torch.empty_like(moved) for _ in range(world_size)]
        dist.gather(moved, gather_list=pieces, dst=0)
        total = pieces[0]
        for piece in pieces[1:]:
            total.add_(piece)
        return total


class DistributedModel:
    """Rank 0's model: ``model(values, lengths, weights)`` and ``model.predict(dense, values, lengths, weights)``
    run one distributed forward each (the interface ``Runtime`` and the server's batcher call)."""

    def __init__(self, part: HostPart, config: GroupConfig, comm_device: str = "cpu") -> None:
        self.part = part
        self.spec = part.manifest.spec
        self.config = config
        self._comm = _Collectives(comm_device, part.num_hosts)
        self.routing = group_routing(self.spec, part.plan)
        self.exchange = Exchange(self.routing, 0, comm_device)
        self._lock = threading.Lock()
        self._last_collective = time.monotonic()
        self.failed = threading.Event()
        self.failure = ""
        self.forwards = 0
        self._stopping = threading.Event()
        self._heartbeat: threading.Thread | None = None
        # host 0's part holds the dense part; another front end loads it from host 0's file (load_dense_arch)
        self.dense_arch: torch.nn.Module | None = part.module.dense_arch if part.module.has_dense else None
        # called once, on the thread that saw the failure, before any caller hears UNAVAILABLE (health first)
        self.on_failure: Callable[[], None] | None = None

    # ----------------------------------------------------------------- the Runtime module interface
    def __call__(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None) -> Any:
        embeddings = self.part.module.embeddings
        embeddings.validate(values, lengths, weights)  # every rule, before any other rank sees the batch
        embeddings.validate_ids(values, lengths)
        summed = self._forward(values, lengths, weights)
        return finish_partial(self.spec, summed, lengths.cpu())

    forward = __call__

    def predict(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.lookup_and_predict(dense, values, lengths, weights)[1]

    def lookup_and_predict(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled embeddings and scores float32 ``[batch]`` (the call contract) of one forward."""
        dense_arch = self.dense_arch
        if dense_arch is None:
            raise RequestError(rules.NO_DENSE_PART)
        batch = lengths.numel() // len(self.spec.features)
        dense = check_dense_features(dense, batch, self.spec.num_dense_features)
        pooled = self(values, lengths, weights)
        return pooled, rules.scores_of(dense_arch(dense.to(pooled.device), pooled), batch)

    # ----------------------------------------------------------------- collectives
    def _unavailable(self) -> _Failure:
        return _Failure(
            grpc.StatusCode.UNAVAILABLE,
            f"a host of this multi-host server failed ({self.failure}); retry on another replica",
            "group_failed",
        )

    def _forward(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        if self.failed.is_set():
            raise self._unavailable()
        with self._lock:
            if self.failed.is_set():
                raise self._unavailable()
            try:
                if self.config.combine == COMBINE_ALL_TO_ALL:
                    summed = self._forward_all_to_all(values, lengths, weights)
                    self.forwards += 1
                    return summed
                self._comm.send_header(OP_FORWARD, values, lengths, weights is not None, self.config.combine)
                self._comm.broadcast(values)
                self._comm.broadcast(lengths)
                if weights is not None:
                    self._comm.broadcast(weights)
                partial = self.part.module(values, lengths, weights)
                if self.config.combine == COMBINE_GATHER:
                    summed = self._comm.gather_sum(partial, 0, self.part.num_hosts)
                else:
                    summed = self._comm.reduce(partial)
            except Exception as err:  # noqa: BLE001 - gloo raises RuntimeError/DistBackendError on a lost peer
                self._fail(err)
                raise self._unavailable() from None
            finally:
                self._last_collective = time.monotonic()
            self.forwards += 1
        return summed.to(partial.device)

    def _forward_all_to_all(
        self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """Each host's ids out, this host's part meanwhile, each host's columns back (see the module docstring)."""
        exchange = self.exchange
        hosts = self.part.num_hosts
        batch = lengths.numel() // len(self.spec.features)
        subs = split_request(self.routing, values, lengths, weights)
        empty = torch.empty(0, dtype=torch.uint8)
        packed = [empty] + [exchange.pack(sub) for sub in subs[1:]]
        self._comm.send_header(
            OP_FORWARD, values, lengths, weights is not None, COMBINE_ALL_TO_ALL, [int(p.numel()) for p in packed]
        )
        exchange.bytes_sent += self._comm.header_bytes * (hosts - 1)
        exchange.all_to_all(packed, [0] * hosts)
        partial = self.part.module(values, lengths, weights)
        sizes = [0] + [exchange.output_bytes(h, batch) for h in range(1, hosts)]
        pieces = exchange.all_to_all([empty] * hosts, sizes)
        for host in range(1, hosts):
            exchange.add_columns(partial, host, pieces[host])
        return partial

    def _fail(self, err: BaseException) -> None:
        if not self.failed.is_set():
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            self.failure = f"{type(err).__name__}: {first_line}"
            logger.error("the group failed: %s", self.failure)
            self.failed.set()
            if self.on_failure is not None:
                self.on_failure()

    def ping(self) -> None:
        """One round trip with every rank (header + one-element reduce): a dead or hung rank shows up even
        when no request arrives, and idle ranks' waits never reach the timeout."""
        with self._lock:
            if self.failed.is_set():
                return
            try:
                self._comm.send_header(OP_PING, None, None, False)
                self._comm.reduce(torch.zeros(1))
            except Exception as err:  # noqa: BLE001
                self._fail(err)
            finally:
                self._last_collective = time.monotonic()

    def start_heartbeat(self) -> None:
        interval = self.config.ping_interval_s or self.config.collective_timeout_s / 3

        def beat() -> None:
            while not self._stopping.wait(interval / 4):
                if self.failed.is_set():
                    return
                if time.monotonic() - self._last_collective >= interval:
                    self.ping()

        self._heartbeat = threading.Thread(target=beat, name="embserve-group-heartbeat", daemon=True)
        self._heartbeat.start()

    def stop_group(self) -> bool:
        """Tell every other rank to exit (after the front end drained); False when the group already failed."""
        self._stopping.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        with self._lock:
            if self.failed.is_set():
                return False
            try:
                self._comm.send_header(OP_STOP, None, None, False)
            except Exception as err:  # noqa: BLE001
                self._fail(err)
                return False
        return True


def follow(part: HostPart, comm_device: str = "cpu", exchange: Exchange | None = None) -> int:
    """A rank other than 0: run partial forwards for rank 0 until it sends stop (0) or the group fails (1).
    ``exchange``: this rank's side of the all-to-all (made here when None; passed in to read its counters)."""
    comm = _Collectives(comm_device, part.num_hosts)
    module = part.module
    if exchange is None:
        exchange = Exchange(group_routing(part.manifest.spec, part.plan), part.host, comm_device)
    num_features = len(part.manifest.spec.features)
    forwards = 0
    with torch.inference_mode():
        while True:
            try:
                header = comm.recv_header()
                op, num_ids, num_lengths, weighted, combine, values_code, lengths_code = header[:HEADER_SIZE]
                if op == OP_STOP:
                    logger.info("rank %d: stop from rank 0 after %d forwards", part.host, forwards)
                    return 0
                if op == OP_PING:
                    comm.reduce(torch.zeros(1))
                    continue
                if combine == COMBINE_ALL_TO_ALL:
                    exchange.bytes_received += comm.header_bytes
                    _follow_all_to_all(exchange, module, header[HEADER_SIZE:], num_lengths // num_features, weighted)
                    forwards += 1
                    continue
                values = comm.broadcast(torch.empty(num_ids, dtype=_DTYPES[values_code], device=comm_device))
                lengths = comm.broadcast(torch.empty(num_lengths, dtype=_DTYPES[lengths_code], device=comm_device))
                weights = comm.broadcast(torch.empty(num_ids, device=comm_device)) if weighted else None
                partial = module(values, lengths, weights)
                if combine == COMBINE_GATHER:
                    comm.gather_sum(partial, part.host, part.num_hosts)
                else:
                    comm.reduce(partial)
                forwards += 1
            except Exception as err:  # noqa: BLE001 - rank 0 died or hangs, or the batch broke this rank
                logger.error("rank %d: the group failed after %d forwards: %s", part.host, forwards, err)
                return 1


def _follow_all_to_all(
    exchange: Exchange, module: torch.nn.Module, host_bytes: list[int], batch: int, weighted: int
) -> None:
    """A follower's side of one all-to-all forward: its ids in, its part's columns out to rank 0."""
    hosts = len(host_bytes)
    rank = exchange.rank
    empty = torch.empty(0, dtype=torch.uint8)
    received = exchange.all_to_all([empty] * hosts, [host_bytes[rank] if h == 0 else 0 for h in range(hosts)])
    sub = exchange.unpack(received[0], batch, bool(weighted))
    values, lengths, weights = full_request(exchange.routing, rank, batch, sub)
    partial = module(values, lengths, weights)
    exchange.all_to_all([exchange.own_columns(partial)] + [empty] * (hosts - 1), [0] * hosts)


def _group_env() -> tuple[int, int]:
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise EmbserveError(
            f"a multi-host artifact is served by one process per host under torchrun; {', '.join(missing)} "
            "missing from the environment. Run on every host: torchrun --nnodes H --nproc-per-node 1 "
            "--rdzv-endpoint HOST0:PORT -m infer.cli serve ARTIFACT"
        )
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def join_group(part: HostPart, rank: int, world_size: int, timeout_s: float) -> str:
    """Join the process group (env:// rendezvous: torchrun's, or MASTER_ADDR/MASTER_PORT); returns the device
    collectives run on: NCCL and the host's first GPU when its part is on CUDA, else gloo and the CPU."""
    hosts = part.num_hosts
    if world_size != hosts:
        raise EmbserveError(
            f"the artifact has {hosts} host parts but the group has {world_size} processes; run one process per "
            f"host: torchrun --nnodes {hosts} --nproc-per-node 1"
        )
    on_cuda = any(d.startswith("cuda") for d in part.manifest.devices) and torch.cuda.is_available()
    backend, device = ("nccl", "cuda:0") if on_cuda else ("gloo", "cpu")
    if on_cuda:
        torch.cuda.set_device(0)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except dist.DistError as err:  # rank 0 refused to start (a port in use), died, or the rendezvous host is gone
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise GroupFailure(
            f"rank {rank} could not join the group of {world_size} ({type(err).__name__}: {first_line}); "
            "see rank 0's log: every rank must start, and rank 0's ports must be free"
        ) from None
    logger.info("rank %d of %d joined (%s)", rank, world_size, backend)
    return device


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's agent store: a client of it under a prefix of this attempt; else None (env://).

    torchrun (2.13) keeps one agent TCPStore for every restart of the group (static rendezvous always; c10d
    unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), although ``init_process_group`` assumes a new store per
    attempt: the restarted workers read the dead workers' gloo addresses from it and fail with "Connection
    refused". A prefix per ``TORCHELASTIC_RESTART_COUNT`` keeps attempts apart when every host restarts once per
    failure (static rendezvous: each agent counts its own). Under c10d an agent restarts its worker for a waiting
    node without counting, so ``server.group.launch`` turns the sharing off instead (rank 0 then hosts a new
    store on a new port per round)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"embserve/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", client)
