"""Our Open Inference Protocol descriptors equal the ones tritonclient ships, field by field.

tritonclient's ``service_pb2`` is Triton's ``grpc_service.proto``: a superset of the OIP service
(streaming, statistics, shared memory, ...). Every service method, message, nested message, field
number, type, label and oneof we declare must be the same there, so a Triton client and embserve
read each other's bytes. Our one addition is the specification's ``ModelMetadataResponse.properties``
(field 6), which Triton's copy does not declare (its clients skip it as an unknown field).

The configuration and statistics messages come from Triton's ``model_config.proto`` and
``grpc_service.proto``; there we declare only the fields embserve fills (``PARTIAL``), each with
Triton's number and type, and the ``DataType`` enum with Triton's values.
"""

from __future__ import annotations

from typing import Any

from tritonclient.grpc import model_config_pb2 as triton_config
from tritonclient.grpc import service_pb2 as triton

from server.proto import open_inference_grpc_pb2 as ours

# Fields of the OIP specification that Triton's proto does not declare.
SPEC_ONLY_FIELDS = {"inference.ModelMetadataResponse.properties"}
# Triton's messages of which we declare the fields we fill, not all of them.
PARTIAL = {
    "inference.ModelConfig",
    "inference.ModelInput",
    "inference.ModelOutput",
    "inference.ModelDynamicBatching",
    "inference.ModelStatistics",
    "inference.InferStatistics",
}


def _field_facts(field: Any) -> tuple[Any, ...]:
    message = field.message_type
    if message is not None and message.GetOptions().map_entry:
        # a map's entry type is named after the field; compare key and value types instead
        key, value = message.fields_by_name["key"], message.fields_by_name["value"]
        target = ("map", key.type, value.type, value.message_type.full_name if value.message_type else None)
    elif message is not None:
        target = message.full_name
    else:
        target = field.enum_type.full_name if field.enum_type is not None else None
    oneof = field.containing_oneof.name if field.containing_oneof is not None else None
    repeated = field.label == field.LABEL_REPEATED if hasattr(field, "label") else field.is_repeated
    return (field.number, field.type, repeated, target, oneof)


def _messages(descriptor: Any) -> dict[str, Any]:
    found = {}
    pending = list(descriptor.message_types_by_name.values())
    while pending:
        message = pending.pop()
        if message.GetOptions().map_entry:
            continue
        found[message.full_name] = message
        pending.extend(message.nested_types)
    return found


def test_the_service_and_its_methods_match_tritonclient():
    our_service = ours.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    their_service = triton.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert our_service.full_name == their_service.full_name == "inference.GRPCInferenceService"
    assert [m.name for m in our_service.methods] == [
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
    ]
    for method in our_service.methods:
        theirs = their_service.methods_by_name[method.name]
        assert method.input_type.full_name == theirs.input_type.full_name, method.name
        assert method.output_type.full_name == theirs.output_type.full_name, method.name
        assert not method.client_streaming and not method.server_streaming
        assert not theirs.client_streaming and not theirs.server_streaming


def test_every_message_and_field_matches_tritonclient():
    our_messages = _messages(ours.DESCRIPTOR)
    their_messages = {**_messages(triton.DESCRIPTOR), **_messages(triton_config.DESCRIPTOR)}
    assert len(our_messages) == 39  # 34 top-level, 5 nested
    for name, message in our_messages.items():
        assert name in their_messages, f"tritonclient has no message {name}"
        theirs = their_messages[name]
        for field in message.fields:
            path = f"{name}.{field.name}"
            if path in SPEC_ONLY_FIELDS:
                assert field.name not in theirs.fields_by_name
                continue
            assert field.name in theirs.fields_by_name, f"tritonclient's {name} has no field {field.name}"
            assert _field_facts(field) == _field_facts(theirs.fields_by_name[field.name]), path
        # every field Triton declares in the messages we share is declared by us too (but in PARTIAL ones)
        if name not in PARTIAL:
            assert {f.name for f in theirs.fields} <= {f.name for f in message.fields}, name
        for oneof in message.oneofs:
            assert oneof.name in theirs.oneofs_by_name, f"{name}.{oneof.name}"


def test_the_data_type_enum_matches_tritonclient():
    ours_enum = ours.DESCRIPTOR.enum_types_by_name["DataType"]
    theirs = triton_config.DESCRIPTOR.enum_types_by_name["DataType"]
    assert ours_enum.full_name == theirs.full_name == "inference.DataType"
    assert [(v.name, v.number) for v in ours_enum.values] == [(v.name, v.number) for v in theirs.values]


def test_a_config_and_statistics_parse_as_tritonclient_messages():
    config = ours.ModelConfigResponse()
    config.config.name = "m"
    config.config.max_batch_size = 0
    config.config.input.add(name="f0__values", data_type=ours.TYPE_INT64, dims=[-1], optional=False)
    config.config.output.add(name="embeddings", data_type=ours.TYPE_FP32, dims=[-1, 8])
    config.config.dynamic_batching.max_queue_delay_microseconds = 1000
    config.config.parameters["output_dim"].string_value = "8"
    theirs = triton.ModelConfigResponse.FromString(config.SerializeToString())
    assert theirs.config.input[0].data_type == triton_config.TYPE_INT64
    assert list(theirs.config.output[0].dims) == [-1, 8]
    assert theirs.config.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert theirs.config.dynamic_batching.max_queue_delay_microseconds == 1000
    assert theirs.config.parameters["output_dim"].string_value == "8"
    stats = ours.ModelStatisticsResponse()
    entry = stats.model_stats.add(name="m", version="1", inference_count=5, execution_count=2)
    entry.inference_stats.success.count = 3
    entry.batch_stats.add(batch_size=4).compute_infer.ns = 99
    decoded = triton.ModelStatisticsResponse.FromString(stats.SerializeToString())
    assert decoded.model_stats[0].inference_stats.success.count == 3
    assert decoded.model_stats[0].batch_stats[0].compute_infer.ns == 99


def test_our_bytes_parse_as_tritonclient_messages_and_back():
    request = ours.ModelInferRequest(model_name="m", model_version="2", id="r1", raw_input_contents=[b"\x01\x02"])
    tensor = request.inputs.add(name="f0__values", datatype="INT64", shape=[3])
    tensor.contents.int64_contents.extend([1, 2, 3])
    tensor.parameters["p"].bool_param = True
    request.outputs.add(name="embeddings").parameters["output_fp16"].bool_param = True
    theirs = triton.ModelInferRequest.FromString(request.SerializeToString())
    assert theirs.inputs[0].contents.int64_contents == [1, 2, 3]
    assert theirs.outputs[0].parameters["output_fp16"].bool_param
    assert ours.ModelInferRequest.FromString(theirs.SerializeToString()) == request
    load = triton.RepositoryModelLoadRequest(model_name="m")
    assert ours.RepositoryModelLoadRequest.FromString(load.SerializeToString()).model_name == "m"
