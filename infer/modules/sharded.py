"""The scriptable sharded collection: one TBE per device, inputs routed once, outputs in input order.

Routing is fixed at build time: each device knows, for every shard it holds, which input feature it
reads and how (all ids, the ids of one row block, or one slice of the batch: replicas, and row- and
column-wise shards on one CPU host, which are views of the whole table). At run time every
device builds its own kernel input, runs its TBE and writes its columns straight into the shared
output; devices run concurrently (``torch.jit.fork``), each CPU shard on its own core. Row-wise
partial sums are added afterwards, then MEAN features are divided by their full bag lengths, so
the output is laid out exactly like the unsharded model's.
"""

from dataclasses import dataclass
from typing import Final, Optional

import torch
from torch import Tensor, nn

from infer import request_rules as rules
from infer.modules.collection import BlockSplit, BlockSplitter, ValidatingCollection
from infer.modules.tbe import KernelRunner, bag_offsets, first_id_error

# How a shard reads its feature; the scripted methods read them as DeviceShards' Final attributes.
READ_ALL = 0  # table-wise and column-wise shards: every id of the feature
READ_ROW_BLOCK = 1  # row-wise: ids in [lo, hi), shifted by -lo
READ_BATCH_SLICE = 2  # replicated, CPU views: bags of share lo out of hi (lo * B // hi .. (lo + 1) * B // hi)


@dataclass(frozen=True)
class RowBuckets:
    """Row-wise features bucketized for all devices together: device ``j``'s block of feature
    ``features[r]`` is rows ``positions[r][j] .. positions[r][j + 1]`` (empty for a device without one)."""

    features: tuple[int, ...]
    positions: tuple[tuple[int, ...], ...]
    block_sizes: tuple[int, ...]
    even: bool  # every feature's blocks one size (the last short or empty): bucket = id // size


def row_buckets(routings: list[list[tuple[int, int, int, int]]], feature_rows: list[int]) -> RowBuckets | None:
    """The one-call bucketizing of a sharded collection whose devices read ``routings`` (per device, per kernel
    feature: feature, kind, lo, hi), or None when a device holds several blocks of one feature or the devices'
    blocks, in device order, do not tile a feature's rows (each device then bucketizes its own)."""
    blocks: dict[int, dict[int, tuple[int, int]]] = {}
    for j, routing in enumerate(routings):
        for feature, kind, lo, hi in routing:
            if kind != READ_ROW_BLOCK:
                continue
            per_device = blocks.setdefault(feature, {})
            if j in per_device:
                return None
            per_device[j] = (lo, hi)
    if not blocks:
        return None
    positions = []
    for feature in sorted(blocks):
        bounds = [0]
        for j in range(len(routings)):
            lo, hi = blocks[feature].get(j, (bounds[-1], bounds[-1]))
            if lo != bounds[-1]:
                return None
            bounds.append(hi)
        if bounds[-1] != feature_rows[feature]:
            return None
        positions.append(tuple(bounds))
    sizes = tuple(max(b - a for a, b in zip(p, p[1:])) for p in positions)
    even = all(list(p) == [min(j * size, p[-1]) for j in range(len(p))] for p, size in zip(positions, sizes))
    return RowBuckets(tuple(sorted(blocks)), tuple(positions), sizes, even)


def device_buckets(
    buckets: RowBuckets | None, device: int, routing: list[tuple[int, int, int, int]]
) -> tuple[int, int, list[int]]:
    """Device ``device``'s bucket (-1: it bucketizes its own row blocks), the number of row-wise features, and
    per kernel feature its row-wise slot (-1: not read from the bucketized input)."""
    if buckets is None:
        return -1, 0, [-1] * len(routing)
    slot_of = {f: r for r, f in enumerate(buckets.features)}
    slots = [slot_of[f] if kind == READ_ROW_BLOCK else -1 for f, kind, _, _ in routing]
    bucket = device if any(kind == READ_ROW_BLOCK for _, kind, _, _ in routing) else -1
    return bucket, len(buckets.features), slots


