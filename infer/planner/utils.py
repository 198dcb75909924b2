"""Byte helpers of the planner: binary units, reading sizes people write (``80GB``) and printing them."""

from __future__ import annotations

from infer.errors import PlanError, PlanErrorKind

GB = 1024**3
MB = 1024**2


def parse_bytes(value: str | int | float) -> int:
    """``"80GB"``, ``"512MiB"``, ``"1.5TB"`` or a number of bytes -> bytes (binary units)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise PlanError(f"memory size {value} is negative", PlanErrorKind.INVALID_TOPOLOGY)
        return int(value)
    text = str(value).strip().upper().replace(" ", "")
    units = {"TIB": 1024**4, "TB": 1024**4, "GIB": GB, "GB": GB, "MIB": MB, "MB": MB, "KIB": 1024, "KB": 1024}
    for unit, scale in units.items():
        if text.endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * scale)
            except ValueError:
                break
    try:
        return int(text.rstrip("B"))
    except ValueError:
        raise PlanError(
            f"cannot read memory size {value!r}; write e.g. 80GB, 512MB or a byte count", PlanErrorKind.INVALID_TOPOLOGY
        ) from None


def binary_unit(num_bytes: float) -> tuple[str, int]:
    """The largest binary unit ``num_bytes`` fills at least one of: ``("GiB", 1024**3)`` ... ``("B", 1)``."""
    for unit, scale in (("GiB", GB), ("MiB", MB), ("KiB", 1024)):
        if abs(num_bytes) >= scale:
            return unit, scale
    return "B", 1


def format_bytes(num_bytes: float) -> str:
    """``81.2 GiB``, ``512.0 MiB``, ``3.0 KiB`` or ``17 B``: binary units, named as such (1 MiB = 1024**2 bytes)."""
    unit, scale = binary_unit(num_bytes)
    return f"{num_bytes / scale:.1f} {unit}" if scale > 1 else f"{int(num_bytes)} B"


def format_gb(num_bytes: float) -> str:
    """``12.34 GiB``: the unit the planner's messages use for device and host memory."""
    return f"{num_bytes / GB:.2f} GiB"
