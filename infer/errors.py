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

    MANIFEST = "manifest"  # manifest.json missing, not JSON, another format/version, malformed
    CHECKSUM = "checksum"  # a listed file is missing, has the wrong size or fails its sha256
    LIBRARY = "library"  # an operator library (fbgemm) is missing or cannot be loaded
    MODEL = "model"  # the model file cannot be loaded or does not fit this host


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

    INSUFFICIENT_MEMORY = "insufficient_memory"
    INVALID_CONSTRAINT = "invalid_constraint"
    INVALID_TOPOLOGY = "invalid_topology"
    INVALID_PLAN = "invalid_plan"


class PlanError(EmbserveError):
    """The planner cannot place the tables; ``kind`` says why."""

    def __init__(self, message: str, kind: PlanErrorKind) -> None:
        super().__init__(message)
        self.kind = kind
