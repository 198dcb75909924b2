"""The one pipeline every protocol adapter calls: gate -> decode and validate -> batch -> run -> (adapter encodes).

It owns what the adapters share: the default model's runtime and dynamic batchers, the calls in flight and
their drain, the ready / closing flags, and one mapping of failures to a status code, a bounded message and
a ``embserve_rejected_total`` reason. The adapters (``server.adapters``) only turn their protocol's bytes into
a call here and the answer back into bytes; the pipeline imports no adapter.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import torch

from infer import request_rules as rules
from infer.artifact.runtime import Runtime
from infer.errors import RequestError
from server.batcher import MAX_MERGE_EXAMPLES, DynamicBatcher, QueueFullError, Runner
from server.metrics import ServerMetrics
from server.validated import ValidatedBatch

logger = logging.getLogger(__name__)


class Undecodable:
    """Stands for request bytes that did not parse as the method's message."""

    def __init__(self, message_name: str) -> None:
        self.message_name = message_name


def lenient(message_type: Any) -> Callable[[bytes], Any]:
    """A request deserializer that never raises: undecodable bytes become an ``Undecodable``."""

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except Exception:  # noqa: BLE001 - protobuf raises DecodeError, and others on hostile input
            return Undecodable(message_type.DESCRIPTOR.name)

    return parse


def bounded(message: str) -> str:
    """A status message short enough for gRPC metadata (client input in it is clipped already)."""
    return rules.clip(message, rules.MAX_MESSAGE_CHARS)


