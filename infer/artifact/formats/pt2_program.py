"""The program ``model.pt2`` is compiled from: the model's lookups as plain tensor code ``torch.export`` can trace.

A TBE *module* does not export (its ``fbgemm::AtomicCounter`` script object has no fake class), so each
kernel becomes a ``KernelCall``: the TBE's buffers and sizes, passed straight to fbgemm's lookup operator
(it has a fake kernel). ``LookupProgram`` runs fbgemm's FATAL bounds check once over the whole request (every
id against its feature's table), routes the request to every kernel, puts the columns in input order and
divides MEAN features by their bag lengths, exactly as the scripted model does, so its output is
bit-identical.

Routing: a kernel reading every feature, or a run of consecutive features, gets the request's ids as they
are and its slice of the bag offsets (the kernel reads only its bags' ids: no copy). A kernel reading other
features, or one replica's slice of the batch, gets its ids gathered with a mask (a replica's other bags are
empty, and its rows of the output are taken from it). (A slice of the ids with a data-dependent start would copy less,
but AOTInductor in torch 2.13 drops the start of such a slice from the generated code.)

Weights: a mapped artifact's kernel (``Kernel.weights``) is compiled with a 64-byte stand-in for its weight
buffer (``dev_weights``) and the tables' places in its weight file (``weights_offsets``); the loaders hand the
program the mapped buffer as an AOTInductor user-managed constant (``weights_constant``), so ``model.pt2`` holds
no table bytes. A kernel without a weight file keeps its buffer as a constant inside the package.

Such a program cannot run on its stand-ins: its first step checks ``TABLES_ATTACHED`` (a constant compiled as
zeros; with the weights, the loaders hand it ones) and raises ``NOT_ATTACHED`` otherwise, so a package loaded
bare (``torch._inductor.aoti_load_package``, or C++ ``AOTIModelPackageLoader``) and called as torch documents
raises, naming embserve's loaders, instead of reading past a stand-in. The check is ``torch._assert_async``:
AOTInductor compiles it to a C++ ``throw`` of that message, which reaches the caller (Python: ``RuntimeError``);
a ``torch._check`` would lose the message (export words its runtime asserts itself).

The signature is fixed (the C++ loader's contract):
``forward(values int64[N], lengths int64[F*B], weights float32[N]) -> float32[B, output_dim]``; a request
without weights passes ones (a weight of 1.0 leaves every product exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from infer.artifact.kernels import Kernel
from infer.config import PoolingType
from infer.errors import ConfigError
from infer.modules.sharded import READ_BATCH_SLICE, READ_ROW_BLOCK

# fbgemm's BoundsCheckMode.FATAL and PoolingMode.SUM (the model's TBEs use both; MEAN is applied afterwards)
BOUNDS_CHECK_FATAL = 0
POOLING_SUM = 0


# A mapped kernel's weight buffer at compile time. Not empty and over 8 entries: Inductor drops an empty constant
# from the program and inlines a 1-D one of up to 8 entries as code (GraphLowering.can_inline_constant), and
# neither can be handed over at load.
STAND_IN_BYTES = 64
# The lookup program's metadata entry: per kernel (in the manifest's kernel order, comma-separated)
# ``<constant>=<bytes>``, the constant that takes the kernel's mapped weight buffer at load and the buffer's size
# the program was compiled for (a loader refuses a buffer of another size: the program's table places lie inside
# that many bytes). Absent when the package carries its tables itself (an embedded artifact's, or one exported
# before the package took its weights from the weight files). The C++ loader reads the same entry.
WEIGHT_CONSTANTS_KEY = "embserve.weight_constants"
# The lookup program's metadata entry of a model with tables in precision blocks: per block table (in table order,
# comma-separated) ``<table>=<sha256>`` of the id remap compiled into the program (``BlockSplitCall``), which both
# loaders compare with the manifest's ``block_remaps``. Absent when no table is held in blocks.
BLOCK_REMAPS_KEY = "embserve.block_remaps"
# The constant a program over mapped weights checks first: zeros in the package, ones from the loaders with the
# weights (``tables_attached``); over 8 entries for the reason above. A package without it (an embedded artifact's,
# or one exported before the check) runs without.
TABLES_ATTACHED = "tables_attached"
TABLES_ATTACHED_ENTRIES = 16
# What a program run without its weights raises. AOTInductor pastes it into a C++ string literal: no quotes,
# no backslashes.
NOT_ATTACHED = (
    "this model.pt2 belongs to an embserve artifact whose tables are in the artifact's weight files, not in "
    "model.pt2, and they were not handed over (a bare torch._inductor.aoti_load_package or AOTIModelPackageLoader "
    "would run the program on 64-byte stand-ins). Load the artifact folder with embserve: "
    "infer.load(folder, backend='pt2') in Python, embserve::Model::load with Backend::Pt2 in C++ (cpp_loader), "
    "or embserve serve --backend pt2 (an embserve older than the export that wrote it does not hand them over: "
    "update it)"
)


def tables_attached() -> Tensor:
    """The value the loaders hand ``TABLES_ATTACHED`` with the weights."""
    return torch.ones(TABLES_ATTACHED_ENTRIES, dtype=torch.int64)


def weights_constant(kernel: int) -> str:
    """The program constant (fully qualified name) of kernel ``kernel``'s weight buffer."""
    return f"kernels.{kernel}.dev_weights"


