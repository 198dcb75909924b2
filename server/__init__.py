"""embserve's gRPC serving layer (see issue: gRPC serving); the library lives in ``infer``."""
