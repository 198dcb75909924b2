"""``embserve serve DIR --native``: run the native server binary (``embserve-server``, cpp_loader/server/) with the
same flags; a flag the binary does not take is an error naming it, never silently dropped.

The binary is found at ``$EMBSERVE_SERVER_BIN``, else in the repository's ``cpp_loader/build/server/`` (``make
server`` builds it there), else on ``PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from infer.errors import ConfigError

BINARY = "embserve-server"
REPO = Path(__file__).resolve().parents[1]
BUILT = REPO / "cpp_loader" / "build" / "server" / BINARY

# `embserve serve` flags the binary takes, as they are
PASSED = (
    "--host", "--port", "--max-batch-size", "--max-delay-us", "--max-merge-examples", "--batch-wait",
    "--max-queue", "--forward-threads", "--intra-op-threads", "--threads", "--max-message-mb", "--metrics-port",
    "--metrics-host", "--tls-cert", "--tls-key", "--auth-token-file", "--drain-grace-s", "--drain-quiet-s",
    "--drain-seconds", "--model-name", "--verify", "--http-port", "--http-host", "--backend", "--poll-s",
    "--version-policy", "--prefetch",
)  # fmt: skip
# --backend values the binary runs (onnxruntime stays with the Python server)
BACKENDS = ("torchscript", "pt2")
# `embserve serve` flags turned into the binary's --hot-rows-file: the rows are chosen here, as the Python server
# chooses them (infer.artifact.paged.hot_rows_from_sample), and handed over as JSON {"table": [row, ...]}
HOT_ROWS_DESTS = ("hot_rows", "hot_rows_sample")


def find_binary() -> str:
    """The embserve-server to run; ConfigError saying how to build it when there is none."""
    given = os.environ.get("EMBSERVE_SERVER_BIN")
    if given:
        if not os.access(given, os.X_OK):
            raise ConfigError(f"EMBSERVE_SERVER_BIN={given} is not an executable file")
        return given
    if os.access(BUILT, os.X_OK):
        return str(BUILT)
    found = shutil.which(BINARY)
    if found:
        return found
    raise ConfigError(
        f"--native needs the {BINARY} binary: build it with `make server` (it lands in {BUILT.parent}), "
        "or point EMBSERVE_SERVER_BIN at one"
    )


def native_command(args: argparse.Namespace) -> list[str]:
    """The binary's command line for these ``embserve serve`` arguments (ConfigError for any it lacks)."""
    if args.backend not in BACKENDS:
        runs = " or ".join(BACKENDS)
        raise ConfigError(f"{BINARY} runs --backend {runs}, not {args.backend}; serve without --native")
    hot_rows = hot_rows_flags(args)  # before the binary is looked for: a bad sample is the same error either way
    command = [find_binary(), str(args.artifact), *hot_rows]
    for action in args.parser._actions:
        if not action.option_strings or action.dest in ("help", "native", *HOT_ROWS_DESTS):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if flag not in PASSED:
            raise ConfigError(f"{BINARY} has no {flag}: drop it, or serve without --native")
        if isinstance(action, argparse._StoreTrueAction):
            command.append(flag)
        else:
            command += [flag, str(value)]
    return command


def hot_rows_flags(args: argparse.Namespace) -> list[str]:
    """``--hot-rows-file`` for ``--hot-rows N --hot-rows-sample FILE`` (none without them): the rows the Python
    server would cache (``hot_rows_of``: its checks and words), written as JSON to a memory file this process
    hands on through ``exec`` (``/proc/self/fd/N``: nothing left on disk)."""
    if getattr(args, "hot_rows", None) is None and getattr(args, "hot_rows_sample", None) is None:
        return []
    from infer.commands.hot_rows import hot_rows_of
    from server.cli import refuse_whole_artifact_flags

    refuse_whole_artifact_flags(args)  # a repository or multi-host artifact (cmd_serve checked already)
    rows = hot_rows_of(args, args.artifact) or {}
    text = json.dumps({table: ids.tolist() for table, ids in rows.items()}).encode()
    fd = os.memfd_create("embserve-hot-rows", 0)  # no MFD_CLOEXEC: the binary reads it after exec
    left = memoryview(text)
    while left:
        left = left[os.write(fd, left) :]
    os.set_inheritable(fd, True)
    return ["--hot-rows-file", f"/proc/self/fd/{fd}"]


def exec_native(args: argparse.Namespace) -> None:
    """Replace this process with the binary: its signals, output and exit code are the command's."""
    command = native_command(args)
    os.execv(command[0], command)
