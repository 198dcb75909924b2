"""Every host a front end: the group's step loop, in which every rank contributes its queued batch (or none).

Collectives pair up by order alone, so every rank must issue the same ones in the same order. Each rank runs
one step thread; a step is: an ``all_gather`` of every rank's header (its batch size, whether it has weights,
the bytes of ids it sends each host, and its stop flags), then, when any rank has a batch, the ids all-to-all,
every rank's part on its own batch and on the sub-batches it received, and the columns all-to-all; each rank
then finishes its own batch (MEAN, dense part) and answers its callers. A rank with nothing queued waits up to
``tick_s`` for a batch before it joins the next header exchange, so an idle group steps ``1 / tick_s`` times a
second (that is its heartbeat: a dead rank fails the next step within the collective timeout) and a batch
waits at most ``tick_s`` for idle ranks.

Slots and replicas (``server.group.members``): the header carries the bytes for each *slot* (plan host); each
slot is served by one member, so a member's buffer is the sub-requests of the slots it serves, in slot order, and
its reply their columns. When a step fails (a member died or hangs) and the plan has replicas, the survivors
re-form the group (``members.agree_members``: a new gloo group, new ranks) and go on; the callers of the failed
step are served in the next one (retried inside the server), calls that arrive meanwhile wait in the queue, and
health stays SERVING. Without replicas, or when a slot has no live holder, the group fails: NOT_SERVING.

Stopping: a rank told to stop (SIGTERM) sets ``WANTS_STOP`` in its header; every rank sees it in the same step
and drains its front end (callers already accepted are answered: steps go on), then sets ``DRAINED``; the step
in which every rank is drained is the last, and every rank exits 0.
"""

from __future__ import annotations

import cProfile
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from infer.artifact.hosts import HostPart
from server.group.exchange import Exchange
from server.group.leader import DistributedModel, GroupConfig
from server.group.members import REFORMED_LINE, Membership, agree_members, step_group
from server.group.routing import full_request, split_request

logger = logging.getLogger(__name__)

HAS_BATCH = 1
WANTS_STOP = 2
DRAINED = 4
_FIXED = 3  # header: flags, batch, weighted; then bytes to each host

Batch = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]
# the phases of a step, timed (ms per step logged at the end with PHASES_LINE); EMBSERVE_PROFILE_STEPS=DIR also
# writes a cProfile of each host's step thread to DIR/steps-host<h>.pstats
PHASES = ("wait", "split_pack", "header", "ids_all_to_all", "own_lookup", "peer_lookups", "columns_all_to_all",
          "assemble_answer")  # fmt: skip
PHASES_LINE = "step phases in ms per step over"
PROFILE_ENV = "EMBSERVE_PROFILE_STEPS"
MAX_MERGED_ROWS = 8192  # a step takes every queued batch (same weightedness) up to this many examples


