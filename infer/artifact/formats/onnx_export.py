"""The quantized model as a standard ONNX graph (``model.onnx``), and its dense part alone (``dense.onnx``).

ONNX has no embedding-bag op, so the graph spells one out with standard ops (opset 18, CPU kernels
in onnxruntime): per feature, slice its ids, gather the stored rows, dequantize them in the graph,
weight them and pool every bag. Tables stay in the TBE's bytes: INT8/INT4/INT2 codes as UINT8
initializers ``[rows, packed bytes]`` beside the rows' fp16 ``[scale, bias]`` ``[rows, 2]`` (the 4
bytes in front of every TBE row), FP16/FP32 tables as FP16/FP32. Every table lives in one external
data file, ``model.onnx.data``, so a table set over 2 GB exports like a small one.

Graph contract: inputs ``values`` INT64 [N], ``lengths`` INT32 [F*B] (feature-major, the TorchScript
forward's layout), ``weights`` FP32 [N] (optional: an overridable initializer of one 1.0 stands in
for it), ``dense_features`` FP32 [B, n] when there is a dense part; outputs ``embeddings`` FP32
[B, output_dim] in input feature order and ``scores`` when there is a dense part. Batch and N are
dynamic. Ids are not range-checked in the graph (``Gather`` would read a negative id from the table's
end): the onnxruntime backend validates every request first, like the TorchScript model does.

Pooling designs (``POOLINGS``), measured by ``bench/onnx.py``: ``padded`` (default) gathers each
feature's ids into a ``[B, max_len]`` grid, masks the padding through the weights and pools with one
batched MatMul of the per-id ``weight x scale`` against the codes (``padded_reduce``: Mul + ReduceSum
instead); ``prefix_sum`` dequantizes the ``[n, D]`` rows, takes FP64 prefix sums and subtracts them at
the bag ends; ``scatter`` adds the rows into their bags with ``ScatterND(reduction='add')``. Also tried
and dropped: one initializer of whole TBE rows (scale/bias bytes decoded to fp16 in the graph, one
Gather instead of two): the decode's extra ops cost more than the second Gather saved (W64, W128).
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infer import request_rules as rules
from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.errors import ArtifactError, ArtifactErrorKind, ConfigError
from infer.quant.rowwise import SCALE_BIAS_BYTES, row_data_bytes

logger = logging.getLogger(__name__)

OPSET = 18
IR_VERSION = 9  # opset 18's IR; onnxruntime 1.32 reads up to 11
ONNX_MODEL_FILE = "model.onnx"
ONNX_DATA_FILE = "model.onnx.data"
DENSE_ONNX_FILE = "dense.onnx"
POOLINGS = ("padded", "padded_reduce", "prefix_sum", "scatter")
DEFAULT_POOLING = "padded"
# Initializers at least this large go to the external data file; big ones start on a page boundary
# (memory-mappable), small ones on 64 bytes so small test tables do not grow by padding.
_EXTERNAL_MIN_BYTES = 1024
_PAGE_ALIGN_MIN_BYTES = 1 << 20
_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class TableBytes:
    """One whole table in the TBE's bytes: codes/values ``[rows, bytes]`` and INT scale/bias ``[rows, 4]``."""

    config: TableConfig
    data: torch.Tensor
    scale_bias: torch.Tensor | None


@dataclass(frozen=True)
class OnnxExport:
    """What ``export_onnx`` wrote: file names and the facts the manifest records."""

    model_file: str
    data_files: tuple[str, ...]
    dense_file: str | None
    pooling: str
    source_world_size: int


def _require_onnx() -> Any:
    try:
        import onnx
        import onnx.checker
        import onnx.helper
        import onnx.numpy_helper
    except ImportError as err:
        raise ConfigError(
            f"ONNX export needs the onnx package ({err}); install the extra: pip install 'embserve[onnx]'"
        ) from None
    return onnx


