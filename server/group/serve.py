"""``embserve serve`` of a multi-host artifact on one rank: load this host's part, join the group (``leader``),
run the step loop (``step``) and this host's gRPC front end (``server.app``) until SIGTERM reaches any rank:
then every rank drains its front end and exits 0. A failed group reports NOT_SERVING and exits 1."""

from __future__ import annotations

import asyncio
import datetime
import logging
import signal
import threading
from pathlib import Path
from typing import Any

import torch.distributed as dist

from infer.artifact.hosts import HostPart, load_dense_arch, load_host_part
from infer.artifact.runtime import Runtime
from infer.planner.replicas import held_slots
from server.adapters.v1.service import SERVICE_NAME
from server.app import SERVING_LINE, ServerConfig, check_ports, create_server, exit_process
from server.group.leader import JOINED_LINE, GroupConfig, _group_env, join_group
from server.group.members import Membership, step_group
from server.group.step import StepModel

logger = logging.getLogger(__name__)


def serve_distributed(artifact: str | Path, config: ServerConfig, group: GroupConfig) -> int:
    """``embserve serve`` of a multi-host artifact on this rank: load this host's part, join the group and serve
    gRPC on this host's ports (every host is a front end: ``server.group.step``) until SIGTERM reaches any rank;
    then every rank drains and exits the process (0). Returns the exit code otherwise (a failed group: 1)."""
    rank, world_size = _group_env()
    check_ports(config)  # a port in use is refused before this host's part loads and the group forms
    part = load_host_part(artifact, rank, verify=config.verify)
    replicas = part.plan.replicas
    parts = {rank: part}  # with replicas: the slots of the hosts before this one too (infer.planner.replicas)
    for slot in held_slots(part.num_hosts, replicas, rank)[1:]:
        parts[slot] = load_host_part(artifact, slot, verify=config.verify)
    device = join_group(part, rank, world_size, max(group.collective_timeout_s, group.join_timeout_s))
    if device == "cpu":  # gloo: a group of our own on the launch store, which survivors can re-form
        store = dist.PrefixStore("embserve/", _default_store())  # a new store, or prefix, per attempt (join_group)
        membership = Membership(0, tuple(range(world_size)), part.num_hosts, replicas)
        steps_group: Any = step_group(store, membership, rank, group.collective_timeout_s)
        model = StepModel(part, group, device, group=steps_group, parts=parts, membership=membership,
                          store=store if replicas > 1 else None)  # fmt: skip
    else:  # NCCL: no re-forming (a lost host fails the group, as without replicas)
        steps_group = dist.new_group(timeout=datetime.timedelta(seconds=group.collective_timeout_s))
        model = StepModel(part, group, device, group=steps_group, parts=parts)
    model.warm_replicas(config.warmup_batches)
    if rank != 0 and part.manifest.has_dense:
        model.dense_arch = load_dense_arch(artifact, verify=config.verify)
    if rank != 0:
        print(f"{JOINED_LINE} {rank}", flush=True)
    return asyncio.run(_serve_front_end(part, model, config, group))


async def _serve_front_end(part: HostPart, model: Any, config: ServerConfig, group: GroupConfig) -> int:
    """One host's gRPC front end on ``model`` (a ``server.group.step.StepModel``)."""
    from grpc_health.v1 import health_pb2

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def told_to_stop() -> None:
        model.request_stop()  # every rank hears it at the next step and drains too
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, told_to_stop)
    model.on_group_stop = lambda: loop.call_soon_threadsafe(stop.set)
    runtime = Runtime(part.path, part.manifest, model)
    model.start_heartbeat()
    try:
        running = await create_server(runtime, config)
    except Exception:
        if model.failed.is_set():
            logger.error("the group failed during warm-up: %s", model.failure)
            return 1
        raise
    loop_thread = threading.get_ident()

    async def not_serving() -> None:
        for name in ("", SERVICE_NAME):
            await running.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def report_failure() -> None:
        future = asyncio.run_coroutine_threadsafe(not_serving(), loop)
        if threading.get_ident() != loop_thread:  # a forward or step thread: wait, so health leads
            try:
                future.result(timeout=2.0)
            except Exception:  # noqa: BLE001 - the main loop sets it again below
                logger.warning("could not report NOT_SERVING at once")

    model.on_failure = report_failure
    if model.failed.is_set():
        report_failure()
    print(f"{SERVING_LINE} {running.port}", flush=True)
    while not stop.is_set() and not model.failed.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
        except asyncio.TimeoutError:
            pass
    if model.failed.is_set():
        await not_serving()
        logger.error("NOT_SERVING: %s; exiting 1 in %.1f s for the launcher to restart the group", model.failure,
                     group.failure_grace_s)  # fmt: skip
        await asyncio.sleep(group.failure_grace_s)
        await running.stop(1.0)
        return 1
    logger.info("draining (grace %.1f s, then up to %.0f s for accepted calls)", config.drain_grace_s,
                config.drain_seconds)  # fmt: skip
    # as one host: refuse, answer every accepted call, and leave grpc's connections to the exit (server.app);
    # the steps go on meanwhile, so calls accepted here and on every other host are answered
    await running.drain(config.drain_grace_s, config.drain_seconds, config.drain_quiet_s, exiting=True)
    stopped = await asyncio.to_thread(model.stop_group)  # this rank drained; wait for the group's last step
    logger.info("stopped after %d distributed forwards%s", model.forwards, "" if stopped else " (group failed)")
    if stopped:
        dist.destroy_process_group()
    exit_process(0 if stopped else 1)  # from the event loop: its teardown would cancel calls grpc still holds
    return 0


def _default_store() -> dist.Store:
    """The store of the launch rendezvous (torchrun's agent store, or rank 0's TCPStore under env://)."""
    return dist.distributed_c10d._get_default_store()
