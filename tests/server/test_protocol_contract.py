"""The call contract (issue 24) over the wire: embserve.v1 (EmbserveClient, packed and typed forms), OIP gRPC
(tritonclient.grpc) and OIP REST (tritonclient.http, and plain JSON) against one real server on loopback.

Every documented dtype combination of values, lengths and weights (weights also left out) is compared with the
fp32 reference (``F.embedding_bag`` on the dequantized tables, the dense part applied to it); scores are float32
``[B]`` though the dense part returns ``[B, 1]``; every undocumented dtype is refused as INVALID_ARGUMENT / 400
naming the tensor, in the contract's words.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch

from infer.artifact.export import export
from infer.errors import RequestError
from infer.features import SparseFeatures
from infer.quant.quantize import quantize
from infer.weights import random_weights
from server.adapters.v1 import codec
from server.client import EmbserveClient
from server.proto import inference_pb2 as pb
from tests.server.native_support import SERVER_KINDS, start_kind
from tests.server.oip_support import (
    PROTOCOLS,
    client,
    make_input,
    requested,
    split_features,
    triton_inputs,
    triton_module,
)
from tests.server.support import CALL_TIMEOUT, Served
from tests.support.call_contract import (
    DOCUMENTED,
    REFUSED,
    Combo,
    Reference,
    Refused,
    assert_matches,
    batch_of,
    contract_spec,
    dense_of,
    refused_call,
)

MODEL = "contract"
# the protocol's name of each refused dtype (tritonclient sends the numpy array as it is)
OIP_DATATYPE = {
    torch.float32: "FP32",
    torch.float64: "FP64",
    torch.float16: "FP16",
    torch.int64: "INT64",
    torch.int16: "INT16",
    torch.uint8: "UINT8",
}


@pytest.fixture(scope="module", params=SERVER_KINDS)
def served(request, loop_thread, tmp_path_factory) -> Iterator[tuple[Served, Reference]]:
    """The contract's model on each server, gRPC and REST."""
    spec = contract_spec()
    model = quantize(spec, random_weights(spec, seed=2))
    path = export(model, tmp_path_factory.mktemp("contract-server") / MODEL)
    server = start_kind(request.param, loop_thread, path, http_port=0, max_delay_us=200)
    yield server, Reference(spec, model)
    server.close_channels()
    server.stop(grace=1.0)


def _address(server: Served, protocol: str) -> str:
    return server.address if protocol == "grpc" else f"127.0.0.1:{server.running.http_port}"


@pytest.mark.parametrize("combo", DOCUMENTED, ids=repr)
def test_embserve_v1_takes_every_documented_dtype(served, combo):
    server, reference = served
    batch = batch_of(reference.spec, combo)
    dense = dense_of()
    with EmbserveClient(server.address) as v1:
        assert_matches(v1.lookup(batch), reference.pooled(batch))
        assert_matches(v1.predict(batch, dense), reference.scores(batch, dense))
    stub = server.stub()
    typed = pb.PredictRequest(
        sparse=codec.encode_typed(batch), dense_features=dense.numpy().tobytes(), model_name=MODEL
    )
    response = stub.Predict(typed, timeout=CALL_TIMEOUT)
    assert response.batch_size == batch.batch_size
    assert_matches(torch.frombuffer(bytearray(response.scores), dtype=torch.float32), reference.scores(batch, dense))


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("combo", DOCUMENTED, ids=repr)
def test_oip_takes_every_documented_dtype(served, protocol, combo):
    server, reference = served
    batch = batch_of(reference.spec, combo)
    dense = dense_of()
    with client(protocol, _address(server, protocol)) as triton:
        both = triton.infer(
            MODEL, triton_inputs(protocol, batch, dense), outputs=requested(protocol, "embeddings", "scores")
        )
        scores_only = triton.infer(MODEL, triton_inputs(protocol, batch, dense), outputs=requested(protocol, "scores"))
    assert_matches(torch.from_numpy(both.as_numpy("embeddings")), reference.pooled(batch))
    for result in (both, scores_only):
        assert_matches(torch.from_numpy(result.as_numpy("scores")), reference.scores(batch, dense))


def _oip_inputs(protocol: str, spec, case: Refused) -> list:
    """A valid weighted request whose first feature's ``case.tensor`` (or dense_features) has ``case.dtype``."""
    dense = refused_call(spec, case)[0]
    batch = batch_of(spec, Combo(torch.int64, torch.int32, True))
    inputs = []
    for index, part in enumerate(split_features(batch)):
        for role, tensor in (("values", part.values), ("lengths", part.lengths), ("weights", part.weights)):
            name = f"{part.name}__{role}"
            if index == 0 and role == case.tensor:
                inputs.append(_raw_input(protocol, name, tensor.to(case.dtype)))
            else:
                inputs.append(make_input(protocol, name, tensor.numpy()))
    if case.tensor == "dense_features":
        inputs.append(_raw_input(protocol, "dense_features", dense))
    else:
        inputs.append(make_input(protocol, "dense_features", dense.numpy()))
    return inputs


