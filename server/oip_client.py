"""The Open Inference Protocol side of ``EmbserveClient(protocol="oip")``: embserve batches as OIP tensors.

No tritonclient needed: requests are built with embserve's own OIP stubs, per feature ``<f>__values``
(INT32 when the ids fit, else INT64), ``<f>__lengths`` and ``<f>__weights``, all raw.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from infer.config import ModelSpec, TableConfig
from infer.errors import RequestError
from infer.features import SparseFeatures
from server.adapters.oip import codec as oc
from server.proto import open_inference_grpc_pb2 as pb
from server.proto import open_inference_grpc_pb2_grpc as pb_grpc

_INT32_MAX = 2**31 - 1


def infer_request(
    model: str,
    version: str,
    features: SparseFeatures,
    dense: torch.Tensor | None = None,
    outputs: tuple[str, ...] = (oc.EMBEDDINGS,),
    fp16: bool = False,
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    batch = features.batch_size
    values = features.values
    if values.numel() and values.dtype == torch.int64 and int(values.abs().max()) <= _INT32_MAX:
        values = values.to(torch.int32)  # half the bytes; the contract takes either
    datatype = oc.DATATYPE_OF[values.dtype]
    position = 0
    for index, key in enumerate(features.keys):
        lengths = features.lengths[index * batch : (index + 1) * batch].to(torch.int32)
        count = int(lengths.to(torch.int64).sum())
        parts = [(f"{key}__values", datatype, values[position : position + count])]
        parts.append((f"{key}__lengths", "INT32", lengths))
        if features.weights is not None:
            parts.append((f"{key}__weights", "FP32", features.weights[position : position + count]))
        for name, tensor_type, data in parts:
            request.inputs.add(name=name, datatype=tensor_type, shape=[data.numel()])
            request.raw_input_contents.append(data.contiguous().numpy().tobytes())
        position += count
    if dense is not None:
        dense = dense.to(torch.float32).contiguous()
        request.inputs.add(name=oc.DENSE, datatype="FP32", shape=list(dense.shape))
        request.raw_input_contents.append(dense.numpy().tobytes())
    for name in outputs:
        output = request.outputs.add(name=name)
        if fp16 and name == oc.EMBEDDINGS:
            output.parameters[oc.FP16_PARAMETER].bool_param = True
    return request


def output(response: pb.ModelInferResponse, name: str) -> torch.Tensor:
    """One output of a response as a float32 tensor of its shape."""
    for index, tensor in enumerate(response.outputs):
        if tensor.name == name:
            dtype = oc.DATATYPES[tensor.datatype]
            raw = response.raw_output_contents[index]
            flat = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
            return flat.view(list(tensor.shape)).to(torch.float32)
    raise RequestError(f"the response carries no output {name!r}")


class OipCalls:
    """Lookup, predict and metadata of one model over ``inference.GRPCInferenceService``."""

    def __init__(self, channel: Any, model: str | None, version: str = "") -> None:
        if not model:
            raise RequestError("the Open Inference Protocol names its model: give model=... (--model)")
        self.stub = pb_grpc.GRPCInferenceServiceStub(channel)
        self.model = model
        self.version = version

    def lookup(self, call: Any, features: SparseFeatures, fp16: bool) -> torch.Tensor:
        request = infer_request(self.model, self.version, features, fp16=fp16)
        return output(call(self.stub.ModelInfer, request), oc.EMBEDDINGS)

    def predict(self, call: Any, features: SparseFeatures, dense: torch.Tensor) -> torch.Tensor:
        request = infer_request(self.model, self.version, features, dense, outputs=(oc.SCORES,))
        return output(call(self.stub.ModelInfer, request), oc.SCORES)

    def metadata(self, call: Any) -> pb.ModelMetadataResponse:
        return call(self.stub.ModelMetadata, pb.ModelMetadataRequest(name=self.model, version=self.version))


def spec_of(metadata: pb.ModelMetadataResponse) -> ModelSpec:
    """A spec with the served model's features (one table each, its rows and width): enough for random batches."""
    properties = metadata.properties
    columns = json.loads(properties["columns"])
    return ModelSpec(
        tuple(
            TableConfig(f"table_{feature}", int(properties[f"rows.{feature}"]), end - start, (feature,))
            for feature, (start, end) in columns.items()
        )
    )
