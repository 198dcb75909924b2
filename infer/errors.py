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


class ArtifactError(EmbserveError):
    """An exported artifact is missing, corrupted, or incompatible (names the file)."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class WeightsError(EmbserveError, ValueError):
    """A weights checkpoint does not match the model spec (names the table and shapes)."""


class PlanErrorKind(enum.Enum):
    INSUFFICIENT_MEMORY = "insufficient_memory"
    INVALID_CONSTRAINT = "invalid_constraint"
    INVALID_TOPOLOGY = "invalid_topology"
    INVALID_PLAN = "invalid_plan"


class PlanError(EmbserveError):
    """The planner cannot place the tables; ``kind`` says why."""

    def __init__(self, message: str, kind: PlanErrorKind) -> None:
        super().__init__(message)
        self.kind = kind
