"""Scriptable modules of a served model: the TBE-backed embedding-bag collection and its wrapper.

Their ``forward`` takes plain tensors ``(values, lengths, weights)`` so TorchScript hosts (Python
or C++) call them without embserve. Every input is validated inside the module before the kernel
sees it; validation failures raise with ``REQUEST_ERROR_PREFIX`` and the wording of ``request_rules``.
"""

from typing import Final, List, Optional, Tuple

import torch
from torch import Tensor, nn

from infer import request_rules as rules
from infer.config import DataType, ModelSpec, PoolingType
from infer.modules.tbe import KernelRunner, first_id_error, make_tbe


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
        if weights is not None:
            refused_weights = rules.tensor_error("weights", weights, 1)
            if refused_weights is not None:
                raise ValueError(self._request_error(refused_weights))
            if weights.numel() != values.numel():
                raise ValueError(self._request_error(rules.weights_count(weights.numel(), values.numel())))
        if self.checks_ids_in_validate:
            self.validate_ids(values, lengths)

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
    """The kernel's features as (feature, block), block-major: every feature's first block (or whole table) in
    feature order, whose pooled columns are then the output's, then each further block of the block tables' features."""
    counts = [len(spec.table(f.table).stored_blocks) for f in spec.features]
    return [(f, j) for j in range(max(counts)) for f in range(len(counts)) if j < counts[f]]