def weight_constants_entry(kernels: Sequence[Kernel]) -> str:
    """``WEIGHT_CONSTANTS_KEY``'s value for a program over ``kernels`` (each with a weight file)."""
    return ",".join(
        f"{weights_constant(k)}={kernel.shared.total_bytes if kernel.shared else 0}" for k, kernel in enumerate(kernels)
    )


def read_weight_constants(entry: str) -> list[tuple[str, int]]:
    """``(constant, bytes)`` per kernel from ``WEIGHT_CONSTANTS_KEY``'s value (``[]`` for an empty one);
    ``ValueError`` for a malformed one."""
    pairs = []
    for item in entry.split(",") if entry else []:
        name, _, size = item.rpartition("=")
        if not name or not size.isdigit():
            raise ValueError(f"malformed {WEIGHT_CONSTANTS_KEY} entry {item[:80]!r}")
        pairs.append((name, int(size)))
    return pairs


class KernelCall(nn.Module):
    """One TBE's lookup: its storage and metadata as buffers (the same tensors, not copies), passed to the
    operator as ``IntNBitTableBatchedEmbeddingBagsCodegen.forward`` passes them (its bounds check runs once
    for the whole request, in ``LookupProgram``).

    ``mapped``: the kernel as a mapped artifact places it (``Kernel.weights``): the weight buffer is then a small
    stand-in (``STAND_IN_BYTES``; the loaders hand over the mapped buffer, which the program passes to the operator
    by handle, never reading its size) and ``weights_offsets`` its tables' places in the weight file."""

    rows_per_table: Tensor

    def __init__(self, tbe: Any, mapped: Kernel | None = None) -> None:
        super().__init__()
        if tbe.index_remappings_array.numel() or tbe.index_remapping_hash_table.numel():
            raise ConfigError("the pt2 program has no index remapping (pruning); export without --pt2")
        on_host = int(tbe.host_size) > 0
        weights = tbe.weights_host if on_host else tbe.weights_dev
        offsets = tbe.weights_offsets
        self.takes_weights = False  # True: the loaders hand over the weight buffer (a mapped kernel)
        if mapped is not None and mapped.weights is not None and mapped.shared is not None:
            self.takes_weights = True
            weights = torch.zeros(STAND_IN_BYTES, dtype=torch.uint8, device=weights.device)
            places = mapped.shared.table_offsets
            offsets = torch.tensor([places[t] for t in mapped.feature_table_map], dtype=offsets.dtype)
        self.register_buffer("dev_weights", weights)
        self.register_buffer("uvm_weights", tbe.weights_uvm)
        self.register_buffer("weights_offsets", offsets.to(tbe.weights_offsets.device))
        for name in ("weights_placements", "weights_tys", "D_offsets", "rows_per_table"):
            self.register_buffer(name, getattr(tbe, name))
        self.register_buffer("lxu_cache_weights", tbe.lxu_cache_weights)
        self.register_buffer("lxu_cache_locations", torch.empty(0, dtype=torch.int32, device=tbe.rows_per_table.device))
        self.total_dim = int(tbe.total_D)
        self.max_dims = (
            int(tbe.max_int2_D),
            int(tbe.max_int4_D),
            int(tbe.max_int8_D),
            int(tbe.max_float16_D),
            int(tbe.max_float32_D),
        )
        self.output_dtype = int(tbe.output_dtype)
        self.row_alignment = int(tbe.row_alignment)
        self.fp8 = (int(tbe.max_float8_D), int(tbe.fp8_exponent_bits), int(tbe.fp8_exponent_bias))
        if int(tbe.pooling_mode) != POOLING_SUM or int(tbe.bounds_check_mode_int) != BOUNDS_CHECK_FATAL:
            raise ConfigError("embserve's TBEs pool with SUM and check bounds FATAL; this kernel does not")

    def forward(self, indices: Tensor, offsets: Tensor, weights: Tensor) -> Tensor:
        max_int2, max_int4, max_int8, max_fp16, max_fp32 = self.max_dims
        max_fp8, fp8_bits, fp8_bias = self.fp8
        return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            self.dev_weights,
            self.uvm_weights,
            self.weights_placements,
            self.weights_offsets,
            self.weights_tys,
            self.D_offsets,
            self.total_dim,
            max_int2,
            max_int4,
            max_int8,
            max_fp16,
            max_fp32,
            indices,
            offsets,
            POOLING_SUM,
            weights,
            self.output_dtype,
            self.lxu_cache_weights,
            self.lxu_cache_locations,
            self.row_alignment,
            max_fp8,
            fp8_bits,
            fp8_bias,
        )


