"""Mapped weights: each CPU weight buffer of a model in a plain file of the artifact, mapped read-only at load.

Export lays every CPU kernel's tables out page-aligned in its file (``infer.storage.layout``), writes them from
the eager model's buffers, and saves the scripted model with empty ``weights_host`` tensors and the tables'
new offsets; the load maps each file once (``infer.storage.mapping``) and hands every kernel a view of its
buffer before the kernel checks run. Kernels that already share one buffer (CPU replicas, ``Kernel.shared``)
share one file. CUDA kernels keep their weights inside ``model.pt``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from infer.artifact.kernels import Kernel
from infer.errors import ArtifactError, ArtifactErrorKind
from infer.quant.rowwise import table_bytes
from infer.shard.builder import SharedStorage
from infer.storage.layout import WeightsFile, page_aligned_offsets, weights_file_name
from infer.storage.mapping import map_read_only, write_pieces

logger = logging.getLogger(__name__)

EMBEDDED = "embedded"
MAPPED = "mapped"
WEIGHTS_FORMATS = (EMBEDDED, MAPPED)


def check_weights_format(weights: str) -> str:
    if weights not in WEIGHTS_FORMATS:
        from infer.errors import ConfigError

        raise ConfigError(f"unknown weights format {weights!r}; choose one of {list(WEIGHTS_FORMATS)}")
    return weights


def _buffer_groups(kernels: Sequence[Kernel]) -> list[list[int]]:
    """The kernels (by index) of every distinct CPU weight buffer, in kernel order: all the kernels that share a
    buffer (``Kernel.shared`` of an embedded layout) are one group, every other CPU kernel its own."""
    shared = [i for i, k in enumerate(kernels) if k.device == "cpu" and k.shared is not None]
    groups: list[list[int]] = []
    for index, kernel in enumerate(kernels):
        if kernel.device != "cpu":
            continue
        if kernel.shared is None:
            groups.append([index])
        elif index == shared[0]:
            groups.append(shared)
    return groups


def _table_places(kernel: Kernel) -> list[tuple[int, int]]:
    """``(first byte in the kernel's embedded buffer, bytes)`` of each of its tables."""
    starts, _ = kernel.table_offsets()
    return [
        (start, table_bytes(t.rows, t.dim, t.data_type, kernel.row_alignment))
        for start, t in zip(starts, kernel.tables)
    ]


def place_weights(kernels: Sequence[Kernel], prefix: str = "") -> list[Kernel]:
    """``kernels`` (as an embedded artifact lays them out) with each CPU weight buffer in its own file,
    ``<prefix>weights-<n>.bin``, its distinct tables page-aligned in the order of their embedded places."""
    placed = list(kernels)
    for number, group in enumerate(_buffer_groups(kernels)):
        sizes: dict[int, int] = {}
        for index in group:
            sizes.update(_table_places(kernels[index]))
        old = sorted(sizes)
        new, total = page_aligned_offsets([sizes[start] for start in old])
        moved = dict(zip(old, new))
        for index in group:
            kernel = kernels[index]
            offsets = tuple(moved[start] for start, _ in _table_places(kernel))
            placed[index] = dataclasses.replace(
                kernel, shared=SharedStorage(total, offsets), weights=WeightsFile(weights_file_name(number, prefix))
            )
    return placed


def place_host_weights(kernels: Sequence[Kernel], host_of: Callable[[int], int], hosts: int) -> list[Kernel]:
    """``place_weights`` for a multi-host artifact: each host's kernels (``host_of(rank)``) in files of its own
    part, ``hosts/<h>/weights-<n>.bin``."""
    placed = list(kernels)
    for host in range(hosts):
        indices = [i for i, k in enumerate(kernels) if host_of(k.rank) == host]
        for index, kernel in zip(indices, place_weights([kernels[i] for i in indices], f"hosts/{host}/")):
            placed[index] = kernel
    return placed


def write_weight_files(
    folder: Path, tbes: Sequence[Any], embedded: Sequence[Kernel], placed: Sequence[Kernel]
) -> list[str]:
    """Write every mapped kernel's buffer from its eager TBE's ``weights_host`` (laid out as ``embedded``) to its
    file under ``folder``, at ``placed``'s offsets; returns the files' names in order."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for tbe, before, after in zip(tbes, embedded, placed):
        if after.weights is None or after.shared is None:
            continue
        source = tbe.weights_host.detach().reshape(-1)
        written = pieces.setdefault(after.weights.file, {})
        for (start, size), offset in zip(_table_places(before), after.shared.table_offsets):
            written.setdefault(after.weights.offset + offset, source[start : start + size])
    for name, by_offset in pieces.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write_pieces(path, sorted(by_offset.items()))
    return list(pieces)


def strip_weights(scripted_tbes: Sequence[Any], placed: Sequence[Kernel]) -> None:
    """Point every mapped kernel of a scripted model at its tables' places in its file and empty its
    ``weights_host`` (``host_size`` keeps the buffer's size), so ``model.pt`` keeps structure only."""
    for tbe, kernel in zip(scripted_tbes, placed):
        if kernel.weights is None or kernel.shared is None:
            continue
        offsets = list(kernel.shared.table_offsets)
        tbe.weights_physical_offsets = offsets
        tbe.weights_offsets = torch.tensor([offsets[t] for t in kernel.feature_table_map], dtype=torch.int64)
        tbe.host_size = kernel.shared.total_bytes
        tbe.weights_host = torch.empty(0, dtype=torch.uint8)


def mark_weights(scripted: Any, attached: bool) -> None:
    """Record on a scripted model whether its mapped kernels hold their weights (the model refuses to run
    until they do: a bare ``torch.jit.load`` of a mapped ``model.pt`` would read empty buffers)."""
    if hasattr(scripted, "weights_attached"):
        scripted.weights_attached = attached


def check_no_saved_weights(model_path: Path, tbes: Sequence[Any], kernels: Sequence[Kernel]) -> None:
    """A mapped kernel's weights come from its file alone: a ``model.pt`` that still carries some for it (edited,
    or written by another tool) is refused rather than silently overridden by the mapping (``ArtifactError`` of
    kind MODEL naming the file, the kernel and the weight file; the C++ loader says the same)."""
    for index, (tbe, kernel) in enumerate(zip(tbes, kernels)):
        saved = tbe.weights_host
        carried = saved.numel() * saved.element_size()
        if kernel.weights is not None and carried:
            raise ArtifactError(
                f"{model_path} carries {carried} bytes of weights for kernel {index}, but the manifest maps them "
                f"from {kernel.weights.file}; re-export the artifact (embserve export / infer.export)",
                path=str(model_path),
                kind=ArtifactErrorKind.MODEL,
            )


def map_kernel_weights(
    folder: Path, kernels: Sequence[Kernel], file_bytes: Mapping[str, int]
) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
    """Map every weight file the ``kernels`` name (each once, read-only, its size checked against ``file_bytes``
    first); returns each kernel's view of its buffer (None for a kernel without a weight file) and the mappings
    by file name."""
    mappings: dict[str, torch.Tensor] = {}
    views: list[torch.Tensor | None] = []
    for kernel in kernels:
        if kernel.weights is None or kernel.shared is None:
            views.append(None)
            continue
        name = kernel.weights.file
        if name not in mappings:
            if name not in file_bytes:
                raise ArtifactError(f"the manifest lists no file {name!r}", path=name, kind=ArtifactErrorKind.CHECKSUM)
            mappings[name] = map_read_only(folder / name, file_bytes[name])
        first = kernel.weights.offset
        views.append(mappings[name][first : first + kernel.shared.total_bytes])
    return views, mappings


def attach_weights(
    folder: Path, tbes: Sequence[Any], kernels: Sequence[Kernel], file_bytes: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """Map every weight file the ``kernels`` name (``map_kernel_weights``) and set each mapped kernel's
    ``weights_host`` to its buffer's view; returns the mappings by file name."""
    views, mappings = map_kernel_weights(folder, kernels, file_bytes)
    for tbe, view in zip(tbes, views):
        if view is not None:
            tbe.weights_host = view
    return mappings
