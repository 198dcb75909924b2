"""server/wire.py: a response written as its small fields plus raw bytes fields parses as the full message."""

from __future__ import annotations

import torch

from server import wire
from server.proto import inference_pb2 as pb
from server.proto import open_inference_grpc_pb2 as oip_pb


def test_a_lookup_response_with_its_embeddings_appended_parses_as_protobuf_builds_it():
    pooled = torch.arange(3 * 70, dtype=torch.float32).view(3, 70) / 7  # 840 bytes: a two-byte length varint
    head = pb.LookupResponse(batch_size=3, dim=70, model_version="v", columns=[pb.ColumnRange(feature="f", end=70)])
    written = wire.with_bytes_fields(
        head.SerializeToString(), wire.field_number(pb.LookupResponse, "embeddings"), [wire.payload(pooled)]
    )
    expected = pb.LookupResponse()
    expected.CopyFrom(head)
    expected.embeddings = pooled.numpy().tobytes()
    assert pb.LookupResponse.FromString(written) == expected


def test_repeated_raw_outputs_keep_their_order():
    first, second = torch.ones(2, 3), torch.tensor([0.5, 1.5], dtype=torch.float32)
    head = oip_pb.ModelInferResponse(model_name="m", id="7")
    number = wire.field_number(oip_pb.ModelInferResponse, "raw_output_contents")
    written = wire.with_bytes_fields(head.SerializeToString(), number, [wire.payload(first), wire.payload(second)])
    parsed = oip_pb.ModelInferResponse.FromString(written)
    assert list(parsed.raw_output_contents) == [first.numpy().tobytes(), second.numpy().tobytes()]
    assert parsed.model_name == "m" and parsed.id == "7"
    assert wire.serialize(written) is written and wire.serialize(head) == head.SerializeToString()
