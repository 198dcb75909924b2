"""The kernel attributes a loaded model must match, checked before its first lookup.

The list is data (``kernel_attributes.json``, embedded in the C++ loader too): every attribute an fbgemm TBE
kernel reads, and those of the module that cuts requests for it, each with its kind, dtype, a named length
rule and a named value rule derived from the manifest's kernel. Each rule is implemented here once (and once in
``cpp_loader/src/loader.cpp``); a flipped attribute is an ``ArtifactError(kind=MODEL)`` naming it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

import torch

from infer.config import DataType
from infer.errors import ArtifactError, ArtifactErrorKind

if TYPE_CHECKING:
    from infer.artifact.kernel_types import Kernel

LIST_FILE = "kernel_attributes.json"
# fbgemm's SparseType codes in a TBE's weights_tys, and its EmbeddingLocation per device kind.
WEIGHT_TYPE_CODES = {DataType.FP32: 0, DataType.FP16: 1, DataType.INT8: 2, DataType.INT4: 3, DataType.INT2: 4}
PLACEMENT_HOST, PLACEMENT_DEVICE = 3, 0
DTYPES = {"uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64}


@dataclass(frozen=True)
class KernelAttribute:
    """One entry of the list: the attribute's name, kind, tensor dtype, and the rules its length and value follow."""

    name: str
    kind: str  # tensor, int, bool, str, tensor_queue, counter
    dtype: str | None
    length: str | None
    value: str | None
    arg: Any

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelAttribute:
        get = data.get
        return cls(data["name"], data["kind"], get("dtype"), get("length"), get("value"), get("arg"))


@dataclass(frozen=True)
class KernelAttributes:
    tbe: tuple[KernelAttribute, ...]
    holder: tuple[KernelAttribute, ...]
    holder_present_if: str
    length_rules: tuple[str, ...]
    value_rules: tuple[str, ...]
    tbe_guarded_methods: tuple[str, ...]


@functools.cache
def kernel_attributes() -> KernelAttributes:
    """The list, read once from the package."""
    data = json.loads(resources.files("infer.artifact").joinpath(LIST_FILE).read_text(encoding="utf-8"))
    return KernelAttributes(
        tuple(KernelAttribute.from_dict(a) for a in data["tbe"]),
        tuple(KernelAttribute.from_dict(a) for a in data["holder"]["attributes"]),
        data["holder"]["present_if"],
        tuple(data["rules"]["length"]),
        tuple(data["rules"]["value"]),
        tuple(data["tbe_guarded_methods"]),
    )


def _per_feature(kernel: Kernel) -> list[Any]:
    return [kernel.tables[t] for t in kernel.feature_table_map]


def _weight_bytes(kernel: Kernel, on_cpu: bool) -> int:
    return kernel.table_offsets()[1] if (kernel.device == "cpu") == on_cpu else 0


def _dim_offsets(kernel: Kernel) -> list[int]:
    offsets = [0]
    for table in _per_feature(kernel):
        offsets.append(offsets[-1] + table.dim)
    return offsets


def _max_dim(kernel: Kernel, data_type: str) -> int:
    return max([t.dim for t in kernel.tables if t.data_type == DataType(data_type)], default=0)


Rule = Callable[["Kernel", Any], Any]

# The length rules: how many elements a tensor attribute holds (None: any shape with no element).
LENGTH_RULES: dict[str, Rule] = {
    "features": lambda kernel, _: len(kernel.feature_table_map),
    "features+1": lambda kernel, _: len(kernel.feature_table_map) + 1,
    "host_weight_bytes": lambda kernel, _: _weight_bytes(kernel, on_cpu=True),
    "device_weight_bytes": lambda kernel, _: _weight_bytes(kernel, on_cpu=False),
    "one": lambda kernel, _: 1,
    "empty": lambda kernel, _: None,
}

# The value rules: the expected value (a list for a tensor, one value otherwise), or a predicate on the found one.
VALUE_RULES: dict[str, Rule] = {
    "type_codes": lambda kernel, _: [WEIGHT_TYPE_CODES[t.data_type] for t in _per_feature(kernel)],
    "rows": lambda kernel, _: [t.rows for t in _per_feature(kernel)],
    "dim_offsets": lambda kernel, _: _dim_offsets(kernel),
    "table_offsets": lambda kernel, _: [kernel.table_offsets()[0][t] for t in kernel.feature_table_map],
    "placement": lambda kernel, _: (
        [PLACEMENT_HOST if kernel.device == "cpu" else PLACEMENT_DEVICE] * len(kernel.feature_table_map)
    ),
    "zeros": lambda kernel, _: OneOf((0,)),
    "host_weight_bytes": lambda kernel, _: _weight_bytes(kernel, on_cpu=True),
    "row_alignment": lambda kernel, _: kernel.row_alignment,
    "total_dim": lambda kernel, _: _dim_offsets(kernel)[-1],
    "max_dim": _max_dim,
    "feature_count": lambda kernel, _: len(kernel.feature_table_map),
    "device": lambda kernel, _: kernel.device,
    "constant": lambda kernel, arg: arg,
    "one_of": lambda kernel, arg: OneOf(tuple(arg)),
    "positive": lambda kernel, _: Positive(),
    "empty": lambda kernel, _: None,
}