class QuantizedEmbeddingBagCollection(ValidatingCollection, KernelRunner):
    """All tables of one device in one fbgemm ``IntNBitTableBatchedEmbeddingBagsCodegen``.

    The kernel pools with SUM and emits fp32; MEAN features are divided by their bag lengths
    afterwards, so SUM and MEAN tables share the single kernel call.

    A table held in precision blocks (``TableConfig.blocks``) is one TBE table per block, in the same kernel
    (fbgemm takes a type per table). Its id remap (``block_remaps``: id -> rank, an int32 permutation of the
    table's rows) puts the rank-``r`` row in the block whose rank range holds ``r``; a feature of that table is
    one kernel feature per block, each fed the bag's ids that fall in its block, and the blocks' pooled sums are
    added into the feature's columns (MEAN: then divided by the full bag length).
    """

    has_blocks: bool
    block_remaps: List[Tensor]
    block_starts: List[Tensor]
    feature_remap: List[int]
    feature_blocks: List[int]
    extra_features: List[int]

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
            (f"{t.name}.block{j}" if t.blocks else t.name, b.rows, t.embedding_dim, b.data_type)
            for t in spec.tables
            for j, b in enumerate(t.stored_blocks)
        ]
        self.tbe = make_tbe(
            specs,
            [kernel_tables[table_index[spec.features[f].table]][j] for f, j in kernel_features(spec)],
            torch.device(device),
            row_alignment,
            allocate,
        )
        self._set_features(spec)
        block_tables = [t for t in spec.tables if t.blocks]
        self.has_blocks = len(block_tables) > 0
        # identity until ``set_block_remap``: rank = id
        self.block_remaps = [torch.arange(t.num_embeddings, dtype=torch.int32) for t in block_tables]
        self.block_starts = [
            torch.tensor([0] + [b.rows for b in t.blocks[:-1]], dtype=torch.int64).cumsum(0) for t in block_tables
        ]
        block_slot = {t.name: i for i, t in enumerate(block_tables)}
        self.feature_remap = [block_slot.get(f.table, -1) for f in spec.features]
        self.feature_blocks = [len(kernel_tables[table_index[f.table]]) for f in spec.features]
        self.block_table_names = [t.name for t in block_tables]
        # the kernel's features past the first block of each: (feature, its output column) in kernel order
        self.extra_features = [f for f, j in kernel_features(spec) if j > 0]
        self.init_kernel_runner(sum(self.feature_blocks), str(torch.device(device)))

    @torch.jit.unused
    def set_block_remap(self, table: str, remap: Tensor) -> None:
        """Install ``table``'s id remap (id -> rank, a permutation of its rows; ``ConfigError`` otherwise)."""
        from infer.errors import ConfigError

        if table not in self.block_table_names:
            raise ConfigError(
                f"table {table!r} is not held in precision blocks; its blocks are {self.block_table_names}"
            )
        slot = self.block_table_names.index(table)
        rows = self.block_remaps[slot].numel()
        error = remap_error(remap, rows)
        if error is not None:
            raise ConfigError(f"table {table!r}: the id remap {error}; pass a permutation of [0, {rows})")
        self.block_remaps[slot] = remap.to(torch.int32).contiguous()

    def table_weights(self) -> List[Tuple[Tensor, Optional[Tensor]]]:
        """Per TBE table (a table's blocks each one, see ``tbe_tables``): the kernel's row bytes (without
        padding) and, for INT types, scale/bias bytes."""
        return self.tbe.split_embedding_weights()  # type: ignore[operator]

    def lookup_validated(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None) -> Tensor:
        """Pooled lookups of an already validated request: ``[batch, output_dim]`` fp32.

        Reached from outside only through ``EmbserveModel.lookup_unchecked`` (a host that validated already).
        """
        if not self.has_blocks:
            return self.apply_mean(self.run_kernel(values, lengths, weights), lengths)
        block_values, block_lengths, block_weights = self.split_blocks(values, lengths, weights)
        pooled = self.run_kernel(block_values, block_lengths, block_weights)
        return self.apply_mean(self.add_blocks(pooled), lengths)

    def split_blocks(
        self, values: Tensor, lengths: Tensor, weights: Optional[Tensor]
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """The kernel input of a validated request (``kernel_features`` order): each block table's ids remapped
        (one gather) and split by block, every bag once per block."""
        num_features = self.num_features
        batch = lengths.numel() // num_features
        ends: List[int] = lengths.view(num_features, batch).sum(1).cumsum(0).tolist()
        levels = max(self.feature_blocks)
        out_values: List[List[Tensor]] = [[] for _ in range(levels)]
        out_lengths: List[List[Tensor]] = [[] for _ in range(levels)]
        out_weights: List[List[Tensor]] = [[] for _ in range(levels)]
        bags = torch.arange(batch, dtype=torch.int64)
        start = 0
        for f in range(num_features):
            end = ends[f]
            ids = values[start:end]
            bag_lengths = lengths[f * batch : (f + 1) * batch]
            slot = self.feature_remap[f]
            if slot < 0:
                out_values[0].append(ids)
                out_lengths[0].append(bag_lengths)
                if weights is not None:
                    out_weights[0].append(weights[start:end])
            else:
                rank = self.block_remaps[slot][ids]
                starts: List[int] = self.block_starts[slot].tolist()
                bag = torch.repeat_interleave(bags, bag_lengths.to(torch.int64))
                count = self.feature_blocks[f]
                for j in range(count):
                    # a rank below the next block's start and (from the second block on) not below its own
                    if j + 1 < count:
                        inside = rank < starts[j + 1]
                        if j > 0:
                            inside &= rank >= starts[j]
                    else:
                        inside = rank >= starts[j]
                    local = rank[inside]
                    if j > 0:
                        local = local - starts[j]
                    out_values[j].append(local.to(values.dtype))
                    out_lengths[j].append(torch.bincount(bag[inside], minlength=batch).to(lengths.dtype))
                    if weights is not None:
                        out_weights[j].append(weights[start:end][inside])
            start = end
        flat_values: List[Tensor] = []
        flat_lengths: List[Tensor] = []
        flat_weights: List[Tensor] = []
        for j in range(levels):
            flat_values.extend(out_values[j])
            flat_lengths.extend(out_lengths[j])
            flat_weights.extend(out_weights[j])
        block_weights: Optional[Tensor] = None
        if weights is not None:
            block_weights = torch.cat(flat_weights)
        return torch.cat(flat_values), torch.cat(flat_lengths), block_weights

    def add_blocks(self, pooled: Tensor) -> Tensor:
        """``[batch, output_dim]``: the first blocks' columns (the output's layout) plus every further block's."""
        if pooled.size(1) == self.output_dim:
            return pooled
        out = pooled[:, : self.output_dim].contiguous()
        column = self.output_dim
        for f in self.extra_features:
            dim = self.feature_dims[f]
            start = self.column_starts[f]
            out[:, start : start + dim] += pooled[:, column : column + dim]
            column += dim
        return out


def remap_error(remap: Tensor, rows: int) -> Optional[str]:
    """Why ``remap`` is not a permutation of ``[0, rows)`` (1-D integer), or None."""
    if remap.dim() != 1 or remap.is_floating_point() or remap.dtype == torch.bool or remap.numel() != rows:
        return f"is {remap.dtype} of shape {list(remap.shape)}, not {rows} integer ranks"
    if rows == 0:
        return None
    ranks = remap.to(torch.int64)
    low, high = int(ranks.min()), int(ranks.max())
    if low < 0 or high >= rows:
        return f"holds rank {low if low < 0 else high}, outside [0, {rows})"
    if int(torch.bincount(ranks, minlength=rows).max()) > 1:
        return "gives two ids the same rank"
    return None


class _NoDenseArch(nn.Module):
    request_error_prefix: Final[str] = rules.REQUEST_ERROR_PREFIX

    def forward(self, dense_features: Tensor, pooled: Tensor) -> Tensor:
        raise RuntimeError(self.request_error_prefix + rules.NO_DENSE_PART)


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