class MergedBatch:
    """The batch a rank brings to one step: every queued caller's batch merged (feature-major), and the callers
    with their row counts, answered in order from the step's output."""

    def __init__(self, items: list[tuple[Batch, Future[torch.Tensor]]], num_features: int) -> None:
        self.items = items  # kept to retry them in a re-formed group
        self.waiters = [(batch[1].numel() // num_features, done) for batch, done in items]
        if len(items) == 1:
            self.batch = items[0][0]
            return
        per_item = [batch[1].view(num_features, -1) for batch, _ in items]
        lengths = torch.cat(per_item, dim=1).reshape(-1)
        # each caller's ids split by feature, then feature by feature across callers
        counts = [per.sum(1).tolist() for per in per_item]
        value_parts = [batch[0].split(c) for (batch, _), c in zip(items, counts)]
        values = torch.cat([parts[f] for f in range(num_features) for parts in value_parts])
        weights = None
        if items[0][0][2] is not None:
            weight_parts = [batch[2].split(c) for (batch, _), c in zip(items, counts) if batch[2] is not None]
            weights = torch.cat([parts[f] for f in range(num_features) for parts in weight_parts])
        self.batch = (values, lengths, weights)

    def answer(self, out: torch.Tensor) -> None:
        for rows, done in zip(out.split([r for r, _ in self.waiters]), [d for _, d in self.waiters]):
            done.set_result(rows)

    def fail(self, error: BaseException) -> None:
        for _, done in self.waiters:
            if not done.done():
                done.set_exception(error)


class StepModel(DistributedModel):
    """One rank's model when every rank is a front end: ``model(values, lengths, weights)`` (validated by the
    caller's ``Runtime`` contract as ``DistributedModel``) queues the batch for the next step and waits.

    ``parts``: the slots this host holds (slot -> part; its own slot is ``part``); ``membership``: the group's
    members (default: every slot's host, no replicas); ``store``: where survivors agree on a re-formed group
    (None: no re-forming)."""

    def __init__(
        self,
        part: HostPart,
        config: GroupConfig,
        comm_device: str = "cpu",
        tick_s: float = 0.002,
        group: Any = None,
        parts: Mapping[int, HostPart] | None = None,
        membership: Membership | None = None,
        store: dist.Store | None = None,
    ) -> None:
        """``group``: the process group of the steps (None: the default one)."""
        super().__init__(part, config, comm_device)
        self.host = part.host
        self.parts = dict(parts or {part.host: part})
        slots = part.num_hosts
        self.membership = membership or Membership(0, tuple(range(slots)), slots, 1)
        self.store = store
        self.rank = self.membership.rank_of(self.host)
        self.exchange = Exchange(self.routing, self.rank, comm_device, group)
        self._set_owners()
        self.reforms = 0
        self._last_ok = time.monotonic()
        # seconds spent per phase of the steps (bench/multihost_serving.py --profile reads the log line)
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self.tick_s = tick_s
        self._queue: queue.Queue[tuple[Batch, Future[torch.Tensor]]] = queue.Queue()
        self._wants_stop = threading.Event()
        self._drained = threading.Event()
        self.group_stopping = threading.Event()  # some rank wants the group to stop: drain the front end
        self.on_group_stop: Callable[[], None] | None = None
        self.steps = 0
        self._thread: threading.Thread | None = None
        self.exit_code: int | None = None
        self.finished = threading.Event()
        self._current: MergedBatch | None = None  # the batch of the step under way
        self._held: list[tuple[Batch, Future[torch.Tensor]]] = []  # a batch left for the next step (weights differ)

    def _set_owners(self) -> None:
        owners = self.membership.owners()
        if owners is None:
            raise RuntimeError(f"slots {self.membership.uncovered()} have no live host")
        self.owners = owners
        size = len(self.membership.members)
        self.served = [tuple(s for s, o in enumerate(owners) if o == m) for m in range(size)]  # slots per member
        missing = [s for s in self.served[self.rank] if s not in self.parts]
        if missing:
            raise RuntimeError(f"host {self.host} would serve slots {missing} it does not hold")

    def warm_replicas(self, runs: int = 3) -> None:
        """Run the parts this host holds for other hosts on probe batches: TorchScript optimizes a module on its
        first calls (~0.4 s here), which would otherwise land on the first step after a re-form."""
        from infer.features import SparseFeatures

        probe = SparseFeatures.random(self.spec, batch_size=4, ids_per_bag=3)
        with torch.inference_mode():
            for slot, part in self.parts.items():
                if slot == self.host:
                    continue  # the server's warm-up runs this host's own part
                for ids in (probe.values, probe.values.to(torch.int32)):  # own requests; peers' unpacked ids
                    lengths = probe.lengths.to(torch.int32)
                    for weights in (None, torch.ones(ids.numel())):
                        for _ in range(runs):
                            part.module(ids, lengths, weights)

    # ----------------------------------------------------------------- callers (batcher threads)
    def _forward(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        if self.failed.is_set():
            raise self._unavailable()
        done: Future[torch.Tensor] = Future()
        self._queue.put(((values, lengths, weights), done))
        if self.failed.is_set() or self.finished.is_set():  # the loop may have ended before it saw this batch
            self._fail_queued()
        return done.result()

    # ----------------------------------------------------------------- control
    def request_stop(self) -> None:
        """This rank was told to stop: every rank drains, then the group ends (see the module docstring)."""
        self._wants_stop.set()

    def mark_drained(self) -> None:
        """This rank's front end drained (no call in flight, none accepted any more)."""
        self._drained.set()

    def start_heartbeat(self) -> None:  # the step loop is the heartbeat
        self._thread = threading.Thread(target=self._run, name="embserve-group-steps", daemon=True)
        self._thread.start()

    def stop_group(self) -> bool:
        """Wait for the last step (after ``mark_drained``); False when the group failed."""
        self.mark_drained()
        self.finished.wait()
        return self.exit_code == 0

    # ----------------------------------------------------------------- the loop
    def _fail_queued(self) -> None:
        while True:
            try:
                _, done = self._queue.get_nowait()
            except queue.Empty:
                return
            if not done.done():
                done.set_exception(self._unavailable())

    def _run(self) -> None:
        profile_dir = os.environ.get(PROFILE_ENV)
        profiler = cProfile.Profile() if profile_dir else None
        try:
            with torch.inference_mode():
                while True:
                    try:
                        if profiler is not None:
                            profiler.enable()
                        self.exit_code = self._loop()
                        break
                    except Exception as err:  # noqa: BLE001 - gloo raises RuntimeError/DistBackendError on a lost peer
                        if not self._reform(err):
                            raise
        except Exception as err:  # noqa: BLE001
            self._fail(err)
            self.exit_code = 1
        finally:
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(os.path.join(profile_dir or ".", f"steps-host{self.host}.pstats"))
            steps = max(self.steps, 1)
            logger.info("%s %d steps: %s", PHASES_LINE, self.steps,
                        ", ".join(f"{k} {1000 * v / steps:.3f}" for k, v in self.phase_s.items()))  # fmt: skip
            self.finished.set()
            if self._current is not None:
                self._current.fail(self._unavailable())
            for _, done in self._held:
                done.set_exception(self._unavailable())
            self._fail_queued()

    def _reform(self, err: BaseException) -> bool:
        """After a failed step: re-form the group among the survivors when every slot still has a live holder
        (True: go on stepping, the failed step's callers first); False: the group fails."""
        old = self.membership
        if self.store is None or old.replicas < 2 or self._wants_stop.is_set():
            return False
        failed_at = time.monotonic()
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        logger.warning("generation %d: a step failed (%s: %s); re-forming", old.generation, type(err).__name__,
                       first_line)  # fmt: skip
        try:
            decide_by = self._last_ok + self.config.collective_timeout_s + self.config.reform_margin_s
            membership = agree_members(self.store, old, self.host, decide_by)
            if self.host not in membership.members:
                logger.error("generation %d formed without this host", membership.generation)
                return False
            if membership.owners() is None:
                logger.error("generation %d: slots %s have no live host", membership.generation,
                             membership.uncovered())  # fmt: skip
                return False
            group = step_group(self.store, membership, self.host, self.config.collective_timeout_s)
        except Exception as reform_err:  # noqa: BLE001 - the store's host is gone, or a member left meanwhile
            logger.error("re-forming failed: %s: %s", type(reform_err).__name__, str(reform_err)[:300])
            return False
        self.membership = membership
        self.rank = membership.rank_of(self.host)
        self.exchange.group = group
        self.exchange.rank = self.rank
        self._set_owners()
        self.reforms += 1
        if self._current is not None:  # retried first in the new group
            self._held = self._current.items + self._held
            self._current = None
        lost = sorted(set(old.members) - set(membership.members))
        print(f"{REFORMED_LINE}: generation {membership.generation}, members {list(membership.members)}, "
              f"lost {lost}, in {time.monotonic() - failed_at:.2f} s", flush=True)  # fmt: skip
        return True

    def _loop(self) -> int:
        slots = self.membership.slots
        size = len(self.membership.members)
        exchange = self.exchange
        phase = self.phase_s
        while True:
            began = time.perf_counter()
            item = self._take()
            took = time.perf_counter()
            phase["wait"] += took - began
            flags = (WANTS_STOP if self._wants_stop.is_set() else 0) | (
                DRAINED if self._drained.is_set() and item is None and self._queue.empty() and not self._held else 0
            )
            header = torch.zeros(_FIXED + slots, dtype=torch.int64)
            packed: list[torch.Tensor] = [_EMPTY] * slots
            if item is not None:
                values, lengths, weights = item.batch
                batch = lengths.numel() // self.routing.num_features
                subs = split_request(self.routing, values, lengths, weights)
                packed = [exchange.pack(s) if self.owners[g] != self.rank else _EMPTY for g, s in enumerate(subs)]
                flags |= HAS_BATCH
                header[1] = batch
                header[2] = int(weights is not None)
                header[_FIXED:] = torch.tensor([int(p.numel()) for p in packed], dtype=torch.int64)
            header[0] = flags
            self._current = item
            packed_at = time.perf_counter()
            phase["split_pack"] += packed_at - took
            gathered = torch.zeros(size * len(header), dtype=torch.int64, device=self.device_name)
            _all_gather_single(gathered, header.to(self.device_name), exchange.group)
            self._last_ok = time.monotonic()  # every member passed this collective (the re-form waits from here)
            phase["header"] += time.perf_counter() - packed_at
            table = gathered.view(size, -1).cpu().tolist()
            exchange.bytes_sent += 8 * len(header) * (size - 1)
            exchange.bytes_received += 8 * len(header) * (size - 1)
            all_flags = [row[0] for row in table]
            if any(f & WANTS_STOP for f in all_flags) and not self.group_stopping.is_set():
                self.group_stopping.set()
                if self.on_group_stop is not None:
                    self.on_group_stop()
            if not any(f & HAS_BATCH for f in all_flags):
                if all(f & DRAINED for f in all_flags):
                    logger.info("rank %d: every rank drained after %d steps", self.rank, self.steps)
                    return 0
                continue
            self._step(table, item, packed)

    def _take(self) -> MergedBatch | None:
        """Every batch queued now (one kind of weights), merged; waits up to ``tick_s`` for a first one."""
        items: list[tuple[Batch, Future[torch.Tensor]]] = []
        if self._held:
            weighted = self._held[0][0][2] is not None
            while self._held and (self._held[0][0][2] is not None) == weighted:
                items.append(self._held.pop(0))
        else:
            try:
                items = [self._queue.get(timeout=self.tick_s)]
            except queue.Empty:
                return None
        weighted = items[0][0][2] is not None
        rows = sum(batch[1].numel() for batch, _ in items) // self.routing.num_features
        while rows < MAX_MERGED_ROWS and not self._held:
            try:
                queued = self._queue.get_nowait()
            except queue.Empty:
                break
            if (queued[0][2] is not None) != weighted:
                self._held.append(queued)
                break
            items.append(queued)
            rows += queued[0][1].numel() // self.routing.num_features
        return MergedBatch(items, self.routing.num_features)

    def _step(self, table: list[list[int]], item: MergedBatch | None, packed: list[torch.Tensor]) -> None:
        size = len(self.membership.members)
        rank = self.rank
        exchange = self.exchange
        mine = self.served[rank]
        send = [torch.cat([packed[g] for g in self.served[m]]) if m != rank and self.served[m] else _EMPTY
                for m in range(size)]  # fmt: skip
        receive = [sum(table[s][_FIXED + g] for g in mine) if s != rank else 0 for s in range(size)]
        phase = self.phase_s
        began = time.perf_counter()
        received = exchange.all_to_all(send, receive)
        ids_done = time.perf_counter()
        phase["ids_all_to_all"] += ids_done - began
        own = None
        if item is not None:
            for g in mine:  # this host's slots on its own batch
                partial = self.parts[g].module(*item.batch)
                own = partial if own is None else own.add_(partial)
        own_done = time.perf_counter()
        phase["own_lookup"] += own_done - ids_done
        replies = []
        for source in range(size):
            if source == rank or not table[source][0] & HAS_BATCH:
                replies.append(_EMPTY)
                continue
            batch, weighted = table[source][1], bool(table[source][2])
            pieces = received[source].split([table[source][_FIXED + g] for g in mine])
            columns = []
            for g, piece in zip(mine, pieces):
                sub = exchange.unpack(piece, batch, weighted, g)
                partial = self.parts[g].module(*full_request(self.routing, g, batch, sub))
                columns.append(exchange.own_columns(partial, g))
            replies.append(torch.cat(columns) if columns else _EMPTY)
        my_batch = table[rank][1] if item is not None else 0
        sizes = [
            sum(exchange.output_bytes(g, my_batch) for g in self.served[m]) if m != rank and item is not None else 0
            for m in range(size)
        ]
        replies_done = time.perf_counter()
        phase["peer_lookups"] += replies_done - own_done
        pieces = exchange.all_to_all(replies, sizes)
        columns_done = time.perf_counter()
        phase["columns_all_to_all"] += columns_done - replies_done
        self._last_ok = time.monotonic()
        self.steps += 1
        if item is None:
            return
        if own is None:  # this host serves no slot now: its columns all come from the others
            own = torch.zeros(my_batch, self.routing.output_dim, device=self.device_name)
        for member in range(size):
            if member == rank or not self.served[member]:
                continue
            chunks = pieces[member].split([exchange.output_bytes(g, my_batch) for g in self.served[member]])
            for g, chunk in zip(self.served[member], chunks):
                exchange.add_columns(own, g, chunk)
        self.forwards += 1
        self._current = None
        item.answer(own)
        phase["assemble_answer"] += time.perf_counter() - columns_done

    @property
    def device_name(self) -> str:
        return self.exchange.device


_EMPTY = torch.empty(0, dtype=torch.uint8)


def _all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    """Every rank's ``tensor``, concatenated in rank order (torch 2.13 renamed ``all_gather_into_tensor``)."""
    if group is not None:  # a ProcessGroup, or a re-formed group's gloo backend (outside torch.distributed's registry)
        group._allgather_base(output, tensor).wait()
        return
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor)
