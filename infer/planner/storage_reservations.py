"""Memory held back from the planner: a percentage of every device plus the dense part."""

from __future__ import annotations

from infer.config import ModelSpec
from infer.errors import PlanError, PlanErrorKind
from infer.planner import constants as C
from infer.planner.types import Topology
from infer.planner.utils import format_gb


def dense_part_bytes(spec: ModelSpec, batch_size: int = C.DEFAULT_BATCH_SIZE) -> int:
    """Bytes the dense part needs on every device: its parameters and buffers, and an activation headroom
    of the same size per 512 examples (the over-arch runs on the device that gathers the pooled outputs)."""
    arch = spec.dense_arch
    if arch is None:
        return 0
    params = sum(t.numel() * t.element_size() for t in list(arch.parameters()) + list(arch.buffers()))
    return params + params * max(1, batch_size // C.DEFAULT_BATCH_SIZE)


class HeuristicalStorageReservation:
    """Hold back ``percentage`` of every device's memory, then the dense part's bytes."""

    def __init__(self, percentage: float = C.DEFAULT_RESERVED_PERCENT, batch_size: int = C.DEFAULT_BATCH_SIZE):
        if not 0 <= percentage < 100:
            raise PlanError(f"reserved percentage {percentage} is not in [0, 100)", PlanErrorKind.INVALID_TOPOLOGY)
        self.percentage = percentage
        self.batch_size = batch_size

    def reserve(self, topology: Topology, spec: ModelSpec) -> Topology:
        dense = dense_part_bytes(spec, self.batch_size)
        caps = [int(m * (1 - self.percentage / 100)) - dense for m in topology.device_memory]
        short = [d for d, cap in enumerate(caps) if cap <= 0]
        if short:
            raise PlanError(
                f"devices {short} have no memory left after reserving {self.percentage}% and the dense part "
                f"({format_gb(dense)}); give them more memory or reserve less",
                PlanErrorKind.INSUFFICIENT_MEMORY,
            )
        return topology.with_device_memory(caps)