class BlockSplitCall(nn.Module):
    """A collection's split of a request by precision block (``collection.split_by_block``, on the collection's own
    split tensors, ``BlockSplit``'s attributes: the id remaps as positions, the blocks' bounds) and the sum of the
    kernel's levels, as the scripted model splits and adds (bit for bit: the same operators, the levels added in
    the same order). The remaps are constants of the program; the package's metadata (``BLOCK_REMAPS_KEY``) names
    each one's sha256, which the loaders compare with the manifest's ``block_remaps``."""

    block_lookup: Tensor
    block_lookup_offsets: Tensor
    block_sizes: Tensor

    def __init__(self, collection: Any) -> None:
        super().__init__()
        for name in ("block_lookup", "block_lookup_offsets", "block_sizes"):
            self.register_buffer(name, getattr(collection, name))
        self.levels = int(collection.block_levels)
        self.width = int(collection.output_dim)
        self.fixed = bool(collection.block_fixed_sizes)
        self.num_bounds = len(collection.block_bounds)
        for f, bounds in enumerate(collection.block_bounds):
            self.register_buffer(f"block_bounds_{f}", bounds)

    def forward(self, values: Tensor, lengths: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The kernel input: ``(ids, offsets, weights)`` of every level's bags, the cold block's level first."""
        from infer.modules.collection import split_by_block

        bounds = None if self.fixed else [getattr(self, f"block_bounds_{f}") for f in range(self.num_bounds)]
        split_values, split_lengths, split_weights = split_by_block(
            values,
            lengths,
            weights,
            self.block_lookup,
            self.block_lookup_offsets,
            self.block_sizes,
            self.levels,
            bounds,
        )
        assert split_weights is not None  # weights in, weights out
        return split_values, _offsets(split_lengths), split_weights

    def add_levels(self, pooled: Tensor) -> Tensor:
        """``[B, output_dim]``: the levels' pooled columns added to level 0's in level order (a new tensor: the
        program's output is contiguous)."""
        width = self.width
        out = pooled[:, :width]
        for k in range(1, self.levels):
            out = out + pooled[:, k * width : (k + 1) * width]
        return out


def block_remaps_entry(collection: Any) -> str:
    """``BLOCK_REMAPS_KEY``'s value for a collection's block tables: ``<table>=<sha256>`` of each one's remap (as
    the manifest's ``block_remaps`` records it), comma-separated in table order."""
    from infer.artifact.manifest import remap_sha256
    from infer.modules.collection import stored_remaps

    remaps = stored_remaps(collection)
    return ",".join(f"{name}={remap_sha256(held[0])}" for name, held in zip(collection.block_table_names, remaps))


def read_block_remaps(entry: str) -> dict[str, str]:
    """``{table: sha256}`` from ``BLOCK_REMAPS_KEY``'s value; ``ValueError`` for a malformed one."""
    out = {}
    for item in entry.split(",") if entry else []:
        name, _, digest = item.rpartition("=")
        if not name or len(digest) != 64:
            raise ValueError(f"malformed {BLOCK_REMAPS_KEY} entry {item[:80]!r}")
        out[name] = digest
    return out


@dataclass(frozen=True)
class ColumnCopy:
    """Columns ``[local, local + width)`` of kernel ``kernel``'s output are the output's next ``width`` columns."""

    kernel: int
    local: int
    width: int
    replica: tuple[int, int] = (0, 1)  # (replica, replicas): the rows of the batch this copy serves


@dataclass(frozen=True)
class KernelRoute:
    """The input features a kernel reads whole, in its (ascending) order."""

    features: tuple[int, ...]
    replicas: tuple[tuple[int, int], ...]  # per feature (replica, replicas); (0, 1) for a whole feature

    @property
    def has_replicas(self) -> bool:
        return any(count > 1 for _, count in self.replicas)

    @property
    def is_run(self) -> bool:
        """Consecutive whole input features (every feature, for an unsharded model): its bags are a slice of
        the request's bags."""
        first = self.features[0]
        return not self.has_replicas and self.features == tuple(range(first, first + len(self.features)))


def _rows(replica: tuple[int, int], batch: Any) -> tuple[Any, Any]:
    """The examples ``[first, last)`` replica ``replica[0]`` of ``replica[1]`` serves (as the scripted model)."""
    index, count = replica
    return index * batch // count, (index + 1) * batch // count


def _offsets(lengths: Tensor) -> Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


class LookupProgram(nn.Module):
    """``forward(values, lengths, weights)`` of an exported model, built from its kernels and routing."""

    column_feature: Tensor
    mean_column: Tensor
    feature_rows: Tensor
    bounds_check_warning: Tensor

    def __init__(
        self,
        kernels: list[KernelCall],
        routes: list[KernelRoute],
        copies: list[ColumnCopy],
        feature_dims: list[int],
        mean_features: list[int],
        feature_rows: list[int],
        blocks: BlockSplitCall | None = None,
    ) -> None:
        """``feature_rows``: the rows of every input feature's table (what its ids are checked against).
        ``blocks``: the split of an unsharded model with tables in precision blocks (its one kernel reads every
        feature at every level)."""
        super().__init__()
        self.kernels = nn.ModuleList(kernels)
        self.blocks = blocks
        self.routes = routes
        self.copies = copies
        self.num_features = len(feature_dims)
        self.output_dim = sum(feature_dims)
        self.has_mean = bool(mean_features)
        column_feature = [f for f, dim in enumerate(feature_dims) for _ in range(dim)]
        device = kernels[0].rows_per_table.device
        self.register_buffer("feature_rows", torch.tensor(feature_rows, dtype=torch.int64, device=device))
        self.takes_weights = any(kernel.takes_weights for kernel in kernels)
        if self.takes_weights:
            attached = torch.zeros(TABLES_ATTACHED_ENTRIES, dtype=torch.int64, device=device)
            self.register_buffer(TABLES_ATTACHED, attached)
        self.register_buffer("bounds_check_warning", torch.zeros(1, dtype=torch.int64, device=device))
        self.register_buffer("column_feature", torch.tensor(column_feature, dtype=torch.int64, device=device))
        is_mean = [f in set(mean_features) for f in column_feature]
        self.register_buffer("mean_column", torch.tensor(is_mean, dtype=torch.bool, device=device))
        for k, route in enumerate(routes):
            mask = [f in set(route.features) for f in range(self.num_features)]
            self.register_buffer(f"reads_{k}", torch.tensor(mask, dtype=torch.bool, device=device))
            replica = dict(zip(route.features, route.replicas))
            index = [replica.get(f, (0, 1))[0] for f in range(self.num_features)]
            count = [replica.get(f, (0, 1))[1] for f in range(self.num_features)]
            self.register_buffer(f"replica_{k}", torch.tensor(index, dtype=torch.int64, device=device))
            self.register_buffer(f"replicas_{k}", torch.tensor(count, dtype=torch.int64, device=device))

    def forward(self, values: Tensor, lengths: Tensor, weights: Tensor) -> Tensor:
        if self.takes_weights:  # first: no kernel runs on the stand-ins
            torch._assert_async(getattr(self, TABLES_ATTACHED)[0] == 1, NOT_ATTACHED)
        num_features = self.num_features
        batch = lengths.shape[0] // num_features
        torch._check(lengths.shape[0] == num_features * batch)
        torch._check(weights.shape[0] == values.shape[0])
        bag_lengths = lengths.view(num_features, batch)
        offsets = _offsets(lengths)
        # the last line behind the loader's checks: raises on an id outside its feature's table (or < -1) and
        # on offsets that disagree with the ids, before any kernel reads a row
        torch.ops.fbgemm.bounds_check_indices(
            self.feature_rows, values, offsets, BOUNDS_CHECK_FATAL, self.bounds_check_warning, weights
        )
        pooled: list[Tensor] = []
        feature_of_id: Tensor | None = None
        position = values  # each id's bag within its feature (computed when a kernel needs it)
        for k, (kernel, route) in enumerate(zip(self.kernels, self.routes)):
            if self.blocks is not None:
                split_values, split_offsets, split_weights = self.blocks(values, lengths, weights)
                pooled.append(self.blocks.add_levels(kernel(split_values, split_offsets, split_weights)))
                continue
            if route.is_run:
                first, last = route.features[0], route.features[-1] + 1
                pooled.append(kernel(values, offsets[first * batch : last * batch + 1], weights))
                continue
            if feature_of_id is None:
                bag_of_id = torch.repeat_interleave(
                    torch.arange(num_features * batch, device=values.device), lengths, output_size=values.shape[0]
                )
                feature_of_id = bag_of_id // batch
                position = bag_of_id - feature_of_id * batch
            keep = getattr(self, f"reads_{k}")[feature_of_id]
            local_lengths = bag_lengths[list(route.features)]
            if route.has_replicas:
                replica, replicas = getattr(self, f"replica_{k}"), getattr(self, f"replicas_{k}")
                first_bag = replica * batch // replicas
                end_bag = (replica + 1) * batch // replicas
                keep = keep & (position >= first_bag[feature_of_id]) & (position < end_bag[feature_of_id])
                bags = torch.arange(batch, device=values.device)
                local = list(route.features)
                served = (bags >= first_bag[local].unsqueeze(1)) & (bags < end_bag[local].unsqueeze(1))
                local_lengths = torch.where(served, local_lengths, torch.zeros_like(local_lengths))
            pooled.append(kernel(values[keep], _offsets(local_lengths.reshape(-1)), weights[keep]))
        out = self._assemble(pooled, batch)
        if self.has_mean:
            counts = bag_lengths.to(out.dtype).clamp(min=1.0).t()[:, self.column_feature]
            out = out / torch.where(self.mean_column, counts, torch.ones_like(counts))
        return out

    def _assemble(self, pooled: list[Tensor], batch: Any) -> Tensor:
        """The output columns in input order from the kernels' outputs; a replicated table's rows from each
        replica in turn."""
        if len(self.copies) == 1 and self.copies[0].width == self.output_dim:
            return pooled[self.copies[0].kernel]
        blocks: list[Tensor] = []
        for copy in self.copies:
            piece = pooled[copy.kernel][:, copy.local : copy.local + copy.width]
            index, _ = copy.replica
            if index == 0:
                blocks.append(piece)
                continue
            first, last = _rows(copy.replica, batch)
            rows = torch.arange(batch, device=piece.device)
            served = ((rows >= first) & (rows < last)).unsqueeze(1)
            blocks[-1] = torch.where(served, piece, blocks[-1])
        return torch.cat(blocks, 1)


def lookup_program(model: Any, mapped: Sequence[Kernel] | None = None) -> LookupProgram:
    """The exportable lookup of an ``EmbserveModel`` (unsharded, or sharded table-wise, column-wise, replicated);
    ``ConfigError`` for routing the program cannot express, naming the table and the fix. ``mapped``: the
    model's kernels as a mapped artifact places them (in kernel order): each kernel with a weight file takes its
    weights from it at load (``KernelCall``)."""
    spec = model.spec
    embeddings = model.embeddings
    features = spec.features
    mean_features = [i for i, f in enumerate(features) if f.pooling == PoolingType.MEAN]
    holders = len(embeddings.shards) if hasattr(embeddings, "shards") else 1
    placed: Sequence[Kernel | None] = mapped if mapped is not None else [None] * holders
    dims = [f.embedding_dim for f in features]
    rows = [f.num_embeddings for f in features]
    if not hasattr(embeddings, "shards"):
        whole = KernelRoute(tuple(range(len(features))), ((0, 1),) * len(features))
        columns = [ColumnCopy(0, 0, spec.output_dim)]
        blocks = BlockSplitCall(embeddings) if getattr(embeddings, "has_blocks", False) else None
        only = KernelCall(embeddings.tbe, placed[0])
        return LookupProgram([only], [whole], columns, dims, mean_features, rows, blocks)
    kernels: list[KernelCall] = []
    routes: list[KernelRoute] = []
    pieces: list[tuple[int, tuple[int, int], int, int, int]] = []  # (out column, replica, kernel, local, width)
    for k, shard in enumerate(embeddings.shards):
        replicas: list[tuple[int, int]] = []
        for f, kind, lo, hi in zip(shard.lf_feature, shard.lf_kind, shard.lf_lo, shard.lf_hi):
            if kind == READ_ROW_BLOCK:
                raise ConfigError(
                    f"table {features[f].table!r} is sharded row-wise; the pt2 program supports table-wise, "
                    "column-wise and replicated shards. Plan it otherwise, or export without --pt2 (model.pt "
                    "serves every sharding)"
                )
            replicas.append((lo, hi) if kind == READ_BATCH_SLICE else (0, 1))
        if list(shard.lf_feature) != sorted(set(shard.lf_feature)):
            raise ConfigError(
                f"device {shard.device} of the plan holds two shards of one feature's table; the pt2 program reads "
                "each feature once per device. Plan the table's shards on different devices, or export without --pt2"
            )
        kernels.append(KernelCall(shard.tbe, placed[k]))
        routes.append(KernelRoute(tuple(shard.lf_feature), tuple(replicas)))
        pieces.extend(zip(shard.lf_out_col, replicas, [k] * len(shard.lf_dim), shard.lf_local_col, shard.lf_dim))
    copies: list[ColumnCopy] = []
    column = 0
    for out_col, replica, kernel, local, width in sorted(pieces):
        if replica[0] > 0:  # another replica of the block just placed
            copies.append(ColumnCopy(kernel, local, width, replica))
            continue
        if out_col != column:  # pragma: no cover - a plan's shards tile the output columns
            raise ConfigError(f"the plan leaves output columns {column}..{out_col} without a shard")
        last = copies[-1] if copies else None
        merges = replica == (0, 1) and last is not None and last.replica == (0, 1)
        if merges and last is not None and last.kernel == kernel and last.local + last.width == local:
            copies[-1] = ColumnCopy(kernel, last.local, last.width + width)
        else:
            copies.append(ColumnCopy(kernel, local, width, replica))
        column = out_col + width
    return LookupProgram(kernels, routes, copies, dims, mean_features, rows)
