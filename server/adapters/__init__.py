"""The protocol adapters, each its own room: embserve.v1 (``v1``), the Open Inference Protocol's core shared by
its gRPC and REST adapters (``oip.core``, ``oip.codec``), OIP gRPC (``oip.grpc_service``), OIP REST
(``oip.rest_server``). Each turns its protocol's bytes into calls on the shared pipeline (``server.pipeline``)
and the answer back into bytes; no adapter imports another (OIP gRPC and REST share the OIP core)."""
