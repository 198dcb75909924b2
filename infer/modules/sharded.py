"""The scriptable sharded collection: one TBE per device, inputs routed once, outputs in input order.

Routing is fixed at build time: each device knows, for every shard it holds, which input feature it
reads and how (all ids, the ids of one row block, or one slice of the batch). At run time every
device builds its own kernel input, runs its TBE and writes its columns straight into the shared
output; devices run concurrently (``torch.jit.fork``), each CPU shard on its own core. Row-wise
partial sums are added afterwards, then MEAN features are divided by their full bag lengths, so
the output is laid out exactly like the unsharded model's.
"""

from typing import Final, Optional

import torch
from torch import Tensor, nn

from infer import request_rules as rules
from infer.modules.collection import ValidatingCollection
from infer.modules.tbe import KernelRunner, first_id_error

# How a shard reads its feature; the scripted methods read them as DeviceShards' Final attributes.
READ_ALL = 0  # table-wise and column-wise shards: every id of the feature
READ_ROW_BLOCK = 1  # row-wise: ids in [lo, hi), shifted by -lo
READ_BATCH_SLICE = 2  # replicated: bags of replica lo out of hi (lo * B // hi .. (lo + 1) * B // hi)


class DeviceShards(nn.Module, KernelRunner):
    """Every shard placed on one device, in one TBE."""

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
    ) -> None:
        """``local_features``: per TBE feature ``[feature, kind, lo, hi, out_col, dim]`` in TBE order;
        ``feature_rows``/``feature_names``: of every model feature, for the id checks."""
        super().__init__()
        self.lf_rows = [feature_rows[lf[0]] for lf in local_features]
        self.lf_name = [feature_names[lf[0]] for lf in local_features]
        self.tbe = tbe
        self.device = device
        self.init_kernel_runner(len(local_features), device)
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
        self, values: Tensor, lengths: Tensor, weights: Tensor | None, starts: list[int], batch: int, out: Tensor
    ) -> Tensor:
        """Run this device's shards; write exclusive columns into ``out``; return the kernel output."""
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
        pieces_v: list[Tensor] = []
        pieces_l: list[Tensor] = []
        pieces_w: list[Tensor] = []
        block_v, block_l, block_w = self.bucketize_row_blocks(values, lengths, weights, starts, batch)
        block = 0
        for i in range(len(self.lf_feature)):
            f = self.lf_feature[i]
            kind = self.lf_kind[i]
            ids = values[starts[f] : starts[f + 1]]
            bag_lengths = lengths[f * batch : (f + 1) * batch]
            if kind != self.read_batch_slice:  # a replica checks only its slice, below
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

    def __init__(self, spec, shards: list[DeviceShards], output_device: str, identity_layout: bool) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self._set_features(spec)
        self.checks_ids_in_validate = identity_layout  # otherwise each device checks its own ids, in parallel
        self.shards = nn.ModuleList(shards)
        self.output_device = output_device
        self.needs_zero_init = any(s.has_partials for s in shards)
        # one device holding every feature whole, in input order: its kernel output is the output
        self.identity_layout = identity_layout

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
        futures: list[torch.jit.Future[Tensor]] = []
        count = len(self.shards)
        pooled: list[Tensor] = []
        for i, shard in enumerate(self.shards):
            if i < count - 1:
                futures.append(torch.jit.fork(shard, values, lengths, weights, starts, batch, out))
            else:
                # the calling thread runs the last device itself instead of idling
                pooled.append(shard(values, lengths, weights, starts, batch, out))
        results: list[Tensor] = [torch.jit.wait(future) for future in futures] + pooled
        if self.needs_zero_init:
            for j, device_shards in enumerate(self.shards):
                if device_shards.has_partials:
                    device_shards.add_partials(results[j], out)  # type: ignore[operator]
        return self.apply_mean(out, lengths)
