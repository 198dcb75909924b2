"""``embserve serve DIR``: which server runs it, and running the native binary (``embserve-server``,
cpp_loader/server/) with the same flags.

``embserve serve`` runs the native binary where it is built, unless the request needs what only the Python server
has (``python_only``: multi-host artifacts, ``--workers``, ``--backend onnxruntime``, ...): then the Python server runs
and one line on stderr says why. ``--python`` selects the Python server; ``--native`` the binary, and a flag the binary
does not take is then an error naming it, never silently dropped.

The binary is found at ``$EMBSERVE_SERVER_BIN``, else in the repository's ``cpp_loader/build/server/`` (``make
server`` builds it there), else on ``PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

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
    found = built_binary()
    if found is None:
        raise ConfigError(
            f"--native needs the {BINARY} binary: build it with `make server` (it lands in {BUILT.parent}), "
            "or point EMBSERVE_SERVER_BIN at one"
        )
    return found


def built_binary() -> str | None:
    """``$EMBSERVE_SERVER_BIN`` (ConfigError when it names no executable: it was asked for), else the build
    folder's binary, else one on ``PATH``; None when there is none."""
    given = os.environ.get("EMBSERVE_SERVER_BIN")
    if given:
        if not os.access(given, os.X_OK):
            raise ConfigError(f"EMBSERVE_SERVER_BIN={given} is not an executable file")
        return given
    if os.access(BUILT, os.X_OK):
        return str(BUILT)
    return shutil.which(BINARY)


def python_only(args: argparse.Namespace) -> str | None:
    """What in these ``embserve serve`` arguments only the Python server serves (``--backend onnxruntime``, a flag
    the binary does not take, a multi-host artifact), in the words of the command line; None when the binary
    serves them all."""
    if args.backend not in BACKENDS:
        return f"--backend {args.backend}"
    for action in args.parser._actions:
        if not action.option_strings or action.dest in ("help", "native", "python", *HOT_ROWS_DESTS):
            continue
        if getattr(args, action.dest) != action.default and action.option_strings[-1] not in PASSED:
            return action.option_strings[-1]
    manifest = _manifest_json(args.artifact)
    if "hosts" in manifest:
        return "multi-host artifacts"
    wants_cache = getattr(args, "hot_rows", None) is not None or getattr(args, "prefetch", "auto") == "on"
    if wants_cache and not _one_cpu_kernel(manifest):
        return "--hot-rows or --prefetch on for a sharded artifact (it caches and reads ahead for one CPU kernel)"
    return None


def _manifest_json(artifact: str | Path) -> dict[str, Any]:
    """``artifact``'s manifest as JSON (no torch import before the binary runs), or {} when it does not read (a
    repository, or a manifest left to the server that loads it to report)."""
    try:
        data = json.loads((Path(artifact) / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _one_cpu_kernel(manifest: dict[str, Any]) -> bool:
    """Whether the manifest lists one kernel, on the CPU: what the native server's hot-row cache and prefetch serve
    (a manifest without kernels: True, left to the checks that name it)."""
    kernels = manifest.get("kernels")
    if not isinstance(kernels, list):
        return True
    return len(kernels) == 1 and isinstance(kernels[0], dict) and str(kernels[0].get("device", "cpu")) == "cpu"


def runs_native(args: argparse.Namespace) -> bool:
    """Whether ``embserve serve`` runs the binary: with ``--native``; not with ``--python``; otherwise where it is
    built and serves everything asked (else one line on stderr says why the Python server runs)."""
    if args.native or args.python:
        return bool(args.native)
    needs = python_only(args)
    if needs is not None:
        print(f"embserve serve: the Python server runs: {BINARY} does not take {needs} (--python says so and "
              "drops this line)", file=sys.stderr, flush=True)  # fmt: skip
        return False
    if built_binary() is None:
        print(f"embserve serve: the Python server runs: {BINARY} is not built (`make server` builds it; --python "
              "drops this line)", file=sys.stderr, flush=True)  # fmt: skip
        return False
    return True


def native_command(args: argparse.Namespace) -> list[str]:
    """The binary's command line for these ``embserve serve`` arguments (ConfigError for any it lacks)."""
    if args.backend not in BACKENDS:
        runs = " or ".join(BACKENDS)
        raise ConfigError(f"{BINARY} runs --backend {runs}, not {args.backend}; serve with --python")
    hot_rows = hot_rows_flags(args)  # before the binary is looked for: a bad sample is the same error either way
    command = [find_binary(), str(args.artifact), *hot_rows]
    for action in args.parser._actions:
        if not action.option_strings or action.dest in ("help", "native", "python", *HOT_ROWS_DESTS):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if flag not in PASSED:
            raise ConfigError(f"{BINARY} has no {flag}: drop it, or serve with --python")
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


def refuse_whole_artifact_flags(args: argparse.Namespace) -> None:
    """``--hot-rows`` and ``--prefetch on|off`` act on one artifact served whole (both servers): ConfigError for a
    repository or a multi-host artifact."""
    from server.group.leader import is_multi_host
    from server.repository import is_repository

    wants_hot_rows = args.hot_rows is not None or args.hot_rows_sample is not None
    if not (wants_hot_rows or args.prefetch != "auto"):
        return
    if not (is_multi_host(args.artifact) or is_repository(args.artifact)):
        return
    if wants_hot_rows:
        raise ConfigError(
            f"--hot-rows applies to one artifact served whole; {args.artifact} is a repository or a multi-host "
            "artifact. Serve one artifact folder with it, or leave the flags out"
        )
    raise ConfigError(
        f"--prefetch {args.prefetch} applies to one artifact served whole; {args.artifact} is a repository or a "
        "multi-host artifact (their versions and hosts read ahead as their plans say). Leave the flag out"
    )