# ---------------------------------------------------------------------------------------------- tables
def model_tables(model: torch.nn.Module) -> list[TableBytes]:
    """Every table of ``model`` (unsharded, or sharded: reassembled from its shards) in spec order.

    A sharded model is exported from its own shards rather than from an unsharded source: the model
    handed to ``export`` is the only thing export has, and the shards hold the same bytes (a column
    slice keeps each row's scale and bias; replicas are copies).
    """
    from infer.modules.collection import QuantizedEmbeddingBagCollection

    spec: ModelSpec = model.spec  # type: ignore[assignment]
    embeddings: torch.nn.Module = model.embeddings  # type: ignore[assignment]
    if isinstance(embeddings, QuantizedEmbeddingBagCollection):
        pairs = embeddings.table_weights()
        tables = []
        for table, (data, scale_bias) in zip(spec.tables, pairs):
            data = data[:, : row_data_bytes(table.embedding_dim, table.data_type)]
            tables.append(TableBytes(table, data.cpu(), scale_bias.cpu() if scale_bias is not None else None))
        return tables
    return _reassemble_shards(spec, embeddings)


def _reassemble_shards(spec: ModelSpec, embeddings: torch.nn.Module) -> list[TableBytes]:
    """Put every table back together from the devices' TBEs: rows from row blocks, columns from slices."""
    from infer.modules.sharded import READ_ROW_BLOCK

    by_name = {t.name: t for t in spec.tables}
    features = spec.features
    full: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    covered: dict[str, torch.Tensor] = {}
    for table in spec.tables:
        width = row_data_bytes(table.embedding_dim, table.data_type)
        data = torch.zeros(table.num_embeddings, width, dtype=torch.uint8)
        scale_bias = None
        if table.data_type.is_integer:
            scale_bias = torch.zeros(table.num_embeddings, SCALE_BIAS_BYTES, dtype=torch.uint8)
        full[table.name] = (data, scale_bias)
        covered[table.name] = torch.zeros(table.num_embeddings, table.embedding_dim, dtype=torch.bool)
    for device in embeddings.shards:  # type: ignore[union-attr]
        tbe = device.tbe
        split = tbe.split_embedding_weights()
        feature_table_map = list(tbe.feature_table_map)
        placed: set[int] = set()
        for local_feature, local_table in enumerate(feature_table_map):
            if local_table in placed:
                continue  # a second feature reading the same shard
            placed.add(local_table)
            info = features[device.lf_feature[local_feature]]
            table = by_name[info.table]
            row_offset = device.lf_lo[local_feature] if device.lf_kind[local_feature] == READ_ROW_BLOCK else 0
            col_offset = device.lf_out_col[local_feature] - info.column_start
            num_cols = device.lf_dim[local_feature]
            shard_data, shard_scale_bias = split[local_table]
            rows = slice(row_offset, row_offset + shard_data.shape[0])
            first = row_data_bytes(col_offset, table.data_type)
            last = row_data_bytes(col_offset + num_cols, table.data_type)
            data, scale_bias = full[table.name]
            data[rows, first:last] = shard_data[:, : last - first].cpu()
            if scale_bias is not None and shard_scale_bias is not None:
                scale_bias[rows] = shard_scale_bias.cpu()
            covered[table.name][rows, col_offset : col_offset + num_cols] = True
    missing = [name for name, mask in covered.items() if not bool(mask.all())]
    if missing:
        raise ConfigError(f"the sharded model's shards do not cover table(s) {missing}; re-shard from the full model")
    return [TableBytes(t, *full[t.name]) for t in spec.tables]


def tbe_weight_bytes(tables: Sequence[TableBytes]) -> int:
    """Bytes of the tables as the CPU TBE stores them (rows with scale/bias, no padding)."""
    return sum(t.data.numel() + (t.scale_bias.numel() if t.scale_bias is not None else 0) for t in tables)


