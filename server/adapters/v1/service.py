"""embserve.v1 (``embserve.v1.InferenceService``): the protocol's bytes to a call on the shared pipeline, and back.

Request bytes are decoded by the handler (not by grpc), so bytes that are not a valid message are an
INVALID_ARGUMENT like any other bad input. Gating, batching, running, the status code of every failure and
the drain are the pipeline's (``server.pipeline``); this adapter decodes (``server.adapters.v1.codec``) and encodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import torch

from infer.errors import RequestError
from infer.version import __version__
from server import wire
from server.adapters.v1 import codec
from server.pipeline import DRAINING, Failure, Pipeline, Undecodable, check_deadline, lenient
from server.proto import inference_pb2 as pb
from server.proto import inference_pb2_grpc as pb_grpc
from server.validated import RequestLayout

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
_EMBEDDINGS_FIELD = wire.field_number(pb.LookupResponse, "embeddings")


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


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """The v1 adapter of one model: the pipeline's default model, or (a copy re-bound by the model repository)
    one version of a repository's model."""

    # (model_name, model_version) -> the servicer of that model, for requests that name one; set by
    # server.app (a repository serves several models and versions); None: only the default model
    route: Callable[[str, str], InferenceServicer] | None = None

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.metrics = pipeline.metrics
        self.max_batch_size = pipeline.max_batch_size
        # the model this servicer answers for (server.repository re-binds these to a version of its models)
        self.runtime = pipeline.runtime
        self.spec = pipeline.spec
        self.version = pipeline.version
        self.lookups: Any = pipeline.lookups
        self.predictions: Any = pipeline.predictions
        self._layout = RequestLayout.of(self.spec)
        self._layout_spec = self.spec
        self._columns = codec.column_ranges(self.spec)
        self._metadata = self._build_metadata()

    @property
    def layout(self) -> RequestLayout:
        """The served spec's request layout (a repository may point this servicer at another version's spec)."""
        if self._layout.feature_names != self.spec.feature_names or self._layout_spec is not self.spec:
            self._layout = RequestLayout.of(self.spec)
            self._layout_spec = self.spec
        return self._layout

    # ---------------------------------------------------------------- RPCs
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        return await self.pipeline.call("Lookup", context, self._lookup(request, context))

    async def Predict(self, request: pb.PredictRequest, context: grpc.aio.ServicerContext) -> pb.PredictResponse:
        return await self.pipeline.call("Predict", context, self._predict(request, context))

    async def GetModelMetadata(
        self, request: pb.GetModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadata:
        if self.pipeline.closing:
            self.metrics.requests.labels("GetModelMetadata", "UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        if not isinstance(request, Undecodable) and (request.model_name or request.model_version):

            async def named() -> pb.ModelMetadata:
                return self._target(request)._metadata

            return await self.pipeline.call("GetModelMetadata", context, named())
        self.metrics.requests.labels("GetModelMetadata", "OK").inc()
        return self._metadata

    def _target(self, request: Any) -> InferenceServicer:
        """The servicer of the model a request names (its optional model_name / model_version)."""
        if not (request.model_name or request.model_version):
            return self
        if self.route is None:
            raise Failure(
                grpc.StatusCode.NOT_FOUND, "this server serves one model; leave model_name empty", "not_found"
            )
        return self.route(request.model_name, request.model_version)

    async def _lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        self.pipeline.accept(request)
        if request.output_type not in (pb.OUTPUT_TYPE_FP32, pb.OUTPUT_TYPE_FP16):
            raise RequestError(f"unknown output_type {request.output_type}")
        target = self._target(request)
        pipeline = self.pipeline
        batch = pipeline.decode(codec.decode_batch, request.sparse, None, target.layout, target.spec)
        check_deadline(context)
        pooled = await pipeline.run(target.lookups, batch, target.max_batch_size)
        # LookupResponse bytes, written once (server.wire)
        return pipeline.encode(target._encode_lookup, pooled, request.output_type)  # type: ignore[no-any-return]

    def _encode_lookup(self, pooled: torch.Tensor, output_type: int) -> bytes:
        head = pb.LookupResponse(
            batch_size=pooled.shape[0],
            dim=pooled.shape[1],
            output_type=output_type,  # type: ignore[arg-type]
            columns=self._columns,
            model_version=self.version,
        ).SerializeToString()
        embeddings = pooled.to(torch.float16) if output_type == pb.OUTPUT_TYPE_FP16 else pooled
        return wire.with_bytes_fields(head, _EMBEDDINGS_FIELD, [wire.payload(embeddings)])

    async def _predict(self, request: pb.PredictRequest, context: grpc.aio.ServicerContext) -> pb.PredictResponse:
        self.pipeline.accept(request)
        target = self._target(request)
        if target.predictions is None:
            raise Failure(
                grpc.StatusCode.FAILED_PRECONDITION, "this model has no dense part; call Lookup", "no_dense_part"
            )
        pipeline = self.pipeline
        batch = pipeline.decode(codec.decode_batch, request.sparse, request.dense_features, target.layout, target.spec)
        check_deadline(context)
        scores = await pipeline.run(target.predictions, batch, target.max_batch_size)
        return pb.PredictResponse(
            batch_size=scores.shape[0],
            scores=scores.numpy().tobytes(),  # float32 [batch] (Runtime.scores)
            model_version=target.version,
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
