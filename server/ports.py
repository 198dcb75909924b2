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


@dataclass(frozen=True)
class PortClaim:
    """A port one multi-process instance owns (``embserve serve --workers N``): a per-port lock that refuses a
    second embserve instance, and a bound, never listening socket with SO_REUSEPORT only, which refuses any
    bind without SO_REUSEPORT while letting the instance's own workers (same user, SO_REUSEPORT) listen beside
    it. The kernel spreads new connections over the listening workers."""

    port: Port
    lock: socket.socket
    holder: socket.socket

    def close(self) -> None:
        self.holder.close()
        self.lock.close()


def _lock_name(port: int) -> str:
    # Linux abstract socket: no file, gone with the process that binds it; per port, whatever the host
    return f"\0embserve-port-{port}"


def claim(port: Port) -> PortClaim:
    """Own ``port`` for the workers of one instance; port 0 picks a free one (``PortClaim.port`` has it).
    Refused with ``in_use`` when another embserve instance or any other listener has it."""
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if port.port:
            _take(lock, port)
            probe(port)  # a listener of another program, with or without SO_REUSEPORT
        infos = socket.getaddrinfo(port.host, port.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        holder = socket.socket(family, kind, proto)
        try:
            # SO_REUSEPORT without SO_REUSEADDR: a plain bind (an unrelated server) conflicts with it
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            holder.bind(address)
        except OSError as err:
            holder.close()
            raise bind_error(port, err) from None
        bound = Port(port.role, port.host, int(holder.getsockname()[1]), port.flag)
        if not port.port:
            _take(lock, bound)
        return PortClaim(bound, lock, holder)
    except BaseException:
        lock.close()
        raise


def _take(lock: socket.socket, port: Port) -> None:
    try:
        lock.bind(_lock_name(port.port))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise in_use(port) from None
        raise cannot_bind(port, err.strerror or str(err)) from None