class Failure(Exception):
    """A refusal with its status code, message and ``embserve_rejected_total`` reason."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason  # the label of embserve_rejected_total


# The failures a client causes (or must back off from): answered with their status, never logged as errors.
REJECTIONS = (RequestError, QueueFullError, Failure)


def rejection(err: Exception) -> tuple[grpc.StatusCode, str, str]:
    """Status code, message and ``embserve_rejected_total`` reason of one of ``REJECTIONS`` (every protocol
    adapter answers them the same way)."""
    if isinstance(err, Failure):
        return err.code, err.message, err.reason
    if isinstance(err, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(err), "queue_full"
    return grpc.StatusCode.INVALID_ARGUMENT, str(err), "invalid"


DRAINING = "the server is shutting down; retry on another replica"  # the refusal once the server stops taking calls


def check_decodable(request: Any) -> None:
    """Bytes that did not parse as the method's message are INVALID_ARGUMENT (every gRPC adapter)."""
    if isinstance(request, Undecodable):
        raise Failure(grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {request.message_name}", "undecodable")


def check_deadline(context: grpc.aio.ServicerContext) -> None:
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise Failure(
            grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the request was batched", "deadline"
        )


def run_lookup(
    runtime: Runtime,
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    dense: torch.Tensor | None,
) -> torch.Tensor:
    """A batcher's lookup forward on ``runtime``: its unchecked entry, the batch validated once, on decode."""
    return runtime.lookup_unchecked(values, lengths, weights)  # type: ignore[no-any-return]


def run_predict(
    runtime: Runtime,
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    dense: torch.Tensor | None,
) -> torch.Tensor:
    """A batcher's predict forward on ``runtime`` (validated once, on decode): float32 ``[batch]`` scores."""
    assert dense is not None
    return runtime.lookup_and_predict_unchecked(dense, values, lengths, weights)[1]  # type: ignore[no-any-return]


class Pipeline:
    """The shared request path: the default model's runtime and batchers, calls in flight, readiness and drain."""

    def __init__(
        self,
        runtime: Runtime,
        metrics: ServerMetrics,
        max_batch_size: int,
        max_delay_s: float,
        max_queue: int,
        workers: int,
        max_merge_examples: int = MAX_MERGE_EXAMPLES,
        always_wait: bool = False,
    ) -> None:
        self.follow(runtime)  # runtime, spec, version
        self.metrics = metrics
        self.max_batch_size = max_batch_size
        self.always_wait = always_wait
        self._batchers: list[DynamicBatcher] = []
        self._in_flight = 0
        self.lookups = self.batcher(self._run_lookup, max_queue, workers, max_delay_s, max_merge_examples)
        self.predictions = (
            self.batcher(self._run_predict, max_queue, workers, max_delay_s, max_merge_examples)
            if runtime.has_dense
            else None
        )
        # read at scrape time: a value set when a request finished missed every request still waiting
        metrics.queue_depth.set_function(
            lambda: self.lookups.depth + (self.predictions.depth if self.predictions is not None else 0)
        )
        self._idle = asyncio.Event()
        self._idle.set()
        self.ready = False  # model calls answer UNAVAILABLE until the server finished warming up
        self.closing = False  # ... and again once the server stops taking calls (see RunningServer.stop)
        self.last_arrival = time.monotonic()
        self._internal_errors: Counter[str] = Counter()

    def follow(self, runtime: Runtime) -> None:
        """Run the default batchers on ``runtime`` from now on (a model repository's new default version): the
        pipeline then holds no reference to the version it served before, which can be freed."""
        self.runtime = runtime
        self.spec = runtime.spec
        self.version = runtime.manifest.file(runtime.manifest.model_file).sha256[:16]

    def batcher(
        self, run: Runner, max_queue: int, workers: int, max_delay_s: float, max_merge_examples: int
    ) -> DynamicBatcher:
        """A batcher of this server: its stages measured, its delay spent only while more calls are arriving."""
        batcher = DynamicBatcher(
            run,
            self.max_batch_size,
            max_delay_s,
            max_queue,
            workers,
            self.metrics.observe_batch,
            max_merge_examples,
            self.metrics.observe_stage,
            self._arriving,
            self.always_wait,
        )
        self._batchers.append(batcher)
        return batcher

    def _arriving(self) -> int:
        """Model calls accepted (in flight) but not queued in a batcher: the ones a batch could still take."""
        return self._in_flight - sum(b.held for b in self._batchers)

    @property
    def in_flight(self) -> int:
        """Calls of every gRPC adapter being answered now."""
        return self._in_flight

    async def drained(self) -> None:
        """Return once no call is in flight."""
        while self._in_flight:
            await self._idle.wait()

    def begin_closing(self) -> None:
        """Refuse new model calls from now on, and run the batches waiting for company at once: no new call
        will join them, so waiting out the batching delay would only hold the drain back."""
        self.closing = True
        for batcher in self._batchers:
            batcher.flush()

    async def quiesce(self, quiet_s: float, timeout_s: float) -> None:
        """Refuse new calls (UNAVAILABLE), then return once none is in flight and none arrived for ``quiet_s``
        (or after ``timeout_s``). grpc cancels calls it received but had not handed to a handler when the
        server stops; refusing them here first turns that CANCELLED into a clean, retryable UNAVAILABLE."""
        self.begin_closing()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self.drained(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                return
            quiet = time.monotonic() - self.last_arrival
            if quiet >= quiet_s and not self._in_flight:
                return
            await asyncio.sleep(max(0.0, quiet_s - quiet))

    # ---------------------------------------------------------------- model calls (executor threads)
    def _run_lookup(
        self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, dense: torch.Tensor | None
    ) -> torch.Tensor:
        return run_lookup(self.runtime, values, lengths, weights, dense)  # the runtime follow() set last

    def _run_predict(
        self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, dense: torch.Tensor | None
    ) -> torch.Tensor:
        return run_predict(self.runtime, values, lengths, weights, dense)

    def start(self) -> None:
        self.lookups.start()
        if self.predictions is not None:
            self.predictions.start()

    async def close(self) -> None:
        await self.lookups.close()
        if self.predictions is not None:
            await self.predictions.close()

    # ---------------------------------------------------------------- the request path
    def accept(self, request: Any = None) -> None:
        """Gate every model call: a gRPC ``request`` whose bytes did not parse first (``check_decodable``), then
        refused during warm-up and once the server stops taking calls."""
        check_decodable(request)
        if not self.ready:
            raise Failure(grpc.StatusCode.UNAVAILABLE, "the server is warming up; retry shortly", "warming_up")
        if self.closing:
            raise Failure(grpc.StatusCode.UNAVAILABLE, DRAINING, "draining")

    def decode(self, decode: Callable[..., Any], *args: Any) -> Any:
        """Decode and validate once (``decode(*args)``, the adapter's codec over ``server.validated``), timed."""
        started = time.perf_counter()
        decoded = decode(*args)
        self.metrics.observe_stage("decode", time.perf_counter() - started)
        return decoded

    async def run(self, batcher: Any, batch: ValidatedBatch, max_batch_size: int | None = None) -> torch.Tensor:
        """Batch and run a validated request on ``batcher`` (a model's lookups, predictions, ...)."""
        limit = self.max_batch_size if max_batch_size is None else max_batch_size
        if batch.batch_size > limit:
            raise RequestError(rules.too_large(batch.batch_size, limit))
        return await batcher.submit(batch)  # type: ignore[no-any-return]

    def encode(self, encode: Callable[..., Any], *args: Any) -> Any:
        """Encode the answer once (``encode(*args)``, the adapter's), timed."""
        started = time.perf_counter()
        encoded = encode(*args)
        self.metrics.observe_stage("encode", time.perf_counter() - started)
        return encoded

    async def call(self, method: str, context: grpc.aio.ServicerContext, work: Awaitable[Any]) -> Any:
        """Answer one gRPC call: counted in flight (the drain waits for it), its failure mapped to a status."""
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        message = ""
        reason = ""
        self.last_arrival = time.monotonic()
        self._in_flight += 1
        self._idle.clear()
        try:
            return await work
        except REJECTIONS as err:
            code, message, reason = rejection(err)
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except Exception as err:  # noqa: BLE001 - the client gets INTERNAL and a request id, the log gets the traceback
            request_id = uuid.uuid4().hex[:12]
            self.log_internal(method, err, request_id)
            code, reason = grpc.StatusCode.INTERNAL, "internal"
            message = f"internal error (request id {request_id}); see the server log"
        finally:
            if reason:
                self.metrics.rejected.labels(reason).inc()
            self.metrics.observe_call(method, code.name, time.perf_counter() - started)
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()
        await context.abort(code, bounded(message))

    def log_internal(self, method: str, err: Exception, request_id: str) -> None:
        """The first failure of a kind logs its traceback; later ones a line at each power of ten."""
        kind = f"{method}:{type(err).__name__}"
        self._internal_errors[kind] += 1
        count = self._internal_errors[kind]
        if count == 1:
            logger.error("%s failed (request id %s)", method, request_id, exc_info=err)
        elif str(count).rstrip("0") == "1":  # 10, 100, 1000, ...: the log cannot be flooded
            logger.error(
                "%s failed again (request id %s): %d failures of kind %s so far", method, request_id, count, kind
            )
