"""Python client: ``EmbserveClient(addr).lookup({"f0": [[1, 2], [3]], ...})`` -> tensor.

Requests go in the packed form (little-endian arrays), the fast path of the protocol. With
``protocol="oip"`` the same calls go over the Open Inference Protocol (``server.oip_client``).
A call the server refuses raises an ``EmbserveError``: ``RejectedRequestError`` (a ``RequestError``) for
INVALID_ARGUMENT, ``ServerError`` with its ``kind`` for any other status (``server_error``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import torch

from infer import request_rules as rules
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
        self._max_batch_size: int | None = None  # the served model's, once a call needed it (max_batch_size)
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

    @property
    def max_batch_size(self) -> int | None:
        """The most examples one call may carry, as the served model's metadata advertises it (embserve.v1
        ``ModelMetadata.max_batch_size``, OIP the ``max_batch_size`` property; ``embserve serve
        --max-batch-size``); None when the server does not say. Asked once, then kept."""
        if self._max_batch_size is None:
            metadata = self.metadata()
            if self._oip is None:
                advertised = int(metadata.max_batch_size)
            else:
                advertised = int(metadata.properties.get("max_batch_size", "0") or 0)
            self._max_batch_size = advertised if advertised > 0 else 0
        return self._max_batch_size or None

    def _advertised_limit(self) -> int | None:
        """``max_batch_size``, or None when the server does not answer it (the refusal at hand is raised then)."""
        try:
            return self.max_batch_size
        except EmbserveError:
            return None

    def lookup(
        self,
        features: SparseFeatures | Mapping[str, Any],
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
        fp16: bool = False,
    ) -> torch.Tensor:
        """Pooled embeddings ``[batch, output_dim]`` (float32; fp16 on the wire when ``fp16``). ``features``: a
        mapping ``{feature: bags}`` (per-id ``weights`` beside it), a ``SparseFeatures`` or a TorchRec
        ``KeyedJaggedTensor`` (its weights are the per-id weights), as ``SparseFeatures.of`` takes them.
        A batch over the server's ``max_batch_size`` goes as several calls, their answers joined in order."""
        return self._in_calls(self._features(features, weights), None, lambda part, _: self._lookup(part, fp16))

    def _lookup(self, features: SparseFeatures, fp16: bool) -> torch.Tensor:
        if self._oip is not None:
            return self._oip.lookup(self._call, features, fp16)
        request = pb.LookupRequest(
            sparse=codec.encode_packed(features),
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
        """Scores ``[batch]`` of the model's dense part (a batch over the server's ``max_batch_size`` goes as
        several calls, as in ``lookup``)."""
        check_tensor("dense_features", dense_features)  # the call contract: float32, never a silent cast
        return self._in_calls(self._features(features, weights), dense_features, self._predict)

    def _predict(self, features: SparseFeatures, dense_features: torch.Tensor | None) -> torch.Tensor:
        assert dense_features is not None
        if self._oip is not None:
            return self._oip.predict(self._call, features, dense_features)
        request = pb.PredictRequest(
            sparse=codec.encode_packed(features),
            dense_features=dense_features.to(torch.float32).contiguous().numpy().tobytes(),
            model_name=self.model,
            model_version=self.version,
        )
        response = self._call(self._stub.Predict, request)
        return torch.frombuffer(bytearray(response.scores), dtype=torch.float32).clone()

    def _in_calls(
        self,
        features: SparseFeatures,
        dense: torch.Tensor | None,
        call: Callable[[SparseFeatures, torch.Tensor | None], torch.Tensor],
    ) -> torch.Tensor:
        """``call`` on the whole batch, or on consecutive parts of at most the server's ``max_batch_size``
        examples, their answers concatenated. The limit is asked for only when a batch was refused and is then
        kept: a batch within it costs no extra call, and one over a known limit is split before it is sent. A
        refusal is taken for the size limit by ``request_rules.TOO_LARGE`` in the server's words."""
        known = self._max_batch_size or None
        if known is None or features.batch_size <= known:
            try:
                return call(features, dense)
            except RejectedRequestError as err:
                if known is not None or rules.TOO_LARGE not in err.server_message:
                    raise  # refused for what it holds, not for its size
                limit = self._advertised_limit()
                if limit is None or features.batch_size <= limit or features.examples(0, 0) is None:
                    raise
        limit = self.max_batch_size
        assert limit is not None
        answers = []
        for start in range(0, features.batch_size, limit):
            stop = min(start + limit, features.batch_size)
            part = features.examples(start, stop)
            if part is None:  # lengths that lay out no batch: the server names what is wrong
                return call(features, dense)
            try:
                answers.append(call(part, None if dense is None else dense[start:stop]))
            except RejectedRequestError as err:
                raise RpcRejectedRequestError(
                    f"{err.server_message} (in examples [{start}, {stop}) of the batch of {features.batch_size}, "
                    f"sent as one call of the server's max batch size {limit}: bags count from example {start})"
                ) from err
        return torch.cat(answers)

    def metadata(self) -> Any:
        """embserve.v1's ``ModelMetadata``; with ``protocol="oip"`` the protocol's ``ModelMetadataResponse``."""
        if self._oip is not None:
            return self._oip.metadata(self._call)
        request = pb.GetModelMetadataRequest(model_name=self.model, model_version=self.version)
        return self._call(self._stub.GetModelMetadata, request)
