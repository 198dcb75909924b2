"""Generated gRPC stubs (python -m server.generate_protos); do not edit."""
