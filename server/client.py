"""Python client: ``EmbserveClient(addr).lookup({"f0": [[1, 2], [3]], ...})`` -> tensor.

Requests go in the packed form (little-endian arrays), the fast path of the protocol. With
``protocol="oip"`` the same calls go over the Open Inference Protocol (``server.oip_client``).
A call the server refuses raises an ``EmbserveError``: ``RejectedRequestError`` (a ``RequestError``) for
INVALID_ARGUMENT, ``ServerError`` with its ``kind`` for any other status (``server_error``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import torch

from infer.errors import EmbserveError, RejectedRequestError, ServerError
from infer.features import SparseFeatures, check_tensor
from server.adapters.v1 import codec
from server.proto import inference_pb2 as pb
from server.proto import inference_pb2_grpc as pb_grpc


class RpcServerError(ServerError, grpc.RpcError):
    """A ``ServerError`` that is a ``grpc.RpcError`` too (``code()``, ``details()``), so code written
    against raw gRPC errors keeps working."""

    def __init__(self, server_message: str, code: grpc.StatusCode) -> None:
        super().__init__(server_message, code.name)
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self.server_message


class RpcRejectedRequestError(RejectedRequestError, grpc.RpcError):
    """A ``RejectedRequestError`` (INVALID_ARGUMENT) that is a ``grpc.RpcError`` too."""

    def __init__(self, server_message: str) -> None:
        super().__init__(server_message, grpc.StatusCode.INVALID_ARGUMENT.name)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self) -> str:
        return self.server_message


def server_error(err: grpc.RpcError) -> EmbserveError:
    """The ``EmbserveError`` of a failed call, keeping its gRPC status and the server's message."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    message = err.details() if callable(getattr(err, "details", None)) else None  # type: ignore[attr-defined]
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return RpcRejectedRequestError(message or str(err))
    return RpcServerError(message or str(err), code)


class EmbserveClient:
    """A blocking client of one server. Thread-safe (one channel); use as a context manager to close it."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        root_certificates: bytes | None = None,
        timeout: float | None = 30.0,
        max_message_bytes: int = 64 * 1024 * 1024,
        protocol: str = "v1",
        model: str | None = None,
        version: str = "",
    ) -> None:
        """``protocol``: "v1" (embserve.v1) or "oip" (Open Inference Protocol). ``model`` and ``version`` name
        a model of the server (OIP: required; v1: empty for the server's default model) and its version
        (empty: the newest loaded)."""
        if protocol not in ("v1", "oip"):
            raise ValueError(f"protocol {protocol!r}: use 'v1' or 'oip'")
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # a connection of its own (grpc shares one among channels to one address): several clients spread
            # over the server processes of an instance (`embserve serve --workers N`)
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if root_certificates is not None:
            self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates), options)
        else:
            self._channel = grpc.insecure_channel(address, options)
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.timeout = timeout
        self.protocol = protocol
        self.model = model or ""
        self.version = version
        self._oip = None
        if protocol == "oip":
            from server.oip_client import OipCalls

            self._oip = OipCalls(self._channel, model, version)

    def __enter__(self) -> EmbserveClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise server_error(err) from err

    @staticmethod
    def _features(
        features: SparseFeatures | Mapping[str, Any], weights: Mapping[str, Sequence[Sequence[float]]] | None
    ) -> SparseFeatures:
        return SparseFeatures.of(features, weights)

    def lookup(
        self,
        features: SparseFeatures | Mapping[str, Any],
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
        fp16: bool = False,
    ) -> torch.Tensor:
        """Pooled embeddings ``[batch, output_dim]`` (float32; fp16 on the wire when ``fp16``). ``features``: a
        mapping ``{feature: bags}`` (per-id ``weights`` beside it), a ``SparseFeatures`` or a TorchRec
        ``KeyedJaggedTensor`` (its weights are the per-id weights), as ``SparseFeatures.of`` takes them."""
        if self._oip is not None:
            return self._oip.lookup(self._call, self._features(features, weights), fp16)
        request = pb.LookupRequest(
            sparse=codec.encode_packed(self._features(features, weights)),
            output_type=pb.OUTPUT_TYPE_FP16 if fp16 else pb.OUTPUT_TYPE_FP32,
            model_name=self.model,
            model_version=self.version,
        )
        return codec.decode_embeddings(self._call(self._stub.Lookup, request))

    def predict(
        self,
        features: SparseFeatures | Mapping[str, Any],
        dense_features: torch.Tensor,
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
    ) -> torch.Tensor:
        """Scores ``[batch]`` of the model's dense part."""
        check_tensor("dense_features", dense_features)  # the call contract: float32, never a silent cast
        if self._oip is not None:
            return self._oip.predict(self._call, self._features(features, weights), dense_features)
        request = pb.PredictRequest(
            sparse=codec.encode_packed(self._features(features, weights)),
            dense_features=dense_features.to(torch.float32).contiguous().numpy().tobytes(),
            model_name=self.model,
            model_version=self.version,
        )
        response = self._call(self._stub.Predict, request)
        return torch.frombuffer(bytearray(response.scores), dtype=torch.float32).clone()

    def metadata(self) -> Any:
        """embserve.v1's ``ModelMetadata``; with ``protocol="oip"`` the protocol's ``ModelMetadataResponse``."""
        if self._oip is not None:
            return self._oip.metadata(self._call)
        request = pb.GetModelMetadataRequest(model_name=self.model, model_version=self.version)
        return self._call(self._stub.GetModelMetadata, request)
