"""The InferenceService: decode -> validate -> batch -> run -> encode, with a status code for every failure.

Request bytes are decoded by the handler (not by grpc), so bytes that are not a valid message are an
INVALID_ARGUMENT like any other bad input. A client sees a status code and a bounded message about its
own input; an unexpected failure is INTERNAL with a request id, its traceback logged once per kind.
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
from infer.version import __version__
from server import codec, wire
from server.batcher import MAX_MERGE_EXAMPLES, DynamicBatcher, QueueFullError, Runner
from server.metrics import ServerMetrics
from server.proto import inference_pb2 as pb
from server.proto import inference_pb2_grpc as pb_grpc
from server.validated import RequestLayout, ValidatedBatch

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
_EMBEDDINGS_FIELD = wire.field_number(pb.LookupResponse, "embeddings")


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


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Register the service with lenient request decoding (instead of the generated ``add_..._to_server``)."""
    methods: dict[str, tuple[Any, Any, Any]] = {
        "Lookup": (servicer.Lookup, pb.LookupRequest, pb.LookupResponse),
        "Predict": (servicer.Predict, pb.PredictRequest, pb.PredictResponse),
        "GetModelMetadata": (servicer.GetModelMetadata, pb.GetModelMetadataRequest, pb.ModelMetadata),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            method, request_deserializer=lenient(request), response_serializer=wire.serialize
        )
        for name, (method, request, response) in methods.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def bounded(message: str) -> str:
    """A status message short enough for gRPC metadata (client input in it is clipped already)."""
    return rules.clip(message, rules.MAX_MESSAGE_CHARS)


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    # (model_name, model_version) -> the servicer of that model, for requests that name one; set by
    # server.oip (a repository serves several models and versions); None: only the default model
    route: Callable[[str, str], InferenceServicer] | None = None

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
        self.runtime = runtime
        self.always_wait = always_wait
        self.spec = runtime.spec
        self.metrics = metrics
        manifest = runtime.manifest
        self.version = manifest.file(manifest.model_file).sha256[:16]
        self.max_batch_size = max_batch_size
        self._batchers: list[DynamicBatcher] = []
        self._in_flight = 0
        self._layout = RequestLayout.of(self.spec)
        self._layout_spec = self.spec
        self.lookups = self.batcher(self._run_lookup, max_queue, workers, max_delay_s, max_merge_examples)
        self.predictions = (
            self.batcher(self._run_predict, max_queue, workers, max_delay_s, max_merge_examples)
            if runtime.has_dense
            else None
        )
        self._columns = codec.column_ranges(self.spec)
        self._metadata = self._build_metadata()
        # read at scrape time: a value set when a request finished missed every request still waiting
        metrics.queue_depth.set_function(
            lambda: self.lookups.depth + (self.predictions.depth if self.predictions is not None else 0)
        )
        self._idle = asyncio.Event()
        self._idle.set()
        self.ready = False  # Lookup/Predict answer UNAVAILABLE until the server finished warming up
        self.closing = False  # ... and again once the server stops taking calls (see RunningServer.stop)
        self.last_arrival = time.monotonic()
        self._internal_errors: Counter[str] = Counter()

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

    @property
    def layout(self) -> RequestLayout:
        """The served spec's request layout (a repository may point this servicer at another version's spec)."""
        if self._layout.feature_names != self.spec.feature_names or self._layout_spec is not self.spec:
            self._layout = RequestLayout.of(self.spec)
            self._layout_spec = self.spec
        return self._layout

    def _arriving(self) -> int:
        """Model calls accepted (in flight) but not queued in a batcher: the ones a batch could still take."""
        return self._in_flight - sum(b.held for b in self._batchers)

    @property
    def in_flight(self) -> int:
        """Lookup, Predict and Open Inference Protocol gRPC calls being answered now."""
        return self._in_flight

    async def drained(self) -> None:
        """Return once no Lookup or Predict call is in flight."""
        while self._in_flight:
            await self._idle.wait()

    async def quiesce(self, quiet_s: float, timeout_s: float) -> None:
        """Refuse new calls (UNAVAILABLE), then return once none is in flight and none arrived for ``quiet_s``
        (or after ``timeout_s``). grpc cancels calls it received but had not handed to a handler when the
        server stops; refusing them here first turns that CANCELLED into a clean, retryable UNAVAILABLE."""
        self.closing = True
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
        return self.runtime.lookup_unchecked(values, lengths, weights)  # validated once, on decode

    def _run_predict(
        self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, dense: torch.Tensor | None
    ) -> torch.Tensor:
        assert dense is not None
        return self.runtime.lookup_and_predict_unchecked(dense, values, lengths, weights)[1]  # float32 [batch]

    def start(self) -> None:
        self.lookups.start()
        if self.predictions is not None:
            self.predictions.start()

    async def close(self) -> None:
        await self.lookups.close()
        if self.predictions is not None:
            await self.predictions.close()

    # ---------------------------------------------------------------- RPCs
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        return await self._handle("Lookup", context, self._lookup(request, context))

    async def Predict(self, request: pb.PredictRequest, context: grpc.aio.ServicerContext) -> pb.PredictResponse:
        return await self._handle("Predict", context, self._predict(request, context))

    async def GetModelMetadata(
        self, request: pb.GetModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadata:
        if self.closing:
            self.metrics.requests.labels("GetModelMetadata", "UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
        if not isinstance(request, Undecodable) and (request.model_name or request.model_version):

            async def named() -> pb.ModelMetadata:
                return self._target(request)._metadata

            return await self._handle("GetModelMetadata", context, named())
        self.metrics.requests.labels("GetModelMetadata", "OK").inc()
        return self._metadata

    def _target(self, request: Any) -> InferenceServicer:
        """The servicer of the model a request names (its optional model_name / model_version)."""
        if not (request.model_name or request.model_version):
            return self
        if self.route is None:
            raise _Failure(
                grpc.StatusCode.NOT_FOUND, "this server serves one model; leave model_name empty", "not_found"
            )
        return self.route(request.model_name, request.model_version)

    def _accept(self, request: Any) -> None:
        """Gate every model call: undecodable bytes and calls during warm-up are refused first."""
        if isinstance(request, Undecodable):
            raise _Failure(
                grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {request.message_name}", "undecodable"
            )
        if not self.ready:
            raise _Failure(grpc.StatusCode.UNAVAILABLE, "the server is warming up; retry shortly", "warming_up")
        if self.closing:
            raise _Failure(
                grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica", "draining"
            )

    async def _lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        self._accept(request)
        if request.output_type not in (pb.OUTPUT_TYPE_FP32, pb.OUTPUT_TYPE_FP16):
            raise RequestError(f"unknown output_type {request.output_type}")
        target = self._target(request)
        started = time.perf_counter()
        batch = codec.decode_batch(request.sparse, None, target.layout, target.spec)
        self.metrics.observe_stage("decode", time.perf_counter() - started)
        _check_deadline(context)
        pooled = await target._submit(target.lookups, batch)
        started = time.perf_counter()
        head = pb.LookupResponse(
            batch_size=pooled.shape[0],
            dim=pooled.shape[1],
            output_type=request.output_type,
            columns=target._columns,
            model_version=target.version,
        ).SerializeToString()
        embeddings = pooled.to(torch.float16) if request.output_type == pb.OUTPUT_TYPE_FP16 else pooled
        response = wire.with_bytes_fields(head, _EMBEDDINGS_FIELD, [wire.payload(embeddings)])
        self.metrics.observe_stage("encode", time.perf_counter() - started)
        return response  # type: ignore[return-value]  # LookupResponse bytes, written once (server.wire)

    async def _predict(self, request: pb.PredictRequest, context: grpc.aio.ServicerContext) -> pb.PredictResponse:
        self._accept(request)
        target = self._target(request)
        if target.predictions is None:
            raise _Failure(
                grpc.StatusCode.FAILED_PRECONDITION, "this model has no dense part; call Lookup", "no_dense_part"
            )
        started = time.perf_counter()
        batch = codec.decode_batch(request.sparse, request.dense_features, target.layout, target.spec)
        self.metrics.observe_stage("decode", time.perf_counter() - started)
        _check_deadline(context)
        scores = await target._submit(target.predictions, batch)
        return pb.PredictResponse(
            batch_size=scores.shape[0],
            scores=scores.numpy().tobytes(),  # float32 [batch] (Runtime.scores)
            model_version=target.version,
        )

    async def _submit(self, batcher: DynamicBatcher, batch: ValidatedBatch) -> torch.Tensor:
        if batch.batch_size > self.max_batch_size:
            raise RequestError(too_large(batch.batch_size, self.max_batch_size))
        return await batcher.submit(batch)

    async def _handle(self, method: str, context: grpc.aio.ServicerContext, work: Awaitable[Any]) -> Any:
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
            self._log_internal(method, err, request_id)
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

    def _log_internal(self, method: str, err: Exception, request_id: str) -> None:
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

    def _build_metadata(self) -> pb.ModelMetadata:
        manifest = self.runtime.manifest
        spec = self.spec
        return pb.ModelMetadata(
            model_version=self.version,
            format_version=manifest.format_version,
            tables=[
                pb.TableMetadata(
                    name=t.name,
                    num_embeddings=t.num_embeddings,
                    embedding_dim=t.embedding_dim,
                    data_type=t.data_type.value,
                    pooling=t.pooling.value,
                    feature_names=list(t.feature_names),
                )
                for t in spec.tables
            ],
            feature_order=list(spec.feature_names),
            columns=self._columns,
            output_dim=spec.output_dim,
            has_dense=self.runtime.has_dense,
            num_dense_features=spec.num_dense_features,
            devices=list(manifest.devices),
            world_size=manifest.world_size,
            embserve_version=__version__,
            max_batch_size=self.max_batch_size,
        )


class _Failure(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, reason: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason  # the label of embserve_rejected_total


# The failures a client causes (or must back off from): answered with their status, never logged as errors.
REJECTIONS = (RequestError, QueueFullError, _Failure)


def rejection(err: Exception) -> tuple[grpc.StatusCode, str, str]:
    """Status code, message and ``embserve_rejected_total`` reason of one of ``REJECTIONS`` (every protocol
    front end answers them the same way)."""
    if isinstance(err, _Failure):
        return err.code, err.message, err.reason
    if isinstance(err, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(err), "queue_full"
    return grpc.StatusCode.INVALID_ARGUMENT, str(err), "invalid"


def too_large(batch_size: int, max_batch_size: int) -> str:
    """The one wording of a request larger than the server's batches (every protocol)."""
    return f"batch of {batch_size} examples exceeds the server's max batch size {max_batch_size}; split the request"


def _check_deadline(context: grpc.aio.ServicerContext) -> None:
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise _Failure(
            grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the request was batched", "deadline"
        )
