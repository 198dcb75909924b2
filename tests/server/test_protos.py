"""The checked-in gRPC stubs equal a fresh generation from protos/ (so the .proto is the source of truth)."""

from __future__ import annotations

from pathlib import Path

from server import generate_protos

STUBS = [
    "inference_pb2.py",
    "inference_pb2.pyi",
    "inference_pb2_grpc.py",
    "open_inference_grpc_pb2.py",
    "open_inference_grpc_pb2.pyi",
    "open_inference_grpc_pb2_grpc.py",
]


def test_checked_in_stubs_match_a_fresh_generation(tmp_path):
    fresh = generate_protos.generate(tmp_path)
    assert sorted(p.name for p in fresh) == STUBS
    for path in fresh:
        checked_in = generate_protos.OUT / path.name
        assert checked_in.read_text() == path.read_text(), (
            f"{checked_in} is stale: run python -m server.generate_protos"
        )


def test_stubs_import_from_the_server_package():
    grpc_stub = Path(generate_protos.OUT / "inference_pb2_grpc.py").read_text()
    assert "from server.proto import inference_pb2" in grpc_stub
    oip_stub = Path(generate_protos.OUT / "open_inference_grpc_pb2_grpc.py").read_text()
    assert "from server.proto import open_inference_grpc_pb2" in oip_stub
    from server.proto import inference_pb2, inference_pb2_grpc, open_inference_grpc_pb2, open_inference_grpc_pb2_grpc

    assert inference_pb2.DESCRIPTOR.package == "embserve.v1"
    assert hasattr(inference_pb2_grpc, "InferenceServiceStub")
    assert open_inference_grpc_pb2.DESCRIPTOR.package == "inference"
    assert hasattr(open_inference_grpc_pb2_grpc, "GRPCInferenceServiceStub")
