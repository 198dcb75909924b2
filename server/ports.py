"""The ports a server owns: a port in use is refused at start, naming which one (gRPC, HTTP or metrics).

grpc sets SO_REUSEPORT by default, so a second server on a port that serves would start and share it;
``create_server`` turns that off and checks every port it was given before it loads a model, so the
refusal comes at once, not after the model loaded. The check is a courtesy: the real bind refuses too.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from infer.errors import ConfigError


@dataclass(frozen=True)
class Port:
    """One port a server binds: what it is for (gRPC, HTTP, metrics), where, and the flag that sets it."""

    role: str
    host: str
    port: int
    flag: str


def in_use(port: Port) -> ConfigError:
    return ConfigError(
        f"{port.role} port {port.port} is in use (host {port.host}); stop the process that holds it "
        f"or pick another {port.flag}"
    )


def cannot_bind(port: Port, reason: str) -> ConfigError:
    return ConfigError(f"cannot bind the {port.role} port {port.host}:{port.port}: {reason}; check {port.flag}")


def bind_error(port: Port, err: OSError) -> ConfigError:
    """The ``ConfigError`` of a failed bind (``in_use`` for EADDRINUSE)."""
    return in_use(port) if err.errno == errno.EADDRINUSE else cannot_bind(port, err.strerror or str(err))


def probe(port: Port) -> None:
    """Bind and release ``port`` (SO_REUSEADDR, as a server does; no SO_REUSEPORT): raise its
    ``ConfigError`` when something listens there. Port 0 (any free port) always passes."""
    if port.port == 0:
        return
    try:
        infos = socket.getaddrinfo(port.host, port.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise cannot_bind(port, str(err)) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            raise bind_error(port, err) from None
