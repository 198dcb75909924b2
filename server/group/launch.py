"""``python -m server.group.launch ARGS``: torchrun (same arguments) whose SIGTERM drains the group cleanly.

torchrun turns SIGTERM into an exception: it kills its workers, exits 1 with a stack trace, and the other
hosts' torchrun print a ``DistNetworkError`` stack from their exit barrier. An orchestrator stops a pod with
SIGTERM to its first process, torchrun, so this launcher keeps torchrun's own handler off SIGTERM (torchrun's
``--signals-to-handle``, unless given) and forwards SIGTERM to its workers instead: the worker drains
like any rank told to stop (``server.group.step``), every rank exits 0, and every torchrun exits 0.

torchrun's agents then meet in an exit barrier on the store that one of them hosts, and the host may return
and close its store before another agent's wait has its answer: that agent's store client prints a
``DistNetworkError`` stack (pytorch/pytorch#69520; seen here in test runs with a busy neighbour). So the order
of leaving is fixed (``linger``): once through the barrier, every agent checks out on the store with one
answered request (a count; the last to count sets a key, which the store does not answer) and leaves; only the
store's host waits, until every agent has checked out. No agent but the host has a request in flight when the
host closes the store, so no agent can be cut off.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

OTHER_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # still torchrun's: it stops its workers at once on these
CHECKED_OUT = "embserve/exit_barrier/checked_out"  # store keys of the check-out after torchrun's exit barrier
ALL_CHECKED_OUT = "embserve/exit_barrier/all_checked_out"
CHECK_OUT_TIMEOUT_S = 30.0  # every agent came through the barrier, so only a crash between makes the host wait this
LISTEN = "0A"  # a listening socket's state in /proc/net/tcp


def worker_pids(parent: int) -> list[int]:
    """Processes whose parent is ``parent`` (Linux ``/proc``): torchrun's workers."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            children.append(int(entry.name))
    return children


def _forward_sigterm(signum: int, frame: FrameType | None) -> None:
    for pid in worker_pids(os.getpid()):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def serves_store(store: Any) -> bool:
    """Whether this process runs the server of ``store`` (a TCPStore, or a PrefixStore over one): one of its
    sockets listens on the store's port (Linux ``/proc``). False for any other kind of store."""
    from torch.distributed import PrefixStore

    while isinstance(store, PrefixStore):
        store = store.underlying_store
    port = getattr(store, "port", None)
    if not isinstance(port, int):
        return False
    mine = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            mine.add(target[len("socket:[") : -1])
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue  # no IPv6 (or no IPv4) here
        for row in rows:
            # "sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ..."
            fields = row.split()
            listening = fields[3] == LISTEN
            if listening and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] in mine:
                return True
    return False


def check_out(store: Any, world_size: int, hosts_store: bool, timeout_s: float = CHECK_OUT_TIMEOUT_S) -> None:
    """After the exit barrier: count this agent out; the store's host (``hosts_store``) then waits until all
    ``world_size`` agents have been counted, any other agent returns at once.

    An agent's count is answered before any agent can see that all have counted, and the last to count sets a
    key (a set has no answer), so when the host sees every agent counted and leaves (closing the store), no
    other agent waits for an answer from it. A store already gone or a timeout (an agent that crashed after
    the barrier) ends the host's wait quietly.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.utils.store import store_timeout

    try:
        with store_timeout(store, timeout_s):
            if store.add(CHECKED_OUT, 1) == world_size:
                store.set(ALL_CHECKED_OUT, "1")
            if hosts_store:
                store.wait([ALL_CHECKED_OUT])
    except SignalException:
        raise
    except Exception as err:  # noqa: BLE001 - the barrier is done; leaving is all that is left
        logger.debug("check-out after the exit barrier ended early: %s", err)


def linger(
    exit_barrier: Callable[[Any], None], hosts_store: Callable[[Any], bool] | None = None
) -> Callable[[Any], None]:
    """torchrun's agent ``_exit_barrier``, followed by ``check_out`` on the agent's store. ``hosts_store(agent)``
    says whether the agent runs its store's server (default: ``serves_store(agent._store)``)."""

    def exit_barrier_then_check_out(agent: Any) -> None:
        exit_barrier(agent)
        host = hosts_store(agent) if hosts_store is not None else serves_store(agent._store)
        check_out(agent._store, agent._worker_group.group_world_size, host)

    return exit_barrier_then_check_out


def main(argv: list[str] | None = None) -> None:
    args = list(argv if argv is not None else sys.argv[1:])
    if not any(a.startswith(("--signals-to-handle", "--signals_to_handle")) for a in args):
        args = ["--signals-to-handle", OTHER_SIGNALS, *args]
    signal.signal(signal.SIGTERM, _forward_sigterm)
    # c10d rendezvous: a new store per round, so a restarted group never reads the dead workers' addresses
    # (server.group.leader._attempt_store)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.run import main as torchrun

    SimpleElasticAgent._exit_barrier = linger(SimpleElasticAgent._exit_barrier)  # type: ignore[method-assign]
    torchrun(args)


if __name__ == "__main__":
    main()