# ---------------------------------------------------------------------------------------------- graph
class _Graph:
    """A small node writer: unique names, constants, and the initializers bound for external data."""

    def __init__(self, onnx: Any) -> None:
        self.onnx = onnx
        self.helper = onnx.helper
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.external: dict[str, np.ndarray] = {}
        self._count = 0
        self._constants: dict[tuple[Any, ...], str] = {}

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def op(self, op_type: str, inputs: Sequence[str], hint: str | None = None, **attrs: Any) -> str:
        out = self.name(hint or op_type.lower())
        self.nodes.append(self.helper.make_node(op_type, list(inputs), [out], name=f"n_{out}", **attrs))
        return out

    def const(self, values: Any, dtype: Any) -> str:
        array = np.asarray(values, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            name = self.name("const")
            self.initializers.append(self.onnx.numpy_helper.from_array(array, name))
            self._constants[key] = name
        return self._constants[key]

    def branch(self, build: Callable[[], str]) -> Any:
        """A subgraph (``If`` branch) of the nodes ``build`` adds; it reads outer names and returns one FP32."""
        outer, self.nodes = self.nodes, []
        try:
            out = build()
            value = self.helper.make_tensor_value_info(out, self.onnx.TensorProto.FLOAT, None)
            return self.helper.make_graph(self.nodes, self.name("branch"), [], [value])
        finally:
            self.nodes = outer

    def table(self, name: str, array: np.ndarray) -> str:
        self.external[name] = array
        return name


def _lut(bits: int) -> np.ndarray:
    """``[256, 8 // bits]`` fp32: the codes packed in one byte, lowest bits first (the TBE's order)."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    byte = np.arange(256, dtype=np.int64)[:, None]
    return ((byte >> (np.arange(per_byte) * bits)) & mask).astype(np.float32)


def _table_initializers(g: _Graph, table: TableBytes) -> tuple[str, str | None]:
    """The table's initializers: (codes or values, fp16 [scale, bias] or None). Views of the TBE's
    weights, not copies: a table set over 2 GB is written to the data file in chunks."""
    data = table.data.numpy()
    dtype = table.config.data_type
    name = table.config.name
    if dtype == DataType.FP32:
        return g.table(f"table.{name}.fp32", data.view(np.float32)), None
    if dtype == DataType.FP16:
        return g.table(f"table.{name}.fp16", data.view(np.float16)), None
    assert table.scale_bias is not None
    scale_bias = table.scale_bias.numpy().view(np.float16)  # [rows, 2]: scale, bias
    return g.table(f"table.{name}.codes", data), g.table(f"table.{name}.scale_bias", scale_bias)


def _dequantized(g: _Graph, table: TableBytes, codes: str, dim: int) -> str:
    """fp32 codes (INT types) or values (FP types) of gathered rows ``[..., bytes]`` -> ``[..., dim]``."""
    dtype = table.config.data_type
    if dtype == DataType.FP32:
        return codes
    if dtype in (DataType.FP16, DataType.INT8):
        return g.op("Cast", [codes], to=g.onnx.TensorProto.FLOAT)
    index = g.op("Cast", [codes], to=g.onnx.TensorProto.INT32)  # Gather indexes with int32/int64 only
    unpacked = g.op("Gather", [g.const(_lut(dtype.bits), np.float32), index], axis=0)  # [..., bytes, per_byte]
    return g.op("Reshape", [unpacked, g.const([0, 0, dim], np.int64)])


@dataclass(frozen=True)
class _FeatureInputs:
    ids: str  # INT64 [n_f]
    weights: str  # FP32 [n_f]
    lengths: str  # INT64 [B]
    begin: str  # INT64 [1]: the feature's first id in ``values``
    end: str  # INT64 [1]
    is_weighted: str  # BOOL scalar: the request carries one weight per id


def _pool_padded(
    g: _Graph, table: TableBytes, init: tuple[str, str | None], f: _FeatureInputs, matmul: bool = True
) -> str:
    """``[B, max_len]`` grid of the feature's ids; padding gets weight 0; one batched MatMul pools
    (or, ``matmul=False``, a Mul and a ReduceSum over the grid's length axis)."""
    onnx = g.onnx
    dim = table.config.embedding_dim
    lengths = f.lengths
    longest = g.op("ReduceMax", [g.op("Concat", [lengths, g.const([0], np.int64)], axis=0)], keepdims=0)
    steps = g.op("Range", [g.const(0, np.int64), longest, g.const(1, np.int64)])  # [L]
    starts = g.op("CumSum", [lengths, g.const(0, np.int64)], exclusive=1)  # [B]
    grid = g.op("Add", [g.op("Unsqueeze", [starts, g.const([1], np.int64)]), steps])  # [B, L]
    inside = g.op("Less", [steps, g.op("Unsqueeze", [lengths, g.const([1], np.int64)])])  # [B, L]
    grid = g.op("Where", [inside, grid, g.const(0, np.int64)])
    ids = g.op("Gather", [f.ids, grid], axis=0)  # [B, L]
    # unweighted requests (the 1.0 default: fewer weights than ids) skip gathering the weights
    weighted = g.branch(
        lambda: g.op(
            "Where",
            [
                inside,
                g.op("Gather", [g.op("Slice", ["weights", f.begin, f.end]), grid], axis=0),
                g.const(0.0, np.float32),
            ],
        )
    )
    unweighted = g.branch(lambda: g.op("Cast", [inside], to=onnx.TensorProto.FLOAT))
    weights = g.op("If", [f.is_weighted], then_branch=weighted, else_branch=unweighted)
    weights3 = g.op("Unsqueeze", [weights, g.const([2], np.int64)])  # [B, L, 1]
    data, scale_bias = init
    rows = _dequantized(g, table, g.op("Gather", [data, ids], axis=0), dim)  # [B, L, D]
    if scale_bias is None:
        if not matmul:
            return g.op("ReduceSum", [g.op("Mul", [rows, weights3]), g.const([1], np.int64)], keepdims=0)
        factors = g.op("Unsqueeze", [weights, g.const([1], np.int64)])  # [B, 1, L]
        return g.op("Squeeze", [g.op("MatMul", [factors, rows]), g.const([1], np.int64)])
    sb = g.op("Cast", [g.op("Gather", [scale_bias, ids], axis=0)], to=onnx.TensorProto.FLOAT)  # [B, L, 2]
    scale = g.op("Slice", [sb, g.const([0], np.int64), g.const([1], np.int64), g.const([2], np.int64)])
    bias = g.op("Slice", [sb, g.const([1], np.int64), g.const([2], np.int64), g.const([2], np.int64)])
    if matmul:
        factors = g.op("Transpose", [g.op("Mul", [scale, weights3])], perm=[0, 2, 1])  # [B, 1, L]
        pooled = g.op("Squeeze", [g.op("MatMul", [factors, rows]), g.const([1], np.int64)])  # [B, D]
    else:
        scaled = g.op("Mul", [rows, g.op("Mul", [scale, weights3])])
        pooled = g.op("ReduceSum", [scaled, g.const([1], np.int64)], keepdims=0)
    bias_sum = g.op("ReduceSum", [g.op("Mul", [bias, weights3]), g.const([1], np.int64)], keepdims=0)  # [B, 1]
    return g.op("Add", [pooled, bias_sum])


def _weighted_rows(g: _Graph, table: TableBytes, init: tuple[str, str | None], f: _FeatureInputs) -> str:
    """``[n_f, D]`` fp32: every id's dequantized row times its weight."""
    dim = table.config.embedding_dim
    data, scale_bias = init
    ids2 = g.op("Unsqueeze", [f.ids, g.const([1], np.int64)])  # [n, 1]: keeps the LUT reshape rank 3
    rows = _dequantized(g, table, g.op("Gather", [data, ids2], axis=0), dim)  # [n, 1, D]
    rows = g.op("Squeeze", [rows, g.const([1], np.int64)])  # [n, D]
    weights2 = g.op("Unsqueeze", [f.weights, g.const([1], np.int64)])  # [n, 1]
    if scale_bias is None:
        return g.op("Mul", [rows, weights2])
    sb = g.op("Cast", [g.op("Gather", [scale_bias, f.ids], axis=0)], to=g.onnx.TensorProto.FLOAT)  # [n, 2]
    scale = g.op("Slice", [sb, g.const([0], np.int64), g.const([1], np.int64), g.const([1], np.int64)])
    bias = g.op("Slice", [sb, g.const([1], np.int64), g.const([2], np.int64), g.const([1], np.int64)])
    return g.op("Add", [g.op("Mul", [rows, g.op("Mul", [scale, weights2])]), g.op("Mul", [bias, weights2])])


def _pool_prefix_sum(g: _Graph, table: TableBytes, init: tuple[str, str | None], f: _FeatureInputs) -> str:
    """FP64 prefix sums of the weighted rows, read at the bag ends: pooled = P[end] - P[start]."""
    onnx = g.onnx
    dim = table.config.embedding_dim
    rows = g.op("Cast", [_weighted_rows(g, table, init, f)], to=onnx.TensorProto.DOUBLE)
    prefix = g.op("CumSum", [rows, g.const(0, np.int64)])
    prefix = g.op("Concat", [g.const(np.zeros((1, dim)), np.float64), prefix], axis=0)  # [n + 1, D]
    ends = g.op("CumSum", [f.lengths, g.const(0, np.int64)])
    starts = g.op("Sub", [ends, f.lengths])
    pooled = g.op("Sub", [g.op("Gather", [prefix, ends], axis=0), g.op("Gather", [prefix, starts], axis=0)])
    return g.op("Cast", [pooled], to=onnx.TensorProto.FLOAT)


def _pool_scatter(g: _Graph, table: TableBytes, init: tuple[str, str | None], f: _FeatureInputs) -> str:
    """``ScatterND(reduction='add')`` of the weighted rows into ``[B, D]`` zeros (bag of every id by CumSum)."""
    dim = table.config.embedding_dim
    rows = _weighted_rows(g, table, init, f)
    num_ids = g.op("Shape", [f.ids])  # [1]
    ends = g.op("CumSum", [f.lengths, g.const(0, np.int64)])  # [B]
    marks = g.op("ConstantOfShape", [g.op("Add", [num_ids, g.const([1], np.int64)])], value=_int64_tensor(g, 0))
    ones = g.op("Expand", [g.const([1], np.int64), g.op("Shape", [ends])])
    marks = g.op("ScatterElements", [marks, ends, ones], axis=0, reduction="add")  # bags ending at each position
    bag_of_id = g.op("CumSum", [g.op("Slice", [marks, g.const([0], np.int64), num_ids]), g.const(0, np.int64)])
    shape = g.op("Concat", [g.op("Shape", [f.lengths]), g.const([dim], np.int64)], axis=0)
    zeros = g.op("ConstantOfShape", [shape], value=g.onnx.numpy_helper.from_array(np.zeros(1, np.float32)))
    index = g.op("Unsqueeze", [bag_of_id, g.const([1], np.int64)])
    return g.op("ScatterND", [zeros, index, rows], reduction="add")


def _int64_tensor(g: _Graph, value: int) -> Any:
    return g.onnx.numpy_helper.from_array(np.array([value], dtype=np.int64))


def _pool_padded_reduce(g: _Graph, table: TableBytes, init: tuple[str, str | None], f: _FeatureInputs) -> str:
    return _pool_padded(g, table, init, f, matmul=False)


_POOLERS = {
    "padded": _pool_padded,
    "padded_reduce": _pool_padded_reduce,
    "prefix_sum": _pool_prefix_sum,
    "scatter": _pool_scatter,
}


def build_embedding_graph(
    spec: ModelSpec, tables: Sequence[TableBytes], pooling: str = DEFAULT_POOLING
) -> tuple[Any, dict[str, np.ndarray]]:
    """The ``values, lengths, weights -> embeddings`` graph and its table arrays (bound for external data)."""
    onnx = _require_onnx()
    if pooling not in _POOLERS:
        raise ConfigError(f"unknown ONNX pooling design {pooling!r}; choose one of {list(POOLINGS)}")
    helper = onnx.helper
    g = _Graph(onnx)
    num_features = len(spec.features)
    inits = {t.config.name: _table_initializers(g, t) for t in tables}
    by_name = {t.config.name: t for t in tables}
    lengths = g.op("Cast", ["lengths"], to=onnx.TensorProto.INT64)
    per_bag = g.op("Reshape", [lengths, g.const([num_features, -1], np.int64)])  # [F, B]
    totals = g.op("ReduceSum", [per_bag, g.const([1], np.int64)], keepdims=0)  # [F]
    ends = g.op("CumSum", [totals, g.const(0, np.int64)])
    starts = g.op("Sub", [ends, totals])
    # weights default to one 1.0 (an overridable initializer): Expand gives [N] either way
    weights = g.op("Expand", ["weights", g.op("Shape", ["values"])])
    is_weighted = g.op("Equal", [g.op("Size", ["weights"]), g.op("Size", ["values"])])
    pooled: list[str] = []
    for index, info in enumerate(spec.features):
        at = g.const([index], np.int64)
        begin = g.op("Slice", [starts, at, g.const([index + 1], np.int64)])
        end = g.op("Slice", [ends, at, g.const([index + 1], np.int64)])
        feature = _FeatureInputs(
            ids=g.op("Slice", ["values", begin, end], hint=f"ids_{info.name}"),
            weights=g.op("Slice", [weights, begin, end]),
            begin=begin,
            end=end,
            is_weighted=is_weighted,
            lengths=g.op("Gather", [per_bag, g.const(index, np.int64)], axis=0),
        )
        table = by_name[info.table]
        out = _POOLERS[pooling](g, table, inits[info.table], feature)
        if info.pooling == PoolingType.MEAN:
            counts = g.op("Max", [g.op("Cast", [feature.lengths], to=onnx.TensorProto.FLOAT), g.const(1.0, np.float32)])
            out = g.op("Div", [out, g.op("Unsqueeze", [counts, g.const([1], np.int64)])])
        pooled.append(out)
    g.nodes.append(helper.make_node("Concat", pooled, ["embeddings"], name="n_embeddings", axis=1))
    g.initializers.append(onnx.numpy_helper.from_array(np.ones(1, np.float32), "weights"))
    inputs = [
        helper.make_tensor_value_info("values", onnx.TensorProto.INT64, ["num_ids"]),
        helper.make_tensor_value_info("lengths", onnx.TensorProto.INT32, ["num_bags"]),
        helper.make_tensor_value_info("weights", onnx.TensorProto.FLOAT, ["num_weights"]),
    ]
    outputs = [helper.make_tensor_value_info("embeddings", onnx.TensorProto.FLOAT, ["batch", spec.output_dim])]
    graph = helper.make_graph(g.nodes, "embserve_embeddings", inputs, outputs, g.initializers)
    return graph, g.external


# ---------------------------------------------------------------------------------------------- dense part
class _Scores(torch.nn.Module):
    """A dense part whose output follows the call contract (``rules.scores_of``: ``[B, 1]`` squeezed)."""

    def __init__(self, dense_arch: torch.nn.Module) -> None:
        super().__init__()
        self.dense_arch = dense_arch

    def forward(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return rules.scores_of(self.dense_arch(dense_features, pooled), pooled.shape[0])


def export_dense(dense_arch: torch.nn.Module, num_dense: int, output_dim: int, path: Path) -> Any:
    """``dense.onnx`` (inputs ``dense_features``, ``pooled``; output ``scores``) by torch.onnx's TorchScript-based
    exporter (dynamo=False: the dynamo exporter needs onnxscript, which the extra does not carry).

    Any form of dense part exports: an eager module, a scripted one (``torch.jit.script``, as docs/torchrec.md writes
    ``dense.pt``), a loaded TorchScript file, or an eager module holding scripted parts. The wrapper is traced
    with ``torch.jit.trace`` first and the traced module handed to torch.onnx: torch.onnx's own trace of an eager
    wrapper refuses a ScriptModule called inside it ("not part of the active trace"), while a trace by
    ``torch.jit.trace`` records the call and torch.onnx inlines the scripted graph, control flow included.
    """
    onnx = _require_onnx()
    example = (torch.zeros(2, num_dense), torch.zeros(2, output_dim))
    # the model itself stays where it is; scores leave the graph float32 [B], as every backend's predict
    module = _Scores(copy.deepcopy(dense_arch).cpu().eval())
    try:
        with warnings.catch_warnings(), torch.no_grad():
            # torch 2.13 warns that this exporter is the legacy one; it is the one that needs no onnxscript.
            # The trace's shape guards (scores_of's checks) are Python: export probed this dense part already.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            # a traced module's forward has no Python signature; torch.onnx says so and goes on
            warnings.filterwarnings("ignore", "no signature found", UserWarning)
            traced = torch.jit.trace(module, example, check_trace=False)
            torch.onnx.export(
                traced,
                example,
                str(path),
                dynamo=False,
                opset_version=OPSET,
                input_names=["dense_features", "pooled"],
                output_names=["scores"],
                dynamic_axes={"dense_features": {0: "batch"}, "pooled": {0: "batch"}, "scores": {0: "batch"}},
            )
    except Exception as err:  # noqa: BLE001 - torch.onnx raises many error types
        raise ConfigError(
            f"the dense part ({type(dense_arch).__name__}) cannot be exported to ONNX: {_first_line(err)}; an eager "
            "module, a torch.jit.script module or a TorchScript file exports when torch.onnx (opset "
            f"{OPSET}, dynamo=False) supports every op it calls: rewrite that op, or export without --onnx"
        ) from None
    return onnx.load(str(path))


def _first_line(err: BaseException) -> str:
    """torch.onnx puts the reason first and the whole graph after it."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _merge_dense(graph: Any, dense: Any) -> None:
    """Append the dense graph to ``graph``: its ``pooled`` input becomes ``embeddings``; names get a ``dense/``
    prefix except the ``dense_features`` input and the ``scores`` output."""
    onnx = _require_onnx()
    keep = {"dense_features", "scores", ""}

    def rename(name: str) -> str:
        if name == "pooled":
            return "embeddings"
        return name if name in keep else f"dense/{name}"

    for node in dense.graph.node:
        moved = onnx.NodeProto()
        moved.CopyFrom(node)
        moved.name = f"dense/{node.name}"
        moved.input[:] = [rename(n) for n in node.input]
        moved.output[:] = [rename(n) for n in node.output]
        graph.node.append(moved)
    for tensor in dense.graph.initializer:
        weight = onnx.TensorProto()
        weight.CopyFrom(tensor)
        weight.name = rename(tensor.name)
        graph.initializer.append(weight)
    for value in dense.graph.input:
        if value.name == "dense_features":
            graph.input.append(value)
    for value in dense.graph.output:
        graph.output.append(value)


# ---------------------------------------------------------------------------------------------- files
def _externalize(model: Any, arrays: dict[str, np.ndarray], folder: Path, location: str) -> None:
    """Write ``arrays`` and every initializer of at least ``_EXTERNAL_MIN_BYTES`` into ``folder/location``."""
    onnx = _require_onnx()
    graph = model.graph

    def point(tensor: Any, offset: int, length: int) -> None:
        del tensor.external_data[:]
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        tensor.data_location = onnx.TensorProto.EXTERNAL

    with (folder / location).open("wb") as handle:

        def write(array: np.ndarray) -> tuple[int, int]:
            align = 4096 if array.nbytes >= _PAGE_ALIGN_MIN_BYTES else 64
            offset = -handle.tell() % align
            handle.write(b"\0" * offset)
            start = handle.tell()
            rows_per_chunk = max(1, _CHUNK_BYTES // max(1, array.nbytes // max(1, len(array))))
            for first in range(0, max(1, len(array)), rows_per_chunk):
                np.ascontiguousarray(array[first : first + rows_per_chunk]).tofile(handle)
            return start, array.nbytes

        for tensor in graph.initializer:
            if tensor.HasField("raw_data") and len(tensor.raw_data) >= _EXTERNAL_MIN_BYTES:
                array = onnx.numpy_helper.to_array(tensor)
                offset, length = write(array)
                tensor.ClearField("raw_data")
                point(tensor, offset, length)
        for name, array in arrays.items():
            tensor = onnx.TensorProto()
            tensor.name = name
            tensor.dims.extend(array.shape)
            tensor.data_type = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
            offset, length = write(array)
            point(tensor, offset, length)
            graph.initializer.append(tensor)


def export_onnx(
    model: torch.nn.Module,
    folder: Path,
    pooling: str = DEFAULT_POOLING,
    source_world_size: int = 1,
) -> OnnxExport:
    """Write ``model.onnx`` + ``model.onnx.data`` (and ``dense.onnx`` when there is a dense part) into ``folder``."""
    onnx = _require_onnx()
    spec: ModelSpec = model.spec  # type: ignore[assignment]
    tables = model_tables(model)
    graph, arrays = build_embedding_graph(spec, tables, pooling)
    dense_file: str | None = None
    if bool(model.has_dense):  # type: ignore[union-attr]
        dense_file = DENSE_ONNX_FILE
        dense = export_dense(model.dense_arch, spec.num_dense_features, spec.output_dim, folder / DENSE_ONNX_FILE)  # type: ignore[arg-type]
        _merge_dense(graph, dense)
    onnx_model = onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="embserve",
        doc_string="embserve embedding-bag model: tables in TBE row bytes, dequantized and pooled in the graph",
    )
    _externalize(onnx_model, arrays, folder, ONNX_DATA_FILE)
    onnx.save_model(onnx_model, str(folder / ONNX_MODEL_FILE))
    try:
        onnx.checker.check_model(str(folder / ONNX_MODEL_FILE))
    except onnx.checker.ValidationError as err:
        raise ArtifactError(
            f"{ONNX_MODEL_FILE} fails onnx.checker: {err}", path=ONNX_MODEL_FILE, kind=ArtifactErrorKind.MODEL
        ) from None
    logger.debug("wrote %s (%d tables, pooling %s)", folder / ONNX_MODEL_FILE, len(tables), pooling)
    return OnnxExport(ONNX_MODEL_FILE, (ONNX_DATA_FILE,), dense_file, pooling, source_world_size)


def onnx_versions() -> dict[str, str | None]:
    """Versions of onnx (needed to export) and onnxruntime (to run; None when not installed here)."""
    import importlib.metadata

    versions: dict[str, str | None] = {}
    for dist in ("onnx", "onnxruntime"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions
