"""``python -m server.group.launch ARGS``: torchrun (same arguments) whose SIGTERM drains the group cleanly.

torchrun turns SIGTERM into an exception: it kills its workers, exits 1 with a stack trace, and the other
hosts' torchrun print a ``DistNetworkError`` stack from their exit barrier. An orchestrator stops a pod with
SIGTERM to its first process, torchrun, so this launcher keeps torchrun's own handler off SIGTERM (torchrun's
``--signals-to-handle``, unless given) and forwards SIGTERM to its workers instead: the worker drains
like any rank told to stop (``server.group.step``), every rank exits 0, and every torchrun exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

logger = logging.getLogger(__name__)

OTHER_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # still torchrun's: it stops its workers at once on these


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


def main(argv: list[str] | None = None) -> None:
    args = list(argv if argv is not None else sys.argv[1:])
    if not any(a.startswith(("--signals-to-handle", "--signals_to_handle")) for a in args):
        args = ["--signals-to-handle", OTHER_SIGNALS, *args]
    signal.signal(signal.SIGTERM, _forward_sigterm)
    # c10d rendezvous: a new store per round, so a restarted group never reads the dead workers' addresses
    # (server.group.leader._attempt_store)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.run import main as torchrun

    torchrun(args)


if __name__ == "__main__":
    main()