def kernel_rows(local_features: list[list[int]], feature_rows: list[int]) -> list[int]:
    """The rows of the kernel table each of a device's features reads (``local_features`` as ``DeviceShards``
    takes them): a row block's, else the feature's table's (table-wise, column slices, replicas, views)."""
    return [lf[3] - lf[2] if lf[1] == READ_ROW_BLOCK else feature_rows[lf[0]] for lf in local_features]


class DeviceShards(nn.Module, BlockSplitter, KernelRunner):
    """Every shard placed on one device, in one TBE. A table held in precision blocks, placed table-wise, is one
    TBE table per block here, and this device splits its kernel input by block as the unsharded collection does
    (``BlockSplitter``, over the features this kernel reads: ``split``)."""

    device: str
    lf_feature: list[int]
    lf_kind: list[int]
    lf_lo: list[int]
    lf_hi: list[int]
    lf_local_col: list[int]
    lf_out_col: list[int]
    lf_dim: list[int]
    lf_rows: list[int]
    lf_name: list[str]
    has_partials: bool
    row_block_entries: list[int]
    row_block_lo: list[int]
    row_block_hi: list[int]
    contiguous_input: bool
    min_rows: int
    copy_src: list[int]
    copy_dst: list[int]
    copy_width: list[int]
    rw_slot: list[int]
    bucket: int
    rw_feature_count: int
    read_all: Final[int] = READ_ALL
    read_row_block: Final[int] = READ_ROW_BLOCK
    read_batch_slice: Final[int] = READ_BATCH_SLICE
    request_error_prefix: Final[str] = rules.REQUEST_ERROR_PREFIX

    def __init__(
        self,
        tbe: nn.Module,
        device: str,
        local_features: list[list[int]],
        feature_rows: list[int],
        feature_names: list[str],
        split: BlockSplit | None = None,
    ) -> None:
        """``local_features``: per feature this kernel reads ``[feature, kind, lo, hi, out_col, dim]`` in kernel
        order; ``feature_rows``/``feature_names``: of every model feature, for the id checks; ``split``: how the
        kernel input is split by precision block (``infer.shard.builder.device_split``; none: no block tables)."""
        super().__init__()
        self.lf_rows = [feature_rows[lf[0]] for lf in local_features]
        self.lf_name = [feature_names[lf[0]] for lf in local_features]
        self.tbe = tbe
        self.device = device
        if split is None:
            split = BlockSplit.of_features([("", rows, ()) for rows in kernel_rows(local_features, feature_rows)])
        self.init_block_split(split, device)
        # with block tables the kernel reads every feature once per level (``collection.level_blocks``)
        self.init_kernel_runner(len(local_features) * split.block_levels, device, len(local_features))
        self.lf_feature = [lf[0] for lf in local_features]
        self.lf_kind = [lf[1] for lf in local_features]
        self.lf_lo = [lf[2] for lf in local_features]
        self.lf_hi = [lf[3] for lf in local_features]
        self.lf_out_col = [lf[4] for lf in local_features]
        self.lf_dim = [lf[5] for lf in local_features]
        local_cols = []
        col = 0
        for lf in local_features:
            local_cols.append(col)
            col += lf[5]
        self.lf_local_col = local_cols
        self.has_partials = READ_ROW_BLOCK in self.lf_kind
        # Set by the collection when it bucketizes every row-wise feature for all devices in one kernel
        # call: this device's bucket, and per kernel entry its row-wise feature's slot (-1: not row-wise).
        self.bucket = -1
        self.rw_feature_count = 0
        self.rw_slot = [-1 for _ in local_features]
        # row-wise shards, bucketized together in one pass (kernel order)
        self.row_block_entries = [i for i, kind in enumerate(self.lf_kind) if kind == READ_ROW_BLOCK]
        # plain ints, not tensors: routing is checked against the plan at load (artifact.kernels)
        self.row_block_lo = [self.lf_lo[i] for i in self.row_block_entries]
        self.row_block_hi = [self.lf_hi[i] for i in self.row_block_entries]
        # Every feature read whole and the features consecutive in the input: the kernel input is one
        # slice of the request (no gather), and one range check covers it unless an id is suspicious.
        first = self.lf_feature[0] if self.lf_feature else 0
        self.contiguous_input = all(kind == READ_ALL for kind in self.lf_kind) and self.lf_feature == list(
            range(first, first + len(self.lf_feature))
        )
        self.min_rows = min(self.lf_rows) if self.lf_rows else 0
        # Whole-feature columns, merged where neighbours are adjacent in both the kernel output and the
        # output: one wide copy streams through memory once instead of once per feature.
        self.copy_src, self.copy_dst, self.copy_width = [], [], []
        for i, kind in enumerate(self.lf_kind):
            if kind != READ_ALL:
                continue
            src, dst, dim = self.lf_local_col[i], self.lf_out_col[i], self.lf_dim[i]
            if self.copy_src and self.copy_src[-1] + self.copy_width[-1] == src:
                if self.copy_dst[-1] + self.copy_width[-1] == dst:
                    self.copy_width[-1] += dim
                    continue
            self.copy_src.append(src)
            self.copy_dst.append(dst)
            self.copy_width.append(dim)

    def forward(
        self,
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None,
        starts: list[int],
        batch: int,
        out: Tensor,
        rw_values: Tensor,
        rw_lengths: Tensor,
        rw_weights: Tensor | None,
        rw_starts: list[int],
    ) -> Tensor:
        """Run this device's shards; write exclusive columns into ``out``; return the kernel output.

        ``rw_*``: the collection's bucketized row-wise input (every device's row blocks, bucket-major, ids
        already range-checked and shifted into their blocks; ``rw_starts`` the first id of every (bucket,
        feature) slot), read when ``bucket >= 0``; otherwise this device bucketizes its row blocks itself.
        """
        if self.contiguous_input:
            first = self.lf_feature[0]
            last = self.lf_feature[-1] + 1
            run_values = values[starts[first] : starts[last]]
            self.check_run(run_values, [start - starts[first] for start in starts[first : last + 1]])
            run_weights: Tensor | None = None
            if weights is not None:
                run_weights = weights[starts[first] : starts[last]]
            pooled = self.run_kernel(run_values, lengths[first * batch : last * batch], run_weights)
            self.copy_out(pooled, batch, out)
            return pooled
        first_bag, last_bag = self.one_batch_slice(batch)
        if first_bag >= 0:
            return self.run_batch_slice(values, lengths, weights, batch, first_bag, last_bag, out)
        pieces_v: list[Tensor] = []
        pieces_l: list[Tensor] = []
        pieces_w: list[Tensor] = []
        if self.bucket >= 0:
            block_v, block_l, block_w = self.row_blocks_of_bucket(rw_values, rw_lengths, rw_weights, rw_starts, batch)
        else:
            block_v, block_l, block_w = self.bucketize_row_blocks(values, lengths, weights, starts, batch)
        block = 0
        for i in range(len(self.lf_feature)):
            f = self.lf_feature[i]
            kind = self.lf_kind[i]
            ids = values[starts[f] : starts[f + 1]]
            bag_lengths = lengths[f * batch : (f + 1) * batch]
            # a replica checks only its slice, below; bucketized row blocks were checked by the collection
            if kind == self.read_all or (kind == self.read_row_block and self.bucket < 0):
                self.check_ids(ids, self.lf_rows[i], self.lf_name[i])
            if kind == self.read_all:
                pieces_v.append(ids)
                pieces_l.append(bag_lengths)
                if weights is not None:
                    pieces_w.append(weights[starts[f] : starts[f + 1]])
            elif kind == self.read_row_block:
                pieces_v.append(block_v[block])
                pieces_l.append(block_l[block])
                if weights is not None:
                    pieces_w.append(block_w[block])
                block += 1
            else:
                first = self.lf_lo[i] * batch // self.lf_hi[i]
                last = (self.lf_lo[i] + 1) * batch // self.lf_hi[i]
                begin = int(bag_lengths[:first].sum()) if first > 0 else 0
                end = begin + (int(bag_lengths[first:last].sum()) if last > first else 0)
                self.check_ids(ids[begin:end], self.lf_rows[i], self.lf_name[i])
                pieces_v.append(ids[begin:end])
                sliced = torch.zeros(batch, dtype=lengths.dtype, device=lengths.device)
                sliced[first:last] = bag_lengths[first:last]
                pieces_l.append(sliced)
                if weights is not None:
                    pieces_w.append(weights[starts[f] + begin : starts[f] + end])
        local_weights: Tensor | None = None
        if weights is not None:
            local_weights = torch.cat(pieces_w)
        pooled = self.run_kernel(torch.cat(pieces_v), torch.cat(pieces_l), local_weights)
        self.copy_out(pooled, batch, out)
        return pooled

    def one_batch_slice(self, batch: int) -> tuple[int, int]:
        """Bags ``(first, last)`` when every kernel feature reads the same share of the batch (the shards of
        row- and column-wise views on one CPU host, ``infer.shard.builder.cpu_views``, and replicas), else
        ``(-1, -1)``."""
        if len(self.lf_kind) == 0:
            return -1, -1
        lo = self.lf_lo[0]
        hi = self.lf_hi[0]
        for i in range(len(self.lf_kind)):
            if self.lf_kind[i] != self.read_batch_slice or self.lf_lo[i] != lo or self.lf_hi[i] != hi:
                return -1, -1
        return lo * batch // hi, (lo + 1) * batch // hi

    def run_batch_slice(
        self, values: Tensor, lengths: Tensor, weights: Tensor | None, batch: int, first: int, last: int, out: Tensor
    ) -> Tensor:
        """Pool bags ``first .. last`` of every kernel feature (and only those: no empty bags for the rest of
        the batch) and write them into their rows of ``out``; return the kernel output."""
        if last <= first:
            return out[first:last]
        count = len(self.lf_feature)
        offsets = bag_offsets(lengths, values)
        picks = [f * batch + first for f in self.lf_feature] + [f * batch + last for f in self.lf_feature]
        ends: list[int] = offsets[torch.tensor(picks, dtype=torch.int64)].to(torch.int64).tolist()
        run_values = torch.cat([values[ends[i] : ends[count + i]] for i in range(count)])
        run_lengths = torch.cat([lengths[f * batch + first : f * batch + last] for f in self.lf_feature])
        run_weights: Tensor | None = None
        if weights is not None:
            run_weights = torch.cat([weights[ends[i] : ends[count + i]] for i in range(count)])
        bounds = [0]
        for i in range(count):
            bounds.append(bounds[-1] + ends[count + i] - ends[i])
        self.check_run(run_values, bounds)
        pooled = self.run_kernel(run_values, run_lengths, run_weights)
        # features adjacent in both the kernel output and the output are copied as one block
        src = self.lf_local_col[0]
        dst = self.lf_out_col[0]
        width = self.lf_dim[0]
        for i in range(1, count):
            if self.lf_local_col[i] == src + width and self.lf_out_col[i] == dst + width:
                width += self.lf_dim[i]
            else:
                out[first:last, dst : dst + width].copy_(pooled[:, src : src + width])
                src = self.lf_local_col[i]
                dst = self.lf_out_col[i]
                width = self.lf_dim[i]
        out[first:last, dst : dst + width].copy_(pooled[:, src : src + width])
        return pooled

    def row_blocks_of_bucket(
        self, rw_values: Tensor, rw_lengths: Tensor, rw_weights: Tensor | None, rw_starts: list[int], batch: int
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """This device's row-wise shards (kernel order) out of the collection's bucketized input: views, no copy."""
        out_v: list[Tensor] = []
        out_l: list[Tensor] = []
        out_w: list[Tensor] = []
        for i in self.row_block_entries:
            slot = self.bucket * self.rw_feature_count + self.rw_slot[i]
            out_v.append(rw_values[rw_starts[slot] : rw_starts[slot + 1]])
            out_l.append(rw_lengths[slot * batch : (slot + 1) * batch])
            if rw_weights is not None:
                out_w.append(rw_weights[rw_starts[slot] : rw_starts[slot + 1]])
        return out_v, out_l, out_w

    def bucketize_row_blocks(
        self, values: Tensor, lengths: Tensor, weights: Tensor | None, starts: list[int], batch: int
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """Every row-wise shard of this device in one pass: its ids shifted into its row block, its bag
        lengths, its weights (per shard, in kernel order); ids outside the block are dropped."""
        blocks = self.row_block_entries
        if len(blocks) == 0:
            return [], [], []
        features = [self.lf_feature[i] for i in blocks]
        counts = [starts[f + 1] - starts[f] for f in features]
        ids = torch.cat([values[starts[f] : starts[f + 1]] for f in features])
        count_tensor = torch.tensor(counts, dtype=torch.int64, device=ids.device)
        bounds = torch.tensor([self.row_block_lo, self.row_block_hi], dtype=torch.int64, device=ids.device)
        low = torch.repeat_interleave(bounds[0], count_tensor, output_size=ids.numel())
        high = torch.repeat_interleave(bounds[1], count_tensor, output_size=ids.numel())
        keep = (ids >= low) & (ids < high)
        bag_lengths = torch.cat([lengths[f * batch : (f + 1) * batch] for f in features]).to(torch.int64)
        bag_of_id = torch.repeat_interleave(
            torch.arange(len(blocks) * batch, device=ids.device), bag_lengths, output_size=ids.numel()
        )
        kept_lengths = torch.bincount(bag_of_id[keep], minlength=len(blocks) * batch).view(len(blocks), batch)
        kept: list[int] = kept_lengths.sum(1).tolist()
        shifted = list(torch.split((ids - low.to(ids.dtype))[keep], kept))
        out_lengths = [kept_lengths[j].to(lengths.dtype) for j in range(len(blocks))]
        out_weights: list[Tensor] = []
        if weights is not None:
            picked = torch.cat([weights[starts[f] : starts[f + 1]] for f in features])[keep]
            out_weights = list(torch.split(picked, kept))
        return shifted, out_lengths, out_weights

    def check_run(self, run_values: Tensor, bounds: list[int]) -> None:
        """Range-check consecutive whole features (feature i at ``run_values[bounds[i]:bounds[i + 1]]``):
        one reduction unless an id looks out of range."""
        if run_values.numel() == 0:
            return
        low, high = torch.aminmax(run_values)
        if int(low) >= 0 and int(high) < self.min_rows:
            return
        error = first_id_error(run_values, bounds, self.lf_rows, self.lf_name)
        if error is not None:
            raise ValueError(self.request_error_prefix + error)

    def check_ids(self, ids: Tensor, rows: int, feature: str) -> None:
        error: Optional[str] = rules.id_range_error(ids, rows, feature)
        if error is not None:
            raise ValueError(self.request_error_prefix + error)

    def copy_out(self, pooled: Tensor, batch: int, out: Tensor) -> None:
        """Write whole-feature columns (merged runs) and replica rows of the kernel output into ``out``."""
        for j in range(len(self.copy_src)):
            src = self.copy_src[j]
            dst = self.copy_dst[j]
            width = self.copy_width[j]
            out[:, dst : dst + width].copy_(pooled[:, src : src + width])
        for i in range(len(self.lf_feature)):
            if self.lf_kind[i] == self.read_batch_slice:
                src = self.lf_local_col[i]
                dst = self.lf_out_col[i]
                dim = self.lf_dim[i]
                first = self.lf_lo[i] * batch // self.lf_hi[i]
                last = (self.lf_lo[i] + 1) * batch // self.lf_hi[i]
                out[first:last, dst : dst + dim].copy_(pooled[first:last, src : src + dim])

    def add_partials(self, pooled: Tensor, out: Tensor) -> None:
        """Add this device's row-wise partial sums into ``out`` (run after every device finished)."""
        for i in range(len(self.lf_feature)):
            if self.lf_kind[i] == self.read_row_block:
                src = self.lf_local_col[i]
                dst = self.lf_out_col[i]
                dim = self.lf_dim[i]
                out[:, dst : dst + dim].add_(pooled[:, src : src + dim].to(out.device))


class ShardedEmbeddingBagCollection(ValidatingCollection):
    """A plan's shards on several devices; same inputs, same output layout as the unsharded collection."""

    output_device: str
    needs_zero_init: bool
    identity_layout: bool
    partial: bool
    bucketized: bool
    rw_features: list[int]
    rw_rows: list[int]
    rw_names: list[str]
    rw_min_rows: int
    rw_positions: list[list[int]]
    rw_block_sizes: list[int]
    rw_even_blocks: bool

    def __init__(
        self, spec, shards: list[DeviceShards], output_device: str, identity_layout: bool, partial: bool = False
    ) -> None:  # type: ignore[no-untyped-def]
        """``partial``: the shards of one host of several (``infer.shard.hosts``): the output has this host's
        columns filled, zeros elsewhere, row-wise partial sums of this host only and MEAN not yet divided; the
        hosts' outputs summed, then divided by the bag lengths, are the model's output."""
        super().__init__()
        self.partial = partial
        identity_layout = identity_layout and not partial
        self._set_features(spec)
        self.checks_ids_in_validate = identity_layout  # otherwise each device checks its own ids, in parallel
        self.shards = nn.ModuleList(shards)
        self.output_device = output_device
        self.needs_zero_init = partial or any(s.has_partials for s in shards)
        # one device holding every feature whole, in input order: its kernel output is the output
        self.identity_layout = identity_layout
        self._set_row_buckets(shards)

    def _set_row_buckets(self, shards: list[DeviceShards]) -> None:
        """Bucketize every row-wise feature for all devices in one fbgemm call where ``row_buckets`` allows."""
        routings = [
            [(shard.lf_feature[i], shard.lf_kind[i], shard.lf_lo[i], shard.lf_hi[i]) for i in range(len(shard.lf_kind))]
            for shard in shards
        ]
        buckets = None if self.partial else row_buckets(routings, self.feature_rows)
        self.bucketized = buckets is not None
        self.rw_features = list(buckets.features) if buckets is not None else []
        self.rw_positions = [list(p) for p in buckets.positions] if buckets is not None else []
        self.rw_block_sizes = list(buckets.block_sizes) if buckets is not None else []
        self.rw_even_blocks = buckets is not None and buckets.even
        self.rw_rows = [self.feature_rows[f] for f in self.rw_features]
        self.rw_names = [self.feature_names[f] for f in self.rw_features]
        self.rw_min_rows = min(self.rw_rows) if self.rw_rows else 0
        for j, shard in enumerate(shards):
            shard.bucket, shard.rw_feature_count, shard.rw_slot = device_buckets(buckets, j, routings[j])

    def bucketize(
        self, values: Tensor, lengths: Tensor, weights: Tensor | None, starts: list[int], batch: int
    ) -> tuple[Tensor, Tensor, Tensor | None, list[int]]:
        """Every row-wise feature's ids, range-checked, then sorted into the devices' row blocks (shifted to
        block-local rows) by one fbgemm ``block_bucketize_sparse_features`` call: ids, bag lengths and weights
        bucket-major ([device][row-wise feature][bag]), and the first id of every (device, feature) slot."""
        features = self.rw_features
        ids = torch.cat([values[starts[f] : starts[f + 1]] for f in features])
        # int32 lengths: the kernel runs 2-3x faster than on int64 (validated lengths are <= the id count)
        bag_lengths = torch.cat([lengths[f * batch : (f + 1) * batch] for f in features])
        if ids.numel() < 2**31:
            bag_lengths = bag_lengths.to(torch.int32)
        id_weights: Tensor | None = None
        if weights is not None:
            id_weights = torch.cat([weights[starts[f] : starts[f + 1]] for f in features])
        if ids.numel() > 0:
            low, high = torch.aminmax(ids)
            if int(low) < 0 or int(high) >= self.rw_min_rows:
                bounds = [0]
                for f in features:
                    bounds.append(bounds[-1] + starts[f + 1] - starts[f])
                error = first_id_error(ids, bounds, self.rw_rows, self.rw_names)
                if error is not None:
                    raise ValueError(self.request_error_prefix + error)
        block_sizes = torch.tensor(self.rw_block_sizes, dtype=ids.dtype)
        positions: Optional[list[Tensor]] = None
        if not self.rw_even_blocks:
            positions = [torch.tensor(p, dtype=ids.dtype) for p in self.rw_positions]
        new_lengths, new_ids, new_weights, _, _ = torch.ops.fbgemm.block_bucketize_sparse_features(
            bag_lengths, ids, False, False, block_sizes, len(self.shards), id_weights, None, -1, positions
        )
        slot_ids: list[int] = [0] * (len(self.shards) * len(features))
        if batch > 0:
            ends: list[int] = new_lengths.view(-1, batch).to(torch.int64).sum(1).cumsum(0).tolist()
            slot_ids = ends
        return new_ids, new_lengths, new_weights, [0] + slot_ids

    def lookup_validated(self, values: Tensor, lengths: Tensor, weights: Tensor | None = None) -> Tensor:
        batch = lengths.numel() // self.num_features
        ends: list[int] = lengths.to(torch.int64).view(self.num_features, batch).sum(1).cumsum(0).tolist()
        starts: list[int] = [0] + ends
        if self.identity_layout:
            whole = self.shards[0].run_kernel(values, lengths, weights).to(self.output_device)  # type: ignore[operator]
            return self.apply_mean(whole, lengths)
        if self.needs_zero_init:
            out = torch.zeros(batch, self.output_dim, device=self.output_device)
        else:
            out = torch.empty(batch, self.output_dim, device=self.output_device)
        rw_values = values[:0]
        rw_lengths = lengths[:0]
        rw_weights: Tensor | None = None
        rw_starts: list[int] = [0]
        if self.bucketized:
            rw_values, rw_lengths, rw_weights, rw_starts = self.bucketize(values, lengths, weights, starts, batch)
        futures: list[torch.jit.Future[Tensor]] = []
        count = len(self.shards)
        pooled: list[Tensor] = []
        for i, shard in enumerate(self.shards):
            if i < count - 1:
                futures.append(
                    torch.jit.fork(
                        shard,
                        values,
                        lengths,
                        weights,
                        starts,
                        batch,
                        out,
                        rw_values,
                        rw_lengths,
                        rw_weights,
                        rw_starts,
                    )
                )
            else:
                # the calling thread runs the last device itself instead of idling
                pooled.append(
                    shard(values, lengths, weights, starts, batch, out, rw_values, rw_lengths, rw_weights, rw_starts)
                )
        results: list[Tensor] = [torch.jit.wait(future) for future in futures] + pooled
        if self.needs_zero_init:
            for j, device_shards in enumerate(self.shards):
                if device_shards.has_partials:
                    device_shards.add_partials(results[j], out)  # type: ignore[operator]
        if self.partial:
            return out
        return self.apply_mean(out, lengths)


class EmptyPartialCollection(ValidatingCollection):
    """The partial output of a host that holds no shard (a plan with more hosts than tables need): zeros."""

    def __init__(self, spec) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self._set_features(spec)
        self.checks_ids_in_validate = False  # the hosts holding shards check their ids
        self.shards = nn.ModuleList()  # no kernels (what the artifact's kernel checks read)

    def lookup_validated(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None) -> Tensor:
        return torch.zeros(lengths.numel() // self.num_features, self.output_dim)
