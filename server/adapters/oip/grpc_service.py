"""The Open Inference Protocol (KServe v2) on embserve's gRPC port: ``inference.GRPCInferenceService``.

A ``ModelInfer`` call's inputs are read from the message (``raw_input_contents`` in place, or typed contents)
and handed to the protocol's core (``server.adapters.oip.core``: decode and validate once, then the shared
pipeline's batchers); the answer is written once as ``raw_output_contents`` (what tritonclient's ``as_numpy``
reads). Gating, drain accounting and the status of every failure are the pipeline's (``server.pipeline``).
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import json_format

from infer.errors import RequestError
from server import wire
from server.adapters.oip import codec as oc
from server.adapters.oip.core import OpenInference
from server.pipeline import Pipeline, check_decodable, lenient
from server.proto import open_inference_grpc_pb2 as pb
from server.proto import open_inference_grpc_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
_RAW_OUTPUTS_FIELD = wire.field_number(pb.ModelInferResponse, "raw_output_contents")


# ---------------------------------------------------------------------------------------- gRPC
def grpc_inputs(request: pb.ModelInferRequest) -> list[oc.InputTensor]:
    """The request's inputs, from raw_input_contents (one entry per input) or from typed contents."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise RequestError(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
            "send every input raw (one entry each, in order) or every input as typed contents"
        )
    tensors = []
    for index, tensor in enumerate(request.inputs):
        if raw:
            tensors.append(oc.tensor_from_raw(tensor.name, tensor.datatype, tensor.shape, raw[index]))
            continue
        field = oc.CONTENTS_FIELD.get(tensor.datatype)
        if field is None:
            if tensor.datatype in oc.DATATYPES:
                raise RequestError(f"input {tensor.name!r}: {tensor.datatype} data travel raw (raw_input_contents)")
            raise oc.refused_datatype(tensor.name, tensor.datatype)
        values = getattr(tensor.contents, field)
        tensors.append(oc.tensor_from_values(tensor.name, tensor.datatype, tensor.shape, values))
    return tensors


def grpc_raw_inputs(request: pb.ModelInferRequest) -> list[oc.RawInput] | None:
    """(name, datatype, shape, bytes) of every input when all travel raw (tritonclient's way), else None."""
    raw = request.raw_input_contents
    if not raw or len(raw) != len(request.inputs):
        return None
    return [(tensor.name, tensor.datatype, tensor.shape, data) for tensor, data in zip(request.inputs, raw)]


def grpc_requested_outputs(request: pb.ModelInferRequest, fp16: bool) -> list[oc.RequestedOutput]:
    return [
        oc.RequestedOutput(o.name, fp16 or oc.parameter_flag(o.parameters, oc.FP16_PARAMETER)) for o in request.outputs
    ]


def _metadata_message(metadata: dict[str, Any]) -> pb.ModelMetadataResponse:
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=metadata["name"],
        versions=metadata["versions"],
        platform=metadata["platform"],
        inputs=[tensor(**t) for t in metadata["inputs"]],
        outputs=[tensor(**t) for t in metadata["outputs"]],
        properties=metadata["properties"],
    )


class OpenInferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService``: every call goes through the pipeline's error mapping, metrics and
    drain accounting."""

    def __init__(self, oip: OpenInference) -> None:
        self.oip = oip
        self._handle = oip.pipeline.call

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.oip.is_ready)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        async def work() -> pb.ModelReadyResponse:
            check_decodable(request)
            return pb.ModelReadyResponse(ready=self.oip.model_ready(request.name, request.version))

        return await self._handle("ModelReady", context, work())

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**self.oip.server_metadata())

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        async def work() -> pb.ModelMetadataResponse:
            check_decodable(request)
            return _metadata_message(self.oip.model_metadata(request.name, request.version))

        return await self._handle("ModelMetadata", context, work())

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        return await self._handle("ModelInfer", context, self._infer(request))

    async def _infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        self.oip.pipeline.accept(request)  # undecodable bytes, a call during warm-up or draining
        fp16 = oc.parameter_flag(request.parameters, oc.FP16_PARAMETER)
        result = await self.oip.infer(
            request.model_name,
            request.model_version,
            lambda: grpc_inputs(request),
            grpc_requested_outputs(request, fp16),
            fp16,
            lambda: grpc_raw_inputs(request),
        )
        response = pb.ModelInferResponse(
            model_name=result.model.name, model_version=result.model.version, id=request.id
        )
        for output in result.outputs:
            response.outputs.add(name=output.name, datatype=output.datatype, shape=output.shape)
        raw = [wire.payload(output.data) for output in result.outputs]
        # the raw contents written once, straight from the outputs (server.wire)
        return wire.with_bytes_fields(response.SerializeToString(), _RAW_OUTPUTS_FIELD, raw)  # type: ignore[return-value]

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
        async def work() -> pb.ModelConfigResponse:
            check_decodable(request)
            config = self.oip.model_config(request.name, request.version)
            return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfig()))

        return await self._handle("ModelConfig", context, work())

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any) -> pb.ModelStatisticsResponse:
        async def work() -> pb.ModelStatisticsResponse:
            check_decodable(request)
            statistics = self.oip.model_statistics(request.name, request.version)
            return json_format.ParseDict(statistics, pb.ModelStatisticsResponse())

        return await self._handle("ModelStatistics", context, work())

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> pb.RepositoryIndexResponse:
        async def work() -> pb.RepositoryIndexResponse:
            check_decodable(request)
            index = self.oip.repository_index(request.ready)
            return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m) for m in index])

        return await self._handle("RepositoryIndex", context, work())

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Any
    ) -> pb.RepositoryModelLoadResponse:
        async def work() -> pb.RepositoryModelLoadResponse:
            check_decodable(request)
            await self.oip.models.load(request.model_name)
            return pb.RepositoryModelLoadResponse()

        return await self._handle("RepositoryModelLoad", context, work())

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        async def work() -> pb.RepositoryModelUnloadResponse:
            check_decodable(request)
            await self.oip.models.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()

        return await self._handle("RepositoryModelUnload", context, work())


def add_to_server(
    pipeline: Pipeline, server: grpc.aio.Server, name: str, max_queue: int, repository: Any = None
) -> OpenInference:
    """Serve the pipeline's default model as ``name`` (or a repository's models) over the Open Inference
    Protocol, on the same gRPC server."""
    if repository is not None:
        oip = OpenInference(pipeline, repository, repository=repository)
    else:
        oip = OpenInference.for_pipeline(pipeline, name, max_queue)
    servicer = OpenInferenceServicer(oip)
    # lenient decoding, as embserve.v1: bytes that are no valid message are INVALID_ARGUMENT, not INTERNAL
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {
        method.name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=lenient(_MESSAGES[method.input_type.name]),
            response_serializer=wire.serialize,
        )
        for method in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    return oip


_MESSAGES: dict[str, Any] = {name: getattr(pb, name) for name in pb.DESCRIPTOR.message_types_by_name}
