"""Bearer-token authentication for every RPC except health checks and reflection."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from infer.errors import ConfigError

# Probes (health, and the Open Inference Protocol's liveness/readiness) and tooling (reflection) must
# work without the token.
OPEN_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.",
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (metadata 'authorization')")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires metadata ``authorization: Bearer <token>``; compares in constant time."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ConfigError("the bearer token is empty; give a non-empty token (or no --auth-token-file)")
        self._expected = f"Bearer {token}".encode()
        self._deny_handler = grpc.unary_unary_rpc_method_handler(_deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(given, self._expected):
                    return await continuation(handler_call_details)
        return self._deny_handler


def read_token_file(path: str) -> str:
    with open(path) as handle:
        token = handle.read().strip()
    if not token:
        raise ConfigError(f"token file {path!r} is empty; write the bearer token into it")
    return token