def _raw_input(protocol: str, name: str, tensor: torch.Tensor):
    module = triton_module(protocol)
    array = tensor.numpy()
    item = module.InferInput(name, list(array.shape), OIP_DATATYPE[tensor.dtype])
    item.set_data_from_numpy(array, **({"binary_data": True} if protocol == "http" else {}))
    return item


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", REFUSED, ids=repr)
def test_oip_refuses_undocumented_dtypes_naming_the_tensor(served, protocol, case):
    from tritonclient.utils import InferenceServerException

    server, reference = served
    name = "dense_features" if case.tensor == "dense_features" else f"{reference.spec.feature_names[0]}__{case.tensor}"
    rule = case.fragment.rsplit(", got ", 1)[0]
    with client(protocol, _address(server, protocol)) as triton:
        with pytest.raises(InferenceServerException) as raised:
            triton.infer(MODEL, _oip_inputs(protocol, reference.spec, case))
    assert f"input '{name}': {rule}, got {OIP_DATATYPE[case.dtype]}" in str(raised.value)
    assert ("INVALID_ARGUMENT" if protocol == "grpc" else "400") in str(raised.value.status())


def _post_json(server: Served, body: dict) -> tuple[int, dict]:
    _address(server, "http")
    connection = http.client.HTTPConnection("127.0.0.1", server.running.http_port, timeout=CALL_TIMEOUT)
    try:
        connection.request("POST", f"/v2/models/{MODEL}/infer", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def _json_inputs(spec, values_data: list, values_datatype: str = "INT64") -> list[dict]:
    """One id per bag, batch 1, JSON data; the first feature's values as given."""
    inputs = []
    for index, feature in enumerate(spec.feature_names):
        data = values_data if index == 0 else [0]
        inputs.append({"name": f"{feature}__values", "datatype": values_datatype if index == 0 else "INT64",
                       "shape": [len(data)], "data": data})  # fmt: skip
        inputs.append({"name": f"{feature}__lengths", "datatype": "INT32", "shape": [1], "data": [len(data)]})
    return inputs


@pytest.mark.rest
@pytest.mark.parametrize(
    ("data", "datatype", "fragment"),
    [
        ([1.5], "INT64", "input 'f_sum__values': its data are not INT64 numbers (got float32)"),
        ([True], "INT64", "input 'f_sum__values': its data are not INT64 numbers (got bool)"),
        ([2**32 + 1], "INT32", "input 'f_sum__values': its data do not fit in INT32"),
    ],
    ids=["fraction", "boolean", "past_int32"],
)
def test_rest_json_numbers_are_never_reinterpreted(served, data, datatype, fragment):
    """1.5 was read as id 1, true as 1 and 2**32 + 1 as id 1: each a valid lookup of the wrong row."""
    server, reference = served
    status, body = _post_json(server, {"inputs": _json_inputs(reference.spec, data, datatype)})
    assert status == 400 and fragment in body.get("error", ""), body
    status, body = _post_json(server, {"inputs": _json_inputs(reference.spec, [1], datatype)})
    assert status == 200, body


def test_v1_packed_form_refuses_int64_lengths_past_int32():
    """The packed form carries int32 lengths: 2**32 + 1 used to wrap to 1, a plausible request."""
    values = torch.tensor([1, 2], dtype=torch.int64)
    lengths = torch.tensor([2**32 + 1, 1, 0], dtype=torch.int64)
    with pytest.raises(RequestError, match=r"lengths must be a 1-D int32 \(or int64\) tensor, got int64 values"):
        codec.encode_packed(SparseFeatures(("a", "b", "c"), values, lengths))


def test_v1_client_refuses_undocumented_dense_dtypes(served):
    server, reference = served
    batch = batch_of(reference.spec, DOCUMENTED[0])
    with EmbserveClient(server.address) as v1:
        for dtype in (torch.int64, torch.float64):
            with pytest.raises(RequestError, match=f"dense_features must be float32 .*, got {str(dtype)[6:]}"):
                v1.predict(batch, dense_of().to(dtype))


def test_v1_unknown_id_type_is_invalid_argument(served):
    server, reference = served
    request = pb.LookupRequest(sparse=codec.encode_packed(batch_of(reference.spec, DOCUMENTED[0])))
    request.sparse.packed.id_type = 7
    with pytest.raises(grpc.RpcError) as raised:
        server.stub().Lookup(request, timeout=CALL_TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown id_type 7" in raised.value.details()


def test_scores_have_one_value_per_example(served):
    """Shape [B] on both protocols (tritonclient keeps the shape the server sends)."""
    server, reference = served
    batch = batch_of(reference.spec, DOCUMENTED[1])
    for protocol in PROTOCOLS:
        with client(protocol, _address(server, protocol)) as triton:
            result = triton.infer(
                MODEL, triton_inputs(protocol, batch, dense_of()), outputs=requested(protocol, "scores")
            )
        assert result.as_numpy("scores").shape == (batch.batch_size,)
        assert result.as_numpy("scores").dtype == np.float32
