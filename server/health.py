"""grpc.health.v1 for a server that drains: NOT_SERVING first, and Watch streams that end with the server.

grpc's reference servicer keeps every Watch stream open forever, so a graceful stop would wait out its
whole timeout for them. Here ``end_watches`` sends each watcher its last status and closes the stream,
after which the server's stop waits only for real calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer


class DrainingHealthServicer(HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self._changed = asyncio.Condition()
        self._ending = False

    async def set(self, service: str, status: Any) -> None:
        await super().set(service, status)
        await self._notify()

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        await self._notify()

    async def end_watches(self) -> None:
        """Every open Watch stream sends its current status and ends."""
        self._ending = True
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def Watch(  # type: ignore[override]
        self, request: health_pb2.HealthCheckRequest, context: Any
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = self._server_status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if self._ending:
                return
            async with self._changed:
                await self._changed.wait()
