"""The Open Inference Protocol: its core (``core``: the calls; ``codec``: the tensor contract), shared by its
gRPC (``grpc_service``) and REST (``rest_server``) adapters."""
