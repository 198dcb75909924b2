"""Our Open Inference Protocol descriptors equal the ones tritonclient ships, field by field.

tritonclient's ``service_pb2`` is Triton's ``grpc_service.proto``: a superset of the OIP service
(streaming, statistics, shared memory, ...). Every service method, message, nested message, field
number, type, label and oneof we declare must be the same there, so a Triton client and embserve
read each other's bytes. Our one addition is the specification's ``ModelMetadataResponse.properties``
(field 6), which Triton's copy does not declare (its clients skip it as an unknown field).
"""

from __future__ import annotations

from typing import Any

from tritonclient.grpc import service_pb2 as triton

from server.proto import open_inference_grpc_pb2 as ours

# Fields of the OIP specification that Triton's proto does not declare.
SPEC_ONLY_FIELDS = {"inference.ModelMetadataResponse.properties"}


def _field_facts(field: Any) -> tuple[Any, ...]:
    message = field.message_type
    if message is not None and message.GetOptions().map_entry:
        # a map's entry type is named after the field; compare key and value types instead
        key, value = message.fields_by_name["key"], message.fields_by_name["value"]
        target = ("map", key.type, value.type, value.message_type.full_name if value.message_type else None)
    else:
        target = message.full_name if message is not None else None
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
    their_messages = _messages(triton.DESCRIPTOR)
    assert len(our_messages) == 26  # 21 top-level, 5 nested
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
        # every field Triton declares in the messages we share is declared by us too
        assert {f.name for f in theirs.fields} <= {f.name for f in message.fields}, name


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
