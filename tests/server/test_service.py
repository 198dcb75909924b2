"""Lookup / Predict / GetModelMetadata over the wire equal the in-process model; bad requests get their code."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infer.features import SparseFeatures
from server.adapters.v1 import codec
from server.app import SERVICE_NAME
from server.client import EmbserveClient
from server.proto import inference_pb2 as pb
from tests.conftest import mixed_spec, random_batch
from tests.server.native_support import SERVER_KINDS, start_kind
from tests.server.support import (
    CALL_TIMEOUT,
    NUM_DENSE,
    Served,
    local_config,
    lookup_request,
    manifest_json,
    rpc_error,
)

MAX_BATCH = 32
MAX_MESSAGE = 64 * 1024


@pytest.fixture(scope="module")
def dense_server(dense_server_of_each_kind) -> Any:
    """The dense model on each server: the Python one and embserve-server answer alike."""
    return dense_server_of_each_kind


@pytest.fixture(scope="module")
def client(dense_server) -> Iterator[EmbserveClient]:
    with EmbserveClient(dense_server.address, timeout=CALL_TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module", params=SERVER_KINDS)
def strict_server(request, loop_thread, dense_artifact) -> Iterator[Served]:
    """A server with a small max batch and a small message cap, for the bad-request tests (each kind)."""
    served = start_kind(
        request.param, loop_thread, dense_artifact, max_batch_size=MAX_BATCH, max_message_bytes=MAX_MESSAGE
    )
    yield served
    served.close_channels()
    served.stop(grace=1.0)


@pytest.fixture(scope="module", params=SERVER_KINDS)
def sparse_server(request, loop_thread, sparse_artifact) -> Iterator[Any]:
    """The model without a dense part on each server kind (shared: its tests only call it)."""
    served = start_kind(request.param, loop_thread, sparse_artifact)
    yield served
    served.close_channels()
    served.stop(grace=1.0)


# ------------------------------------------------------------------------------------------ results
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_packed_lookup_equals_the_model(client, dense_runtime, spec, weighted, id_dtype):
    batch = random_batch(spec, batch_size=12, weighted=weighted, seed=3, id_dtype=id_dtype)
    got = client.lookup(batch)
    assert got.dtype == torch.float32
    assert torch.equal(got, dense_runtime.lookup(batch))


@pytest.mark.parametrize(("seed", "id_dtype"), [(9, torch.int32), (10, torch.int64)], ids=["int32", "int64"])
def test_ids_that_fit_go_on_the_wire_as_int32(dense_server, dense_runtime, spec, seed, id_dtype):
    batch = random_batch(spec, batch_size=5, seed=seed, id_dtype=id_dtype)
    request = lookup_request(batch)
    assert request.sparse.packed.id_type == pb.ID_TYPE_INT32
    assert len(request.sparse.packed.ids) == 4 * batch.num_ids()
    response = dense_server.stub().Lookup(request, timeout=CALL_TIMEOUT)
    assert torch.equal(codec.decode_embeddings(response), dense_runtime.lookup(batch))


def test_lookup_from_a_dict_of_bags(client, dense_runtime, spec):
    bags = {name: [[1, 2, 3], [], [7]] for name in reversed(spec.feature_names)}
    weights = {name: [[0.5, 1.0, 2.0], [], [3.0]] for name in spec.feature_names}
    assert torch.equal(client.lookup(bags), dense_runtime.lookup(bags))
    expected = dense_runtime.lookup(SparseFeatures.from_dict(bags, weights))
    assert torch.equal(client.lookup(bags, weights=weights), expected)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_typed_lookup_equals_the_model(dense_server, dense_runtime, spec, weighted):
    batch = random_batch(spec, batch_size=9, weighted=weighted, seed=4)
    request = lookup_request(batch, typed=True)
    assert request.sparse.WhichOneof("form") == "typed"
    response = dense_server.stub().Lookup(request, timeout=CALL_TIMEOUT)
    assert (response.batch_size, response.dim) == (9, spec.output_dim)
    assert torch.equal(codec.decode_embeddings(response), dense_runtime.lookup(batch))


def test_typed_weights_with_a_feature_that_has_no_ids(dense_server, dense_runtime, spec):
    bags = {name: [[1, 2], [3]] for name in spec.feature_names}
    weights = {name: [[0.5, 2.0], [4.0]] for name in spec.feature_names}
    bags["f_int2"], weights["f_int2"] = [[], []], [[], []]  # weighted request, this feature empty
    batch = SparseFeatures.from_dict(bags, weights)
    response = dense_server.stub().Lookup(lookup_request(batch, typed=True), timeout=CALL_TIMEOUT)
    assert torch.equal(codec.decode_embeddings(response), dense_runtime.lookup(batch))


def _reversed_features(batch: SparseFeatures) -> SparseFeatures:
    """The same batch with its features listed (and laid out) in reverse order."""
    num_features, size = len(batch.keys), batch.batch_size
    per_feature = batch.lengths.to(torch.int64).view(num_features, size).sum(1).tolist()
    values = list(torch.split(batch.values, per_feature))
    lengths = list(batch.lengths.view(num_features, size))
    weights = list(torch.split(batch.weights, per_feature)) if batch.weights is not None else None
    return SparseFeatures(
        tuple(reversed(batch.keys)),
        torch.cat(values[::-1]),
        torch.cat(lengths[::-1]),
        torch.cat(weights[::-1]) if weights is not None else None,
    )


@pytest.mark.parametrize("typed", [False, True], ids=["packed", "typed"])
def test_features_in_any_order(dense_server, dense_runtime, spec, typed):
    batch = random_batch(spec, batch_size=6, weighted=True, seed=8)
    reordered = _reversed_features(batch)
    assert reordered.keys == tuple(reversed(spec.feature_names))
    assert reordered.to_dict()["f_int4"] == batch.to_dict()["f_int4"]
    response = dense_server.stub().Lookup(lookup_request(reordered, typed=typed), timeout=CALL_TIMEOUT)
    assert torch.equal(codec.decode_embeddings(response), dense_runtime.lookup(batch))


def test_fp16_output_is_the_fp32_result_cast(dense_server, client, dense_runtime, spec):
    batch = random_batch(spec, batch_size=7, weighted=True, seed=5)
    expected = dense_runtime.lookup(batch).to(torch.float16)
    response = dense_server.stub().Lookup(lookup_request(batch, fp16=True), timeout=CALL_TIMEOUT)
    assert response.output_type == pb.OUTPUT_TYPE_FP16
    assert len(response.embeddings) == 2 * 7 * spec.output_dim
    raw = torch.frombuffer(bytearray(response.embeddings), dtype=torch.float16).view(7, spec.output_dim)
    assert torch.equal(raw, expected)
    assert torch.equal(client.lookup(batch, fp16=True), expected.to(torch.float32))


def test_empty_batch(client, spec):
    empty = SparseFeatures(spec.feature_names, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32))
    assert client.lookup(empty).shape == (0, spec.output_dim)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_predict_equals_the_model(client, dense_runtime, spec, weighted):
    batch = random_batch(spec, batch_size=10, weighted=weighted, seed=6)
    dense = torch.randn(10, NUM_DENSE, generator=torch.Generator().manual_seed(1))
    got = client.predict(batch, dense)
    assert got.shape == (10,)
    assert torch.equal(got, dense_runtime.predict(batch, dense))


def test_predict_typed_form(dense_server, dense_runtime, spec):
    batch = random_batch(spec, batch_size=3, seed=2)
    dense = torch.randn(3, NUM_DENSE, generator=torch.Generator().manual_seed(2))
    request = pb.PredictRequest(sparse=codec.encode_typed(batch), dense_features=dense.numpy().tobytes())
    response = dense_server.stub().Predict(request, timeout=CALL_TIMEOUT)
    scores = torch.frombuffer(bytearray(response.scores), dtype=torch.float32)
    assert response.batch_size == 3
    assert torch.equal(scores, dense_runtime.predict(batch, dense))


def test_metadata_matches_the_manifest(client, dense_artifact):
    manifest = manifest_json(dense_artifact)
    meta = client.metadata()
    model_sha = hashlib.sha256((dense_artifact / "model.pt").read_bytes()).hexdigest()
    assert manifest["files"]["model.pt"]["sha256"] == model_sha
    assert meta.model_version == model_sha[:16]
    assert meta.format_version == manifest["format_version"]
    assert list(meta.feature_order) == manifest["input_schema"]["feature_order"]
    assert [(c.feature, c.start, c.end) for c in meta.columns] == [
        (f["name"], f["column_start"], f["column_end"]) for f in manifest["features"]
    ]
    assert [
        {
            "name": t.name,
            "num_embeddings": t.num_embeddings,
            "embedding_dim": t.embedding_dim,
            "feature_names": list(t.feature_names),
            "pooling": t.pooling,
            "data_type": t.data_type,
        }
        for t in meta.tables
    ] == manifest["tables"]
    assert {t.data_type for t in meta.tables} == {"int8", "int4", "int2", "fp16", "fp32"}
    assert meta.output_dim == manifest["output"]["shape"][1] == 196
    assert meta.has_dense is manifest["dense"]["present"] is True
    assert meta.num_dense_features == manifest["dense"]["num_dense_features"] == NUM_DENSE
    assert list(meta.devices) == manifest["devices"]
    assert meta.world_size == manifest["sharding"]["world_size"]
    assert meta.embserve_version == manifest["versions"]["embserve"]
    assert meta.max_batch_size == local_config().max_batch_size


def test_lookup_response_names_columns_and_version(dense_server, dense_artifact, spec):
    response = dense_server.stub().Lookup(lookup_request(random_batch(spec, 2)), timeout=CALL_TIMEOUT)
    manifest = manifest_json(dense_artifact)
    assert response.model_version == manifest["files"]["model.pt"]["sha256"][:16]
    assert [(c.feature, c.start, c.end) for c in response.columns] == [
        (f["name"], f["column_start"], f["column_end"]) for f in manifest["features"]
    ]


def test_metadata_of_a_model_without_dense_part(sparse_server):
    with EmbserveClient(sparse_server.address, timeout=CALL_TIMEOUT) as c:
        meta = c.metadata()
    assert not meta.has_dense
    assert meta.num_dense_features == 0


# ------------------------------------------------------------------------------------------ bad requests
BAGS = [[1, 2], [3], [], [4]]  # four examples; every id valid in every table (smallest has 200 rows)


def _base() -> SparseFeatures:
    return SparseFeatures.from_dict({name: BAGS for name in mixed_spec().feature_names})


def _packed(**changes: Any) -> Callable[[], tuple[str, Any]]:
    def build() -> tuple[str, Any]:
        request = lookup_request(_base())
        packed = request.sparse.packed
        # the edits below work on int64 ids; the client would send these small ids as int32
        packed.ids = torch.frombuffer(bytearray(packed.ids), dtype=torch.int32).to(torch.int64).numpy().tobytes()
        packed.id_type = pb.ID_TYPE_INT64
        for key, value in changes.items():
            current = getattr(packed, key)
            new = value(current) if callable(value) else value
            if key == "feature_order":  # a repeated field: replaced in place
                del packed.feature_order[:]
                packed.feature_order.extend(new)
            else:
                setattr(packed, key, new)
        return "Lookup", request

    return build


def _typed(edit: Callable[[Any], None]) -> Callable[[], tuple[str, Any]]:
    def build() -> tuple[str, Any]:
        request = lookup_request(_base(), typed=True)
        edit(request.sparse.typed.features)
        return "Lookup", request

    return build


def _int64(values: list[int]) -> bytes:
    return torch.tensor(values, dtype=torch.int64).numpy().tobytes()


def _int32(values: list[int]) -> bytes:
    return torch.tensor(values, dtype=torch.int32).numpy().tobytes()


def _ids_with(position: int, value: int) -> Callable[[bytes], bytes]:
    def edit(ids: bytes) -> bytes:
        values = torch.frombuffer(bytearray(ids), dtype=torch.int64).clone()
        values[position] = value
        return values.numpy().tobytes()

    return edit


def _lengths_with(position: int, value: int) -> Callable[[bytes], bytes]:
    def edit(lengths: bytes) -> bytes:
        values = torch.frombuffer(bytearray(lengths), dtype=torch.int32).clone()
        values[position] = value
        return values.numpy().tobytes()

    return edit


def _typed_extra_feature(features: Any) -> None:
    features["nope"].lengths.extend([0, 0, 0, 0])


def _typed_drop(name: str) -> Callable[[Any], None]:
    def edit(features: Any) -> None:
        del features[name]

    return edit


def _typed_set(name: str, field: str, index: int, value: int) -> Callable[[Any], None]:
    def edit(features: Any) -> None:
        getattr(features[name], field)[index] = value

    return edit


def _typed_extra_id(name: str) -> Callable[[Any], None]:
    def edit(features: Any) -> None:
        features[name].ids.append(5)

    return edit


def _typed_shifted_id(features: Any) -> None:
    # f_int4 gets one id too many, f_int2 one too few: the totals still agree
    features["f_int4"].ids.append(5)
    del features["f_int2"].ids[-1]


def _typed_some_weights(features: Any) -> None:
    features["f_int8"].weights.extend([1.0] * len(features["f_int8"].ids))


def _typed_uneven_batch(features: Any) -> None:
    features["f_fp32"].lengths.append(0)


def _too_big_batch() -> tuple[str, Any]:
    bags = {name: [[1]] * (MAX_BATCH + 1) for name in _base().keys}
    return "Lookup", lookup_request(SparseFeatures.from_dict(bags))


def _oversize() -> tuple[str, Any]:
    bags = {name: BAGS for name in _base().keys}
    bags["f_int8"] = [[1] * (MAX_MESSAGE // 4 + 100), [], [], []]  # valid, but more bytes than the cap (int32 ids)
    return "Lookup", lookup_request(SparseFeatures.from_dict(bags))


def _predict(dense_bytes: int) -> Callable[[], tuple[str, Any]]:
    def build() -> tuple[str, Any]:
        dense = torch.zeros(4 * NUM_DENSE).numpy().tobytes()[:dense_bytes]
        return "Predict", pb.PredictRequest(sparse=codec.encode_packed(_base()), dense_features=dense)

    return build


INVALID = grpc.StatusCode.INVALID_ARGUMENT
# the id of a feature's first id in the packed layout: features hold 4 ids each (BAGS)
F_INT4_FIRST_ID = 2 * 4
F_INT2_BAG1_LENGTH = 3 * 4 + 1
BAD_REQUESTS: dict[str, tuple[Callable[[], tuple[str, Any]], grpc.StatusCode, list[str]]] = {
    "packed unknown feature": (
        _packed(feature_order=lambda order: [*list(order)[:-1], "nope"]),
        INVALID,
        ["'nope'", "unknown feature"],
    ),
    "typed unknown feature": (_typed(_typed_extra_feature), INVALID, ["'nope'", "unknown feature"]),
    "typed missing feature": (_typed(_typed_drop("f_fp32")), INVALID, ["'f_fp32'", "missing"]),
    "packed id out of range": (
        _packed(ids=_ids_with(F_INT4_FIRST_ID, 500)),
        INVALID,
        ["'f_int4'", "500", "out of range"],
    ),
    "packed negative id": (_packed(ids=_ids_with(F_INT4_FIRST_ID, -3)), INVALID, ["'f_int4'", "-3"]),
    "typed id out of range": (_typed(_typed_set("f_int2", "ids", 1, 300)), INVALID, ["'f_int2'", "300"]),
    "typed negative id": (_typed(_typed_set("f_fp16", "ids", 0, -1)), INVALID, ["'f_fp16'", "-1"]),
    "packed negative length": (
        _packed(lengths=_lengths_with(F_INT2_BAG1_LENGTH, -1)),
        INVALID,
        ["'f_int2'", "negative length"],
    ),
    "typed negative length": (
        _typed(_typed_set("f_int8_b", "lengths", 2, -1)),
        INVALID,
        ["'f_int8_b'", "negative length"],
    ),
    "typed lengths/ids mismatch": (_typed(_typed_extra_id("f_int4")), INVALID, ["'f_int4'", "lengths sum"]),
    "typed mismatch that cancels out": (_typed(_typed_shifted_id), INVALID, ["'f_int", "lengths sum"]),
    "packed lengths/ids mismatch": (
        _packed(ids=lambda ids: ids + _int64([1])),
        INVALID,
        ["lengths sum to", "ids"],
    ),
    "typed weights on one feature only": (_typed(_typed_some_weights), INVALID, ["weights"]),
    "typed uneven batch sizes": (_typed(_typed_uneven_batch), INVALID, ["batch sizes"]),
    "packed ids not a multiple of 8 bytes": (
        _packed(ids=lambda ids: ids + b"\x00\x00\x00"),
        INVALID,
        ["packed.ids", "multiple of 8"],
    ),
    "packed int32 ids not a multiple of 4 bytes": (
        _packed(id_type=pb.ID_TYPE_INT32, ids=_int32([1, 2, 3] * 8) + b"\x00\x00"),
        INVALID,
        ["packed.ids", "multiple of 4"],
    ),
    "packed lengths not a multiple of 4 bytes": (
        _packed(lengths=lambda lengths: lengths + b"\x00"),
        INVALID,
        ["packed.lengths", "multiple of 4"],
    ),
    "packed weights not a multiple of 4 bytes": (
        _packed(weights=b"\x00" * 6),
        INVALID,
        ["packed.weights", "multiple of 4"],
    ),
    "packed weights count": (
        _packed(weights=torch.ones(23).numpy().tobytes()),
        INVALID,
        ["weights", "one weight per id"],
    ),
    "packed empty feature order": (_packed(feature_order=[]), INVALID, ["feature_order"]),
    "packed unknown id type": (_packed(id_type=7), INVALID, ["id_type"]),
    "no sparse features": (lambda: ("Lookup", pb.LookupRequest()), INVALID, ["no sparse features"]),
    "unknown output type": (
        lambda: ("Lookup", pb.LookupRequest(sparse=codec.encode_packed(_base()), output_type=9)),
        INVALID,
        ["output_type"],
    ),
    "batch above max_batch_size": (
        _too_big_batch,
        INVALID,
        [f"batch of {MAX_BATCH + 1} examples exceeds the server's max batch size {MAX_BATCH}", "--max-batch-size"],
    ),
    "predict dense floats count": (_predict(4 * (4 * NUM_DENSE - 1)), INVALID, ["dense_features"]),
    "predict dense bytes not a multiple of 4": (_predict(4 * 4 * NUM_DENSE - 2), INVALID, ["dense_features"]),
    "oversize message": (_oversize, grpc.StatusCode.RESOURCE_EXHAUSTED, []),
}


def _assert_still_serving(served: Served, runtime: Any, spec: Any) -> None:
    batch = random_batch(spec, batch_size=4, weighted=True, seed=21)
    response = served.stub().Lookup(lookup_request(batch), timeout=CALL_TIMEOUT)
    assert torch.equal(codec.decode_embeddings(response), runtime.lookup(batch))
    assert served.health() == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_its_code_and_the_server_keeps_serving(strict_server, dense_runtime, spec, case):
    build, code, fragments = BAD_REQUESTS[case]
    method, request = build()
    stub = strict_server.stub()
    error = rpc_error(lambda: getattr(stub, method)(request, timeout=CALL_TIMEOUT))
    assert error.code() == code, error.details()
    for fragment in fragments:
        assert fragment in error.details()
    _assert_still_serving(strict_server, dense_runtime, spec)


def test_the_base_request_of_the_bad_cases_is_good(strict_server, dense_runtime):
    for form in (False, True):
        response = strict_server.stub().Lookup(lookup_request(_base(), typed=form), timeout=CALL_TIMEOUT)
        assert torch.equal(codec.decode_embeddings(response), dense_runtime.lookup(_base()))


def test_predict_without_dense_part_is_failed_precondition(sparse_server, sparse_runtime, spec):
    batch = random_batch(spec, batch_size=2)
    with EmbserveClient(sparse_server.address, timeout=CALL_TIMEOUT) as c:
        error = rpc_error(lambda: c.predict(batch, torch.zeros(2, 1)))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "dense" in error.details()
        assert torch.equal(c.lookup(batch), sparse_runtime.lookup(batch))
    assert sparse_server.health() == health_pb2.HealthCheckResponse.SERVING


class _FailingModule:
    """The real model, failing on purpose once ``fail`` is set, with internals in its message."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.fail = False

    def __call__(self, *args: Any) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("secret detail: /srv/models/a.pt at 0xdeadbeef")
        return self.module(*args)

    def predict(self, *args: Any) -> torch.Tensor:
        return self.module.predict(*args)

    def lookup_unchecked(self, *args: Any) -> torch.Tensor:  # the server's entry
        if self.fail:
            raise RuntimeError("secret detail: /srv/models/a.pt at 0xdeadbeef")
        return self.module.lookup_unchecked(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


def test_an_unexpected_failure_is_internal_with_a_request_id_and_no_internals(
    start_server, sparse_artifact, sparse_runtime, spec, caplog
):
    from infer.artifact.runtime import Runtime

    failing = _FailingModule(sparse_runtime.module)
    served = start_server(Runtime(sparse_runtime.path, sparse_runtime.manifest, failing))  # type: ignore[arg-type]
    failing.fail = True
    batch = random_batch(spec, batch_size=2)
    with caplog.at_level("ERROR", logger="server.pipeline"):
        with EmbserveClient(served.address, timeout=CALL_TIMEOUT) as c:
            error = rpc_error(lambda: c.lookup(batch))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "internal error (request id " in error.details()
    assert "secret" not in error.details() and "RuntimeError" not in error.details()
    request_id = error.details().split("request id ")[1].split(")")[0]
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback went to the log, under that id
    failing.fail = False
    with EmbserveClient(served.address, timeout=CALL_TIMEOUT) as c:
        assert torch.equal(c.lookup(batch), sparse_runtime.lookup(batch))


def test_health_answers_as_grpc_health_service(dense_server):
    """grpc.health.v1 on both servers (embserve-server serves it on its own completion queues, not through grpc's
    default service): the served names are SERVING, another name is NOT_FOUND to Check and SERVICE_UNKNOWN to
    Watch, and Watch opens with the status of now."""
    stub = health_pb2_grpc.HealthStub(dense_server.channel())
    for name in ("", SERVICE_NAME):
        assert dense_server.health(name) == health_pb2.HealthCheckResponse.SERVING
    error = rpc_error(
        lambda: stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=CALL_TIMEOUT)
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND
    for name, status in (("", "SERVING"), ("no.such.Service", "SERVICE_UNKNOWN")):
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=name), timeout=CALL_TIMEOUT)
        assert next(watch).status == health_pb2.HealthCheckResponse.ServingStatus.Value(status)
        watch.cancel()
    assert dense_server.health() == health_pb2.HealthCheckResponse.SERVING  # the cancelled watches left it serving
