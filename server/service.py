"""The InferenceService: decode -> validate -> batch -> run -> encode, with a status code for every failure."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any

import grpc
import torch

from infer.artifact.runtime import Runtime
from infer.errors import RequestError
from infer.version import __version__
from server import codec
from server.batcher import DynamicBatcher, QueueFullError
from server.metrics import ServerMetrics
from server.proto import inference_pb2 as pb
from server.proto import inference_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(
        self,
        runtime: Runtime,
        metrics: ServerMetrics,
        max_batch_size: int,
        max_delay_s: float,
        max_queue: int,
        workers: int,
    ) -> None:
        self.runtime = runtime
        self.spec = runtime.spec
        self.metrics = metrics
        manifest = runtime.manifest
        self.version = manifest.file(manifest.model_file).sha256[:16]
        self.max_batch_size = max_batch_size
        self.lookups = DynamicBatcher(
            self._run_lookup, max_batch_size, max_delay_s, max_queue, workers, metrics.observe_batch
        )
        self.predictions = (
            DynamicBatcher(self._run_predict, max_batch_size, max_delay_s, max_queue, workers, metrics.observe_batch)
            if runtime.has_dense
            else None
        )
        self._columns = codec.column_ranges(self.spec)
        self._metadata = self._build_metadata()
        # read at scrape time: a value set when a request finished missed every request still waiting
        metrics.queue_depth.set_function(
            lambda: self.lookups.depth + (self.predictions.depth if self.predictions is not None else 0)
        )
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def drained(self) -> None:
        """Return once no Lookup or Predict call is in flight."""
        while self._in_flight:
            await self._idle.wait()

    # ---------------------------------------------------------------- model calls (executor threads)
    def _run_lookup(
        self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, dense: torch.Tensor | None
    ) -> torch.Tensor:
        with torch.inference_mode():
            return self.runtime.module(values, lengths, weights).cpu()

    def _run_predict(
        self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, dense: torch.Tensor | None
    ) -> torch.Tensor:
        with torch.inference_mode():
            return self.runtime.module.predict(dense, values, lengths, weights).cpu()

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
        self.metrics.requests.labels("GetModelMetadata", "OK").inc()
        return self._metadata

    async def _lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        if request.output_type not in (pb.OUTPUT_TYPE_FP32, pb.OUTPUT_TYPE_FP16):
            raise RequestError(f"unknown output_type {request.output_type}")
        features = codec.decode_sparse(request.sparse, self.spec)
        _check_deadline(context)
        pooled = await self._submit(self.lookups, features, None)
        return pb.LookupResponse(
            batch_size=pooled.shape[0],
            dim=pooled.shape[1],
            output_type=request.output_type,
            embeddings=codec.encode_embeddings(pooled, request.output_type),
            columns=self._columns,
            model_version=self.version,
        )

    async def _predict(self, request: pb.PredictRequest, context: grpc.aio.ServicerContext) -> pb.PredictResponse:
        if self.predictions is None:
            raise _Failure(grpc.StatusCode.FAILED_PRECONDITION, "this model has no dense part; call Lookup")
        features = codec.decode_sparse(request.sparse, self.spec)
        dense = codec.decode_dense(request.dense_features, features.batch_size, self.spec.num_dense_features)
        _check_deadline(context)
        scores = await self._submit(self.predictions, features, dense)
        return pb.PredictResponse(
            batch_size=scores.shape[0],
            scores=scores.to(torch.float32).contiguous().numpy().tobytes(),
            model_version=self.version,
        )

    async def _submit(self, batcher: DynamicBatcher, features: Any, dense: torch.Tensor | None) -> torch.Tensor:
        if features.batch_size > self.max_batch_size:
            raise RequestError(
                f"batch of {features.batch_size} examples exceeds the server's max batch size {self.max_batch_size}; "
                "split the request"
            )
        return await batcher.submit(features, dense)

    async def _handle(self, method: str, context: grpc.aio.ServicerContext, work: Awaitable[Any]) -> Any:
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        message = ""
        self._in_flight += 1
        self._idle.clear()
        try:
            return await work
        except RequestError as err:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(err)
        except QueueFullError as err:
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)
        except _Failure as err:
            code, message = err.code, err.message
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except Exception:  # noqa: BLE001 - the client gets INTERNAL and a request id, the log gets the traceback
            request_id = uuid.uuid4().hex[:12]
            logger.exception("%s failed (request id %s)", method, request_id)
            code, message = grpc.StatusCode.INTERNAL, f"internal error (request id {request_id}); see the server log"
        finally:
            self.metrics.requests.labels(method, code.name).inc()
            self.metrics.latency.labels(method).observe(time.perf_counter() - started)
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()
        await context.abort(code, message)

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
            has_dense=manifest.has_dense,
            num_dense_features=spec.num_dense_features,
            devices=list(manifest.devices),
            world_size=manifest.world_size,
            embserve_version=__version__,
            max_batch_size=self.max_batch_size,
        )


class _Failure(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _check_deadline(context: grpc.aio.ServicerContext) -> None:
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise _Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the request was batched")
