"""What one kernel (TBE) of an exported model holds, as the manifest records it: its tables, rows, dims, data
types, which table each feature reads and where its weight buffer lies (``infer.artifact.kernels`` derives and
checks them; ``infer.artifact.kernel_attributes`` checks a loaded TBE's tensors against them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infer.config import DataType
from infer.quant.rowwise import table_bytes
from infer.shard.builder import SharedStorage
from infer.storage.layout import WeightsFile


@dataclass(frozen=True)
class KernelTable:
    rows: int
    dim: int
    data_type: DataType


@dataclass(frozen=True)
class Kernel:
    """One TBE: the device rank it serves, its row alignment, its tables and which table each feature reads."""

    rank: int
    device: str
    row_alignment: int
    tables: tuple[KernelTable, ...]
    feature_table_map: tuple[int, ...]
    shared: SharedStorage | None = None  # its tables' places in the weight buffer all CPU kernels share
    # a mapped artifact's CPU kernel: the file its weight buffer lies in (``shared`` then says the buffer's size
    # and its tables' page-aligned places in it; infer.artifact.mapped)
    weights: WeightsFile | None = None

    def layout(self) -> tuple[int, tuple[KernelTable, ...], tuple[int, ...], SharedStorage | None, WeightsFile | None]:
        """What must agree between the manifest and the plan (the device name may be remapped)."""
        return self.row_alignment, self.tables, self.feature_table_map, self.shared, self.weights

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "rank": self.rank,
            "device": self.device,
            "row_alignment": self.row_alignment,
            "tables": [{"rows": t.rows, "dim": t.dim, "data_type": t.data_type.value} for t in self.tables],
            "feature_table_map": list(self.feature_table_map),
        }
        if self.weights is not None and self.shared is not None:
            data["weights"] = {
                "file": self.weights.file,
                "offset": self.weights.offset,
                "bytes": self.shared.total_bytes,
                "table_offsets": list(self.shared.table_offsets),
            }
        elif self.shared is not None:
            data["shared_storage"] = {
                "bytes": self.shared.total_bytes,
                "table_offsets": list(self.shared.table_offsets),
            }
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Kernel:
        tables = tuple(KernelTable(t["rows"], t["dim"], DataType(t["data_type"])) for t in data["tables"])
        shared = data.get("weights", data.get("shared_storage"))
        mapped = data.get("weights")
        return cls(
            data["rank"],
            data["device"],
            data["row_alignment"],
            tables,
            tuple(data["feature_table_map"]),
            SharedStorage(shared["bytes"], tuple(shared["table_offsets"])) if shared is not None else None,
            WeightsFile(mapped["file"], mapped["offset"]) if mapped is not None else None,
        )

    def table_offsets(self) -> tuple[list[int], int]:
        """Each table's first byte in the kernel's weight buffer, and the buffer's size."""
        if self.shared is not None:
            return list(self.shared.table_offsets), self.shared.total_bytes
        sizes = [table_bytes(t.rows, t.dim, t.data_type, self.row_alignment) for t in self.tables]
        return [sum(sizes[:i]) for i in range(len(sizes))], sum(sizes)
