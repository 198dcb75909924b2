"""The group's members and who serves each slot; re-forming the group among the survivors of a lost host.

A *slot* is one host of the plan (its shards, ``hosts/<slot>/``); with ``--replicas R`` host ``h`` holds slots
``h, h - 1, ..., h - R + 1`` (``infer.planner.replicas``). The *members* are the hosts in the current step group,
member ``i`` being rank ``i`` of it. Each slot is served by the first live host of its ring (its own host while
it lives), so in steady state every host serves its own slot (the planner balanced them) and a lost host's slot
moves to the next live host holding it.

Re-forming (as torchft's Manager does with its lighthouse quorum and ``ProcessGroupGloo.configure`` on a fresh
store prefix, without restarting the survivors): every survivor registers in the group's store (the TCPStore of
the launch rendezvous, ``MASTER_ADDR:MASTER_PORT``) under generation ``g + 1``; the first to arrive decides the
members once every old member arrived or one collective timeout (plus a margin) passed since its own last
successful collective (the members run the same collectives in step, so every survivor's failing one started by
then and fails within the timeout: every survivor has arrived), and writes the list; everyone reads it and opens a new
gloo process group under the prefix of that generation, with ranks in list order. A survivor that arrives after
the decision is not a member: it fails as without replicas. When the store itself is lost (its host was the lost
one) no survivor can register: they all fail as without replicas (NOT_SERVING, exit 1, the launcher restarts).
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass

import torch.distributed as dist

from infer.planner.replicas import slot_holders

logger = logging.getLogger(__name__)

_PREFIX = "embserve/group"
# printed by every survivor once the group re-formed (tests and logs wait for it)
REFORMED_LINE = "embserve: the group re-formed"


@dataclass(frozen=True)
class Membership:
    """Generation ``generation`` of the group: ``members[i]`` is the host of rank ``i``."""

    generation: int
    members: tuple[int, ...]
    slots: int  # the plan's hosts
    replicas: int

    def rank_of(self, host: int) -> int:
        return self.members.index(host)

    def live_holders(self, slot: int) -> list[int]:
        """The members holding ``slot``'s shards, in ring order (its own host first)."""
        return [h for h in slot_holders(self.slots, self.replicas, slot) if h in self.members]

    def owners(self) -> tuple[int, ...] | None:
        """The member rank serving each slot (the first live holder in ring order); None when a slot has no live
        holder."""
        if self.uncovered():
            return None
        return tuple(self.members.index(self.live_holders(slot)[0]) for slot in range(self.slots))

    def uncovered(self) -> list[int]:
        """The slots no member holds."""
        return [slot for slot in range(self.slots) if not self.live_holders(slot)]


def step_group(store: dist.Store, membership: Membership, host: int, timeout_s: float) -> dist.ProcessGroupGloo:
    """The gloo process group of ``membership``'s steps, under a store prefix of its own generation (collectives
    time out after ``timeout_s``); joining waits for every member."""
    prefix = dist.PrefixStore(f"{_PREFIX}/pg/{membership.generation}/", store)
    return dist.ProcessGroupGloo(
        prefix, membership.rank_of(host), len(membership.members), datetime.timedelta(seconds=timeout_s)
    )


def agree_members(store: dist.Store, previous: Membership, host: int, decide_by: float) -> Membership:
    """The next generation's members, agreed by every survivor through ``store`` (see the module docstring);
    ``decide_by``: this host's ``time.monotonic()`` by which every survivor has arrived, if it is the first."""
    generation = previous.generation + 1
    key = f"{_PREFIX}/members/{generation}/"
    store.set(f"{key}alive/{host}", "1")
    if store.add(f"{key}arrived", 1) == 1:  # the first survivor here decides
        while store.add(f"{key}arrived", 0) < len(previous.members) and time.monotonic() < decide_by:
            time.sleep(0.01)
        alive = [h for h in previous.members if store.check([f"{key}alive/{h}"])]
        store.set(f"{key}decided", ",".join(str(h) for h in alive))
        logger.info("generation %d: members %s (decided here)", generation, alive)
    else:
        store.wait([f"{key}decided"], datetime.timedelta(seconds=max(decide_by - time.monotonic(), 0) + 60))
    members = tuple(int(h) for h in store.get(f"{key}decided").decode().split(",") if h)
    return Membership(generation, members, previous.slots, previous.replicas)