@dataclass(frozen=True)
class OneOf:
    values: tuple[Any, ...]

    def accepts(self, found: Any) -> bool:
        return found in self.values

    def __str__(self) -> str:
        return f"one of {list(self.values)}"


@dataclass(frozen=True)
class Positive:
    def accepts(self, found: Any) -> bool:
        return found >= 1

    def __str__(self) -> str:
        return "at least 1"


def check_attributes(module: Any, attributes: tuple[KernelAttribute, ...], kernel: Kernel, where: str) -> None:
    """Raise ``ArtifactError(kind=MODEL)`` naming the first attribute of ``module`` that breaks its rules."""
    for attribute in attributes:
        if not hasattr(module, attribute.name):
            raise attribute_error(where, f"the kernel has no attribute '{attribute.name}'")
        found = getattr(module, attribute.name)
        _CHECKS[attribute.kind](found, attribute, kernel, where)


def attribute_error(where: str, what: str) -> ArtifactError:
    return ArtifactError(
        f"{where} does not match the manifest: {what}; the model file is corrupted, re-export it",
        kind=ArtifactErrorKind.MODEL,
    )


def _expect(found: Any, expected: Any, name: str, where: str) -> None:
    if isinstance(expected, (OneOf, Positive)):
        if not expected.accepts(found):
            raise attribute_error(where, f"{name} is {found!r} but must be {expected}")
    elif found != expected or type(found) is not type(expected):
        raise attribute_error(where, f"{name} is {found!r} but the manifest's kernel implies {expected!r}")


def _check_tensor(found: Any, attribute: KernelAttribute, kernel: Kernel, where: str) -> None:
    name = attribute.name
    dtype = DTYPES[attribute.dtype or ""]
    if not isinstance(found, torch.Tensor):
        raise attribute_error(where, f"{name} is not a tensor ({type(found).__name__})")
    if found.dtype != dtype:
        raise attribute_error(where, f"{name} has dtype {found.dtype}, expected {dtype}")
    length = LENGTH_RULES[attribute.length or ""](kernel, attribute.arg)
    if length is None:
        if found.numel() != 0:
            raise attribute_error(where, f"{name} must be empty, it has shape {list(found.shape)}")
        return
    if found.dim() != 1 or found.numel() != length:
        raise attribute_error(where, f"{name} has shape {list(found.shape)}, expected [{length}]")
    if attribute.value is None:
        return
    expected = VALUE_RULES[attribute.value](kernel, attribute.arg)
    for position, got in enumerate(found.tolist()):
        if isinstance(expected, OneOf):
            if not expected.accepts(got):
                raise attribute_error(where, f"{name}[{position}] is {got} but must be {expected}")
        elif got != expected[position]:
            raise attribute_error(
                where, f"{name}[{position}] is {got} but the manifest's kernel implies {expected[position]}"
            )


def _check_scalar(python_type: type) -> Callable[[Any, KernelAttribute, Kernel, str], None]:
    def check(found: Any, attribute: KernelAttribute, kernel: Kernel, where: str) -> None:
        if type(found) is not python_type:
            raise attribute_error(where, f"{attribute.name} is not {python_type.__name__} ({type(found).__name__})")
        _expect(found, VALUE_RULES[attribute.value or ""](kernel, attribute.arg), attribute.name, where)

    return check


def _check_tensor_queue(found: Any, attribute: KernelAttribute, kernel: Kernel, where: str) -> None:
    """fbgemm's TensorQueue: pop() of an empty queue is its initial tensor, which the kernel reads."""
    try:
        size, initial = int(found.size()), found.top()
    except (AttributeError, RuntimeError):
        raise attribute_error(where, f"{attribute.name} is not fbgemm's TensorQueue") from None
    if size != 0 or not isinstance(initial, torch.Tensor) or initial.numel() != 0:
        raise attribute_error(where, f"{attribute.name} must be an empty queue of empty tensors (no cache)")


def _check_counter(found: Any, attribute: KernelAttribute, kernel: Kernel, where: str) -> None:
    try:
        value = int(found.get())
    except (AttributeError, RuntimeError):
        raise attribute_error(where, f"{attribute.name} is not fbgemm's AtomicCounter") from None
    _expect(value, VALUE_RULES[attribute.value or ""](kernel, attribute.arg), attribute.name, where)


_CHECKS: dict[str, Callable[[Any, KernelAttribute, Kernel, str], None]] = {
    "tensor": _check_tensor,
    "int": _check_scalar(int),
    "bool": _check_scalar(bool),
    "str": _check_scalar(str),
    "tensor_queue": _check_tensor_queue,
    "counter": _check_counter,
}
