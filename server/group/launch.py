"""``python -m server.group.launch ARGS``: torchrun (same arguments) whose SIGTERM drains the group cleanly.

torchrun turns SIGTERM into an exception: it kills its workers, exits 1 with a stack trace, and the other
hosts' torchrun print a ``DistNetworkError`` stack from their exit barrier. An orchestrator stops a pod with
SIGTERM to its first process, torchrun, so this launcher keeps torchrun's own handler off SIGTERM (torchrun's
``--signals-to-handle``, unless given) and forwards SIGTERM to its workers instead: the worker drains
like any rank told to stop (``server.group.step``), every rank exits 0, and every torchrun exits 0.

torchrun's agents then meet in an exit barrier on the store that one of them hosts, and the host may return
and close its store before another agent's wait has its answer: that agent logs a ``DistNetworkError`` stack
(pytorch/pytorch#69520; seen here in a test run with a busy neighbour). So each agent, once through the
barrier, checks out on the store, and no agent leaves before every one has checked out (``linger``).
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
CHECK_OUT_TIMEOUT_S = 30.0  # every agent came through the barrier, so only a crash between makes one wait this


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


def check_out(store: Any, world_size: int, timeout_s: float = CHECK_OUT_TIMEOUT_S) -> None:
    """After the exit barrier: count this agent out, and return once all ``world_size`` have been counted.

    The store's host is then the last to close it, after every other agent's barrier wait has been answered.
    A store already gone (its host left: every agent was counted) or a timeout ends the wait quietly.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.utils.store import store_timeout

    try:
        with store_timeout(store, timeout_s):
            if store.add(CHECKED_OUT, 1) == world_size:
                store.set(ALL_CHECKED_OUT, "1")
            store.wait([ALL_CHECKED_OUT])
    except SignalException:
        raise
    except Exception as err:  # noqa: BLE001 - the barrier is done; leaving is all that is left
        logger.debug("check-out after the exit barrier ended early: %s", err)


def linger(exit_barrier: Callable[[Any], None]) -> Callable[[Any], None]:
    """torchrun's agent ``_exit_barrier``, followed by ``check_out`` on the agent's store."""

    def exit_barrier_then_check_out(agent: Any) -> None:
        exit_barrier(agent)
        check_out(agent._store, agent._worker_group.group_world_size)

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
