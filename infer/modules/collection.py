"""Scriptable modules of a served model: the TBE-backed embedding-bag collection and its wrapper.

Their ``forward`` takes plain tensors ``(values, lengths, weights)`` so TorchScript hosts (Python
or C++) call them without embserve. Every input is validated inside the module before the kernel
sees it; validation failures raise with ``REQUEST_ERROR_PREFIX`` and the wording of ``request_rules``.
"""

import copy
import dataclasses
from typing import Final, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from infer import request_rules as rules
from infer.config import DataType, ModelSpec, PoolingType, RowBlock
from infer.modules.cuda_probe import check_kernel_types
from infer.modules.tbe import KernelRunner, bag_offsets, first_id_error, make_tbe


class ValidatingCollection(nn.Module):
    """Request validation and MEAN pooling shared by the unsharded and sharded collections.

    Subclasses set the feature metadata in ``__init__`` via ``_set_features`` and implement
    ``lookup_validated``; ``forward`` validates first, so no bad input reaches a kernel.
    """

    feature_names: List[str]
    feature_rows: List[int]
    column_starts: List[int]
    feature_dims: List[int]
    mean_features: List[int]
    num_features: int
    min_rows: int
    output_dim: int
    checks_ids_in_validate: bool
    request_error_prefix: Final[str] = rules.REQUEST_ERROR_PREFIX

    def __init_subclass__(cls, **kwargs: object) -> None:
        # TorchScript types attributes from the scripted class's own annotations only: copy ours down.
        super().__init_subclass__(**kwargs)
        cls.__annotations__ = {**ValidatingCollection.__annotations__, **cls.__dict__.get("__annotations__", {})}

    def _set_features(self, spec: ModelSpec) -> None:
        features = spec.features
        self.feature_names = [f.name for f in features]
        self.feature_rows = [f.num_embeddings for f in features]
        self.column_starts = [f.column_start for f in features]
        self.feature_dims = [f.embedding_dim for f in features]
        self.mean_features = [i for i, f in enumerate(features) if f.pooling == PoolingType.MEAN]
        self.num_features = len(features)
        self.min_rows = min(self.feature_rows)
        self.output_dim = spec.output_dim
        # a sharded collection checks ids on each device, in parallel, right before its kernel
        self.checks_ids_in_validate = True

    def _request_error(self, message: str) -> str:
        return self.request_error_prefix + message

    def validate(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor]) -> None:
        """Check the request; raise naming the feature and the bad value.

        The common case costs two reductions: one over lengths, one over ids. Per-feature work
        happens only when an id lies outside the smallest table's range.
        """
        refused_values = rules.tensor_error("values", values, 1)
        if refused_values is not None:
            raise ValueError(self._request_error(refused_values))
        refused_lengths = rules.tensor_error("lengths", lengths, 1)
        if refused_lengths is not None:
            raise ValueError(self._request_error(refused_lengths))
        num_features = self.num_features
        if lengths.numel() % num_features != 0:
            raise ValueError(self._request_error(rules.uneven_batch(lengths.numel(), self.feature_names)))
        batch = lengths.numel() // num_features
        if values.device.type != "cpu" and self.passes_on_device(values, lengths):
            self.validate_weights(values, weights)
            return
        if lengths.numel() > 0:
            shortest, longest = torch.aminmax(lengths)
            if int(shortest) < 0:
                position = int(torch.nonzero(lengths < 0)[0][0])
                raise ValueError(
                    self._request_error(
                        rules.negative_length(
                            self.feature_names[position // batch], position % batch, int(lengths[position])
                        )
                    )
                )
            if int(longest) > values.numel():
                # before any sum: lengths this large could wrap the sum around to the number of ids
                position = int(torch.nonzero(lengths > values.numel())[0][0])
                raise ValueError(
                    self._request_error(
                        rules.length_past_ids(
                            self.feature_names[position // batch],
                            position % batch,
                            int(lengths[position]),
                            values.numel(),
                        )
                    )
                )
        total = int(lengths.sum()) if lengths.numel() > 0 else 0
        if total != values.numel():
            raise ValueError(self._request_error(rules.lengths_sum(total, values.numel())))
        self.validate_weights(values, weights)
        if self.checks_ids_in_validate:
            self.validate_ids(values, lengths)

    def validate_weights(self, values: Tensor, weights: Optional[Tensor]) -> None:
        if weights is not None:
            refused_weights = rules.tensor_error("weights", weights, 1)
            if refused_weights is not None:
                raise ValueError(self._request_error(refused_weights))
            if weights.numel() != values.numel():
                raise ValueError(self._request_error(rules.weights_count(weights.numel(), values.numel())))

    def passes_on_device(self, values: Tensor, lengths: Tensor) -> bool:
        """A request on a GPU passes every check on lengths (and on ids, when ``validate`` checks them): true from
        three reductions read back to the host at once, where the checks one by one would wait for the device five
        times. False sends ``validate`` through the checks one by one, which name what failed.

        On a GPU each operation costs the host more than the device does (bench/lookup_cuda.py's profile: ~10 us
        of launch per op against ~2-6 us of device time for a reduction over 300k ids), so the summary is as few
        operations as the checks allow; checking on the device without waiting before the kernel (a flag, with the
        kernel run over empty bags when it is set) took 10 more operations and measured slower on an H100.
        """
        if lengths.numel() == 0 or values.numel() == 0:
            return False
        counts = lengths.long()
        shortest, longest = torch.aminmax(counts)
        parts = [shortest, longest, counts.sum()]
        if self.checks_ids_in_validate:
            low, high = torch.aminmax(values)
            parts += [low.long(), high.long()]
        summary: List[int] = torch.stack(parts).tolist()
        ids_pass = not self.checks_ids_in_validate or (summary[3] >= 0 and summary[4] < self.min_rows)
        return summary[0] >= 0 and summary[1] <= values.numel() and summary[2] == values.numel() and ids_pass

    def validate_ids(self, values: Tensor, lengths: Tensor) -> None:
        """Every id within its feature's table (after ``validate``'s structural checks passed)."""
        num_features = self.num_features
        batch = lengths.numel() // num_features
        if values.numel() == 0:
            return
        low, high = torch.aminmax(values)
        if int(low) >= 0 and int(high) < self.min_rows:
            return
        ends: List[int] = lengths.view(num_features, batch).sum(1).cumsum(0).tolist()
        error = first_id_error(values, [0] + ends, self.feature_rows, self.feature_names)
        if error is not None:
            raise ValueError(self._request_error(error))

    def forward(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None) -> Tensor:
        self.validate(values, lengths, weights)
        return self.lookup_validated(values, lengths, weights)

    def lookup_validated(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None) -> Tensor:
        raise NotImplementedError("subclasses look up")

    def apply_mean(self, out: Tensor, lengths: Tensor) -> Tensor:
        """Divide MEAN features' pooled sums by their bag lengths (an empty bag stays zero)."""
        if len(self.mean_features) > 0:
            batch = lengths.numel() // self.num_features
            counts = lengths.view(self.num_features, batch).to(device=out.device, dtype=out.dtype).clamp(min=1.0)
            for f in self.mean_features:
                start = self.column_starts[f]
                end = start + self.feature_dims[f]
                out[:, start:end].div_(counts[f].unsqueeze(1))
        return out


def tbe_tables(spec: ModelSpec) -> List[List[int]]:
    """Per spec table, the indices of its TBE tables in the collection's kernel: one, or one per precision block
    (blocks in rank order, hottest first)."""
    out: List[List[int]] = []
    index = 0
    for table in spec.tables:
        count = len(table.stored_blocks)
        out.append(list(range(index, index + count)))
        index += count
    return out


def kernel_features(spec: ModelSpec) -> List[Tuple[int, int]]:
    """The kernel's features as (feature, block), level-major: level 0 is every feature's coldest block (the
    last; the whole table without blocks) in feature order, whose pooled columns are then the output's; level
    ``k >= 1`` is every feature again, at the ``k - 1``-th (precise) block of its table, or, past its table's
    precise blocks, at its coldest block with empty bags (pooled to zeros)."""
    return level_blocks([len(spec.table(f.table).stored_blocks) for f in spec.features])


def level_blocks(counts: List[int]) -> List[Tuple[int, int]]:
    """``kernel_features`` of features whose tables hold ``counts`` blocks each (a table in one type: 1), in the
    features' order: a sharded device's kernel reads its own features so (``infer.shard.builder``)."""
    levels = max(counts, default=1)
    return [
        (f, counts[f] - 1 if k == 0 or k >= counts[f] else k - 1) for k in range(levels) for f in range(len(counts))
    ]


def kernel_table_name(table: str, block: int) -> str:
    """The name of a TBE table: the table's own, or ``<table>.block<j>`` for its ``j``-th precision block
    (``block`` -1: a table in one type)."""
    return table if block < 0 else f"{table}.block{block}"


def encode_remap(ranks: Tensor, starts: List[int]) -> Tensor:
    """The stored id remap (int32) of an id -> rank permutation whose blocks start at ranks ``starts``: each id's
    position in the blocks laid end to end in kernel level order, the cold (last) block first: a cold id -> its row
    there, an id at row ``r`` of precise block ``j`` -> the cold block's rows + ``starts[j] + r``. A permutation of
    the table's rows, so ``fbgemm::block_bucketize_sparse_features`` at the blocks' bounds (``block_bounds``)
    splits a request by block in one pass, each id's row in its block being its position less its block's start."""
    held = ranks.to(torch.int64)
    cold_start = starts[-1]
    cold_rows = held.numel() - cold_start
    return torch.where(held >= cold_start, held - cold_start, held + cold_rows).to(torch.int32)


def decode_remap(remap: Tensor, starts: List[int]) -> Optional[Tensor]:
    """``encode_remap`` undone: id -> rank (int64), or None when a value is no position in the table's rows."""
    held = remap.to(torch.int64)
    rows = held.numel()
    if rows > 0 and (int(held.min()) < 0 or int(held.max()) >= rows):
        return None
    cold_rows = rows - starts[-1]
    return torch.where(held < cold_rows, held + starts[-1], held - cold_rows)


def block_bounds(rows: int, starts: List[int], levels: int) -> List[int]:
    """A feature's block bounds in ``encode_remap``'s positions, one block per kernel level (``kernel_features``):
    the cold block, then each precise block, then empty blocks up to ``levels`` (a table without blocks: ``starts``
    = [0], its whole table the cold block)."""
    cold_rows = rows - starts[-1]
    bounds = [0, cold_rows] + [cold_rows + s for s in starts[1:]]
    return bounds + [rows] * (levels + 1 - len(bounds))


@dataclasses.dataclass(frozen=True)
class BlockSplit:
    """What splits a request by kernel level, derived from the spec's tables alone: the collection holds these as
    attributes of the same names, and both loaders check a loaded model's against the manifest's tables."""

    has_blocks: bool
    block_levels: int
    block_table_names: List[str]
    block_rank_starts: List[List[int]]
    feature_remap: List[int]  # per feature its table's slot among the block tables, -1 for none
    feature_blocks: List[int]
    block_lookup_offsets: List[int]  # per feature its remap's range in block_lookup
    block_bounds: List[List[int]]  # per feature, in encode_remap's positions
    block_fixed_sizes: bool
    block_sizes: List[int]

    @staticmethod
    def of(spec: ModelSpec) -> "BlockSplit":
        return BlockSplit.of_features([(f.table, f.num_embeddings, spec.table(f.table).blocks) for f in spec.features])

    @staticmethod
    def of_features(features: Sequence[Tuple[str, int, Tuple[RowBlock, ...]]]) -> "BlockSplit":
        """The split of a kernel that reads ``features``: per feature, in the kernel's order, the table it reads, the
        table's rows and its precision blocks (() for a table in one type). The block tables are in the order the
        features first read them (a spec's: table order)."""
        block_tables: List[Tuple[str, Tuple[RowBlock, ...]]] = []
        for table, _, blocks in features:
            if blocks and all(table != name for name, _ in block_tables):
                block_tables.append((table, blocks))
        levels = max([len(blocks) if blocks else 1 for _, _, blocks in features], default=1)
        starts = [[sum(b.rows for b in blocks[:j]) for j in range(len(blocks))] for _, blocks in block_tables]
        slot_of = {name: i for i, (name, _) in enumerate(block_tables)}
        remap = [slot_of.get(table, -1) if blocks else -1 for table, _, blocks in features]
        rows = [n for _, n, _ in features]
        offsets = [0]
        for n, slot in zip(rows, remap):
            offsets.append(offsets[-1] + (n if slot >= 0 else 0))
        bounds = [block_bounds(n, starts[slot] if slot >= 0 else [0], levels) for n, slot in zip(rows, remap)]
        # two levels, every precise block no larger than its cold block: the op's fixed-size buckets split the same
        # way (bucket = position // the cold block's rows, row = position % it) without a search per id; block_sizes
        # is then each feature's cold rows, otherwise the op requires it beside the bounds and reads only these
        fixed = levels == 2 and all(2 * b[1] >= b[-1] for b in bounds)
        return BlockSplit(
            has_blocks=len(block_tables) > 0,
            block_levels=levels,
            block_table_names=[name for name, _ in block_tables],
            block_rank_starts=starts,
            feature_remap=remap,
            feature_blocks=[len(blocks) if blocks else 1 for _, _, blocks in features],
            block_lookup_offsets=offsets,
            block_bounds=bounds,
            block_fixed_sizes=fixed,
            block_sizes=[b[1] if fixed else b[-1] for b in bounds],
        )

    def mismatch(self, collection: nn.Module) -> Optional[str]:
        """The first attribute of a (loaded) collection that differs from this split, or None."""
        for field in dataclasses.fields(self):
            held = getattr(collection, field.name, None)
            if isinstance(held, Tensor):
                held = held.tolist()
            elif isinstance(held, (list, tuple)):
                held = [h.tolist() if isinstance(h, Tensor) else (list(h) if isinstance(h, tuple) else h) for h in held]
            if held != getattr(self, field.name):
                return field.name
        return None


class BlockSplitter:
    """Splits a kernel's input by precision block (see ``QuantizedEmbeddingBagCollection``): the block attributes
    (a ``BlockSplit``'s, installed by ``init_block_split``), the remap's setters, and ``pool``, which a module that
    runs its TBE through ``KernelRunner`` takes from here. The unsharded collection and each device of a sharded one
    (``infer.modules.sharded.DeviceShards``, over the features its kernel reads) split requests the same way."""

    has_blocks: bool
    block_levels: int
    block_lookup: Tensor
    block_lookup_offsets: Tensor
    block_bounds: List[Tensor]
    block_sizes: Tensor
    block_fixed_sizes: bool
    block_rank_starts: List[List[int]]
    block_table_names: List[str]
    feature_remap: List[int]
    feature_blocks: List[int]

    def __init_subclass__(cls, **kwargs: object) -> None:
        # TorchScript types attributes from the scripted class's own annotations only: copy ours down.
        super().__init_subclass__(**kwargs)
        cls.__annotations__ = {**BlockSplitter.__annotations__, **cls.__dict__.get("__annotations__", {})}

    def init_block_split(self, split: BlockSplit, device: torch.device | str = "cpu") -> None:
        """Hold ``split``'s attributes (the tensors on the kernel's ``device``, where the split runs), and each block
        table's remap at identity ranks (rank = id) until ``set_block_remap``."""
        self.has_blocks = split.has_blocks
        self.block_levels = split.block_levels
        self.block_rank_starts = split.block_rank_starts
        self.feature_remap = split.feature_remap
        self.feature_blocks = split.feature_blocks
        self.block_table_names = split.block_table_names
        self.block_lookup_offsets = torch.tensor(split.block_lookup_offsets, dtype=torch.int64, device=device)
        sizes = [b - a for a, b in zip(split.block_lookup_offsets, split.block_lookup_offsets[1:])]
        self.block_lookup = torch.cat(
            [torch.zeros(0, dtype=torch.int32)]
            + [
                encode_remap(torch.arange(size), self.block_rank_starts[slot])
                for size, slot in zip(sizes, self.feature_remap)
                if slot >= 0
            ]
        ).to(device)
        # per feature its blocks' bounds (int32, as the remapped ids) for the split
        self.block_bounds = [torch.tensor(b, dtype=torch.int32, device=device) for b in split.block_bounds]
        self.block_fixed_sizes = split.block_fixed_sizes
        self.block_sizes = torch.tensor(split.block_sizes, dtype=torch.int32, device=device)

    @torch.jit.unused
    def set_block_remap(self, table: str, ranks: Tensor) -> None:
        """Install ``table``'s id remap from its ranks (id -> rank, a permutation of its rows; ``ConfigError``
        otherwise), stored encoded (``encode_remap``) in each of its features' ranges."""
        from infer.errors import ConfigError

        if table not in self.block_table_names:
            raise ConfigError(
                f"table {table!r} is not held in precision blocks; its blocks are {self.block_table_names}"
            )
        slot = self.block_table_names.index(table)
        held = stored_remaps(self)  # type: ignore[arg-type]
        rows = held[slot][0].numel()
        error = rank_error(ranks, rows)
        if error is not None:
            raise ConfigError(f"table {table!r}: the id remap {error}; pass a permutation of [0, {rows})")
        encoded = encode_remap(ranks, self.block_rank_starts[slot])
        for view in held[slot]:
            view.copy_(encoded)

    @torch.jit.unused
    def block_ranks(self, table: str) -> Tensor:
        """``table``'s id -> rank permutation (int64), decoded from its stored remap."""
        slot = self.block_table_names.index(table)
        ranks = decode_remap(stored_remaps(self)[slot][0], self.block_rank_starts[slot])  # type: ignore[arg-type]
        assert ranks is not None
        return ranks

    def pool(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor]) -> Tensor:
        """One example range's pooled columns: a request of block tables split by block first (in the range's
        own thread, so the split runs in parallel with the other ranges), the blocks' columns added."""
        if not self.has_blocks:
            return self.kernel(values, bag_offsets(lengths, values), weights)  # type: ignore[attr-defined]
        block_values, block_lengths, block_weights = self.split_blocks(values, lengths, weights)
        pooled = self.kernel(block_values, bag_offsets(block_lengths, block_values), block_weights)  # type: ignore[attr-defined]
        return self.add_blocks(pooled)

    def split_blocks(
        self, values: Tensor, lengths: Tensor, weights: Optional[Tensor]
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """The kernel input of a validated request (``kernel_features`` order): the ids remapped to their
        positions by one ``pruned_array_lookup``, then split by level (cold block first, then each precise block)
        by one ``block_bucketize_sparse_features`` at the blocks' bounds: each level every feature's bags in order
        with the ids that fall in its block, as rows of that block (a bag's count there may be 0). Two passes over
        the ids whatever the number of features and blocks (fbgemm's kernel spends nearly a lookup's time on a
        skipped -1 id, so ids are moved rather than masked)."""
        bounds: Optional[List[Tensor]] = None if self.block_fixed_sizes else self.block_bounds
        return split_by_block(
            values, lengths, weights, self.block_lookup, self.block_lookup_offsets, self.block_sizes,
            self.block_levels, bounds,
        )  # fmt: skip

    def add_blocks(self, pooled: Tensor) -> Tensor:
        """``[batch, width]``: the levels' pooled columns (``block_levels`` of ``width`` each, level-major) added
        into level 0's, in place (a view of ``pooled``: ``run_kernel`` hands back a contiguous tensor); a feature
        past its table's precise blocks has empty bags there: zeros."""
        width = pooled.size(1) // self.block_levels
        out = pooled[:, :width]
        for k in range(1, self.block_levels):
            out.add_(pooled[:, k * width : (k + 1) * width])
        return out


def split_by_block(
    values: Tensor,
    lengths: Tensor,
    weights: Optional[Tensor],
    block_lookup: Tensor,
    block_lookup_offsets: Tensor,
    block_sizes: Tensor,
    block_levels: int,
    block_bounds: Optional[List[Tensor]],
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``QuantizedEmbeddingBagCollection.split_blocks`` on a collection's split attributes (``BlockSplit``; the
    bounds None when ``block_fixed_sizes``): ``(values, lengths, weights)`` of the kernel input. The pt2 program
    (``pt2_program.BlockSplitCall``) splits a request with it too."""
    # int32 ids: the remap is int32, and fbgemm widens it on every call for int64 ids
    ids = values.to(torch.int32)
    held = torch.ops.fbgemm.pruned_array_lookup(ids, bag_offsets(lengths, ids), block_lookup, block_lookup_offsets)
    split = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths, held, False, False, block_sizes, block_levels, weights, None, -1, block_bounds
    )
    return split[1], split[0], split[2]


class QuantizedEmbeddingBagCollection(ValidatingCollection, BlockSplitter, KernelRunner):
    """All tables of one device in one fbgemm ``IntNBitTableBatchedEmbeddingBagsCodegen``.

    The kernel pools with SUM and emits fp32; MEAN features are divided by their bag lengths
    afterwards, so SUM and MEAN tables share the single kernel call.

    A table held in precision blocks (``TableConfig.blocks``) is one TBE table per block, in the same kernel
    (fbgemm takes a type per table): the precise blocks hold the rows ranked hottest, the last (cold) block every
    other row, in id order. Its id remap (``encode_remap``) is held once per feature of the table, back to back in
    ``block_lookup`` (a feature without blocks: no range), so that one ``fbgemm::pruned_array_lookup`` call maps a
    whole request to positions in the blocks. The kernel input is the request split by level (``kernel_features``)
    by one ``fbgemm::block_bucketize_sparse_features`` call at each feature's ``block_bounds``: level 0 every
    feature's ids that fall in its cold block (a feature without blocks: all of them), level ``k`` those in the
    ``k - 1``-th precise block, every bag at every level (a bag's count there may be 0); the levels' pooled columns
    are added (MEAN: then divided by the full bag length). Each example range of a batch-parallel call splits its
    own ids.
    """

    def __init__(
        self,
        spec: ModelSpec,
        device: torch.device | str = "cpu",
        row_alignment: Optional[int] = None,
        allocate: bool = True,
    ):
        super().__init__()
        kernel_tables = tbe_tables(spec)
        table_index = {t.name: i for i, t in enumerate(spec.tables)}
        specs: List[Tuple[str, int, int, DataType]] = [
            (kernel_table_name(t.name, j if t.blocks else -1), b.rows, t.embedding_dim, b.data_type)
            for t in spec.tables
            for j, b in enumerate(t.stored_blocks)
        ]
        features = kernel_features(spec)
        check_kernel_types([(name, dtype) for name, _, _, dtype in specs], str(torch.device(device)))
        self.tbe = make_tbe(
            specs,
            [kernel_tables[table_index[spec.features[f].table]][j] for f, j in features],
            torch.device(device),
            row_alignment,
            allocate,
        )
        self._set_features(spec)
        self.init_block_split(BlockSplit.of(spec), torch.device(device))
        self.init_kernel_runner(len(features), str(torch.device(device)), len(spec.features))

    def table_weights(self) -> List[Tuple[Tensor, Optional[Tensor]]]:
        """Per TBE table (a table's blocks each one, see ``tbe_tables``): the kernel's row bytes (without
        padding) and, for INT types, scale/bias bytes."""
        return self.tbe.split_embedding_weights()  # type: ignore[operator]

    def lookup_validated(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None) -> Tensor:
        """Pooled lookups of an already validated request: ``[batch, output_dim]`` fp32.

        Reached from outside only through ``EmbserveModel.lookup_unchecked`` (a host that validated already).
        """
        return self.apply_mean(self.run_kernel(values, lengths, weights), lengths)


def stored_remaps(collection: nn.Module) -> List[List[Tensor]]:
    """Per block table of a collection (eager or loaded), its stored id remap as each of its features holds it:
    views into ``block_lookup``."""
    lookup: Tensor = collection.block_lookup  # type: ignore[assignment]
    bounds: List[int] = collection.block_lookup_offsets.tolist()  # type: ignore[operator]
    slots: List[int] = list(collection.feature_remap)  # type: ignore[arg-type]
    out: List[List[Tensor]] = [[] for _ in collection.block_table_names]  # type: ignore[union-attr]
    for feature, slot in enumerate(slots):
        if slot >= 0:
            out[slot].append(lookup[bounds[feature] : bounds[feature + 1]])
    return out


def rank_error(ranks: Tensor, rows: int) -> Optional[str]:
    """Why ``ranks`` is not a permutation of ``[0, rows)`` (1-D integer), or None."""
    if ranks.dim() != 1 or ranks.is_floating_point() or ranks.dtype == torch.bool or ranks.numel() != rows:
        return f"is {ranks.dtype} of shape {list(ranks.shape)}, not {rows} integer ranks"
    if rows == 0:
        return None
    held = ranks.to(torch.int64)
    low, high = int(held.min()), int(held.max())
    if low < 0 or high >= rows:
        return f"holds rank {low if low < 0 else high}, outside [0, {rows})"
    if int(torch.bincount(held, minlength=rows).max()) > 1:
        return "gives two ids the same rank"
    return None


def remap_error(remap: Tensor, rows: int, starts: List[int]) -> Optional[str]:
    """Why ``remap`` (a stored remap, ``encode_remap``'s form, blocks starting at ranks ``starts``) does not send
    its ``rows`` ids one to one onto the blocks' rows, or None."""
    if remap.dim() != 1 or remap.is_floating_point() or remap.dtype == torch.bool or remap.numel() != rows:
        return f"is {remap.dtype} of shape {list(remap.shape)}, not {rows} integer block rows"
    ranks = decode_remap(remap, starts)
    if ranks is None:
        return "names a row outside the table's blocks"
    return rank_error(ranks, rows)


class _NoDenseArch(nn.Module):
    request_error_prefix: Final[str] = rules.REQUEST_ERROR_PREFIX

    def forward(self, dense_features: Tensor, pooled: Tensor) -> Tensor:
        raise RuntimeError(self.request_error_prefix + rules.NO_DENSE_PART)


def placed_dense_arch(dense_arch: Optional[nn.Module], device: Union[str, torch.device]) -> Optional[nn.Module]:
    """The dense part on ``device``, where the pooled embeddings land (``score`` hands it the pooled rows there): a
    moved copy when any of its parameters or buffers lives elsewhere (a CUDA model's dense part; the caller's module
    is never moved), the module itself otherwise."""
    if dense_arch is None:
        return None
    target = torch.device(device)
    tensors = list(dense_arch.parameters()) + list(dense_arch.buffers())
    if all(t.device == target for t in tensors):
        return dense_arch
    return copy.deepcopy(dense_arch).to(target)


class EmbserveModel(nn.Module):
    """The exported model: pooled lookups, and predictions when a dense part is present."""

    __jit_ignored_attributes__ = ["spec"]

    has_dense: bool
    num_dense_features: int
    weights_attached: bool
    request_error_prefix: Final[str] = rules.REQUEST_ERROR_PREFIX

    def __init__(
        self,
        spec: ModelSpec,
        embeddings: nn.Module,
        dense_arch: Optional[nn.Module] = None,
    ):
        super().__init__()
        self.spec = spec
        self.embeddings = embeddings
        self.has_dense = dense_arch is not None
        self.dense_arch = dense_arch if dense_arch is not None else _NoDenseArch()
        self.num_dense_features = spec.num_dense_features
        # False in a mapped artifact's model.pt (weights in files beside it) until a loader attaches them
        self.weights_attached = True

    def forward(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None) -> Tensor:
        self.check_weights_attached()
        return self.embeddings(values, lengths, weights)

    @torch.jit.export
    def lookup_unchecked(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None) -> Tensor:
        """``forward`` without the request checks, for a host that ran them already (``embserve serve`` validates
        every request once with ``infer.request_rules``). Anything else must call ``forward``: an unchecked bad
        request reaches the kernel, whose FATAL bounds check is then the only guard."""
        self.check_weights_attached()
        return self.embeddings.lookup_validated(values, lengths, weights)  # type: ignore[operator]

    @torch.jit.export
    def lookup_and_predict_unchecked(
        self, dense_features: Tensor, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor]:
        """``lookup_and_predict`` without the sparse request checks (see ``lookup_unchecked``); the dense
        features' shape is still checked (two comparisons)."""
        if not self.has_dense:
            raise RuntimeError(self.request_error_prefix + rules.NO_DENSE_PART)
        self.check_weights_attached()
        pooled = self.embeddings.lookup_validated(values, lengths, weights)  # type: ignore[operator]
        return pooled, self.score(dense_features, pooled)

    def check_weights_attached(self) -> None:
        if not self.weights_attached:
            raise RuntimeError(rules.WEIGHTS_DETACHED)

    @torch.jit.export
    def predict(
        self, dense_features: Tensor, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None
    ) -> Tensor:
        """Scores float32 ``[batch]`` of the dense part on the pooled lookups (the call contract's one shape)."""
        return self.lookup_and_predict(dense_features, values, lengths, weights)[1]

    @torch.jit.export
    def lookup_and_predict(
        self, dense_features: Tensor, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor]:
        """Pooled embeddings ``[batch, output_dim]`` and scores ``[batch]`` of one forward."""
        if not self.has_dense:
            raise RuntimeError(self.request_error_prefix + rules.NO_DENSE_PART)
        self.check_weights_attached()
        pooled = self.embeddings(values, lengths, weights)
        return pooled, self.score(dense_features, pooled)

    @torch.jit.export
    def score(self, dense_features: Tensor, pooled: Tensor) -> Tensor:
        """The dense part on already pooled embeddings (``dense_features`` checked first): float32 ``[batch]``."""
        if not self.has_dense:
            raise RuntimeError(self.request_error_prefix + rules.NO_DENSE_PART)
        refused = rules.tensor_error("dense_features", dense_features, 2)
        if refused is not None and dense_features.dim() == 2:
            raise ValueError(self.request_error_prefix + refused)
        if (
            dense_features.dim() != 2
            or dense_features.size(0) != pooled.size(0)
            or dense_features.size(1) != self.num_dense_features
        ):
            raise ValueError(
                self.request_error_prefix
                + rules.dense_shape(pooled.size(0), self.num_dense_features, str(list(dense_features.shape)))
            )
        return rules.scores_of(self.dense_arch(dense_features.to(pooled.device), pooled), pooled.size(0))
