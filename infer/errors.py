"""The one error family of embserve: every failure a user can cause is an ``EmbserveError``."""

from __future__ import annotations

import enum


class EmbserveError(Exception):
    """Base class of every error embserve raises on purpose."""


class ConfigError(EmbserveError, ValueError):
    """A table or model configuration is invalid (names the table and the fix)."""


class RequestError(EmbserveError, ValueError):
    """A lookup request is malformed (names the feature and the bad value)."""

    def __init__(self, message: str, feature: str | None = None) -> None:
        super().__init__(message)
        self.feature = feature


class ArtifactErrorKind(enum.Enum):
    """Why an artifact cannot be used; the C++ loader throws ``ManifestError``, ``ChecksumError``,
    ``LibraryError`` and ``ModelError`` for the same four."""

    # manifest.json missing, not JSON, another format/version, malformed: re-export with this embserve
    MANIFEST = "manifest"
    # a listed file is missing, has the wrong size or fails its sha256: copy the artifact again, or re-export
    CHECKSUM = "checksum"
    # an operator library (fbgemm) is missing or cannot be loaded: install the fbgemm-gpu(-cpu) the manifest names
    LIBRARY = "library"
    # the model file cannot be loaded or does not fit this host (devices, torch version, kernels that disagree
    # with the manifest): load with a device map, or re-export on this torch
    MODEL = "model"


class ArtifactError(EmbserveError):
    """An exported artifact is missing, corrupted, or incompatible (names the file); ``kind`` says which."""

    def __init__(
        self, message: str, path: str | None = None, kind: ArtifactErrorKind = ArtifactErrorKind.MANIFEST
    ) -> None:
        super().__init__(message)
        self.path = path
        self.kind = kind


class FileFormatError(EmbserveError, ValueError):
    """A request or response file (``cpp_io``, shared with ``embserve_run``) is malformed (names the file)."""


class WeightsError(EmbserveError, ValueError):
    """A weights checkpoint does not match the model spec (names the table and shapes)."""


class PlanErrorKind(enum.Enum):
    """Why the planner cannot place the tables."""

    # the tables exceed the devices (or the budget): more devices, smaller data types, or --mapped-capacity (CPU)
    INSUFFICIENT_MEMORY = "insufficient_memory"
    # a constraint names an unknown table or allows no option: fix the constraints file
    INVALID_CONSTRAINT = "invalid_constraint"
    # the devices are not there (a CUDA plan on a CPU host, replicas > hosts): re-plan for this host
    INVALID_TOPOLOGY = "invalid_topology"
    # a plan that does not fit the spec (tables, shards, sizes): re-plan with embserve plan
    INVALID_PLAN = "invalid_plan"


class PlanError(EmbserveError):
    """The planner cannot place the tables; ``kind`` says why."""

    def __init__(self, message: str, kind: PlanErrorKind) -> None:
        super().__init__(message)
        self.kind = kind


class ServerErrorKind(enum.Enum):
    """Why a server refused or failed a call: the gRPC status it answered (``RejectedRequestError`` is
    INVALID_ARGUMENT)."""

    NOT_FOUND = "NOT_FOUND"  # no such model or version: check the name (metadata lists them)
    UNAVAILABLE = "UNAVAILABLE"  # warming up, shutting down or unreachable: retry, or try another replica
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # the queue is full (or a message too big): back off and retry
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # the model cannot do this (no dense part, a failed load)
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # the call's timeout passed: raise it, or send smaller batches
    UNAUTHENTICATED = "UNAUTHENTICATED"  # missing or wrong bearer token
    PERMISSION_DENIED = "PERMISSION_DENIED"  # the server (or a proxy before it) forbids this call
    CANCELLED = "CANCELLED"  # the call was cancelled (by the caller, or a server stopping): retry
    UNIMPLEMENTED = "UNIMPLEMENTED"  # the server does not offer this call
    INTERNAL = "INTERNAL"  # the server failed; its log has the request id the message names
    UNKNOWN = "UNKNOWN"  # any other status


class ServerError(EmbserveError):
    """A server refused or failed a call; ``kind`` says why, ``status`` is the gRPC status name and
    ``server_message`` the server's own words."""

    def __init__(self, server_message: str, status: str) -> None:
        super().__init__(f"{status}: {server_message}")
        self.server_message = server_message
        self.status = status
        self.kind = ServerErrorKind.__members__.get(status, ServerErrorKind.UNKNOWN)


class RejectedRequestError(RequestError):
    """A server refused a request as malformed (INVALID_ARGUMENT): ``server_message`` names the feature
    or tensor; ``status`` is the gRPC status name."""

    def __init__(self, server_message: str, status: str = "INVALID_ARGUMENT") -> None:
        super().__init__(f"{status}: {server_message}")
        self.server_message = server_message
        self.status = status
