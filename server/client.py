"""Python client: ``EmbserveClient(addr).lookup({"f0": [[1, 2], [3]], ...})`` -> tensor.

Requests go in the packed form (little-endian arrays), the fast path of the protocol.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import torch

from infer.features import SparseFeatures
from server import codec
from server.proto import inference_pb2 as pb
from server.proto import inference_pb2_grpc as pb_grpc


class EmbserveClient:
    """A blocking client of one server. Thread-safe (one channel); use as a context manager to close it."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        root_certificates: bytes | None = None,
        timeout: float | None = 30.0,
        max_message_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if root_certificates is not None:
            self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates), options)
        else:
            self._channel = grpc.insecure_channel(address, options)
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.timeout = timeout

    def __enter__(self) -> EmbserveClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Any, request: Any) -> Any:
        return method(request, timeout=self.timeout, metadata=self._metadata)

    @staticmethod
    def _features(
        features: SparseFeatures | Mapping[str, Any], weights: Mapping[str, Sequence[Sequence[float]]] | None
    ) -> SparseFeatures:
        if isinstance(features, SparseFeatures):
            return features
        return SparseFeatures.from_dict(features, weights)

    def lookup(
        self,
        features: SparseFeatures | Mapping[str, Any],
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
        fp16: bool = False,
    ) -> torch.Tensor:
        """Pooled embeddings ``[batch, output_dim]`` (float32; fp16 on the wire when ``fp16``)."""
        request = pb.LookupRequest(
            sparse=codec.encode_packed(self._features(features, weights)),
            output_type=pb.OUTPUT_TYPE_FP16 if fp16 else pb.OUTPUT_TYPE_FP32,
        )
        return codec.decode_embeddings(self._call(self._stub.Lookup, request))

    def predict(
        self,
        features: SparseFeatures | Mapping[str, Any],
        dense_features: torch.Tensor,
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
    ) -> torch.Tensor:
        """Scores ``[batch]`` of the model's dense part."""
        request = pb.PredictRequest(
            sparse=codec.encode_packed(self._features(features, weights)),
            dense_features=dense_features.to(torch.float32).contiguous().numpy().tobytes(),
        )
        response = self._call(self._stub.Predict, request)
        return torch.frombuffer(bytearray(response.scores), dtype=torch.float32).clone()

    def metadata(self) -> pb.ModelMetadata:
        return self._call(self._stub.GetModelMetadata, pb.GetModelMetadataRequest())
