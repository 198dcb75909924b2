"""TorchRec import: a trained model (EmbeddingBagCollection, quantized EBC, DLRM, DMP) or its checkpoint
(state dict with any key prefix, sharded state dict, DCP folder) -> an embserve spec, tables and dense part.

torchrec is imported inside the functions that need it, so ``import infer`` stays light.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.dense_layout import PooledLayout, record_layout, recorded_layout
from infer.errors import ConfigError, WeightsError
from infer.weights import TORCHREC_TABLE_KEY, load_tensor_file, table_mismatch

if TYPE_CHECKING:
    from infer.modules.collection import EmbserveModel

logger = logging.getLogger(__name__)

# The first layer of a TorchRec DLRM's dense arch: its input width is the number of dense features.
_DLRM_DENSE_INPUT_KEY = re.compile(r"(?:^|\.)dense_arch\.model\._mlp\.0\._linear\.weight$")

_SUPPORTED = (
    "torchrec.modules.embedding_modules.EmbeddingBagCollection (float), "
    "torchrec.quant.embedding_modules.EmbeddingBagCollection (quantize_dynamic), "
    "their DistributedModelParallel-sharded form, and the DLRM family (DLRM, DLRM_DCN, DLRM_Projection)"
)


@dataclass(frozen=True)
class QuantizedRows:
    """One table's rows taken from a quantized TorchRec EBC, in the TBE layout, byte for byte:
    ``data`` uint8 ``[rows, data bytes]`` and ``scale_bias`` uint8 ``[rows, 4]`` (None for FP16/FP32)."""

    data: torch.Tensor
    scale_bias: torch.Tensor | None
    data_type: DataType


@dataclass(frozen=True)
class ImportedModel:
    """What ``from_torchrec`` found: the spec (with the dense part attached when the model has one),
    fp32 tables, and for tables of a quantized EBC their stored rows (used as they are by ``quantize``)."""

    spec: ModelSpec
    weights: Mapping[str, torch.Tensor]
    dense_arch: nn.Module | None = None
    quantized_rows: Mapping[str, QuantizedRows] = field(default_factory=dict)

    @property
    def dense_layout(self) -> PooledLayout | None:
        """The pooled layout the dense part reads (the model's feature order, columns and pooling), recorded on
        ``dense_arch`` so that export refuses a spec that differs; None without a dense part."""
        return recorded_layout(self.dense_arch)

    def quantize(
        self,
        data_type: DataType | str | None = None,
        overrides: Mapping[str, DataType | str] | None = None,
        *,
        device: torch.device | str = "cpu",
    ) -> EmbserveModel:
        """``infer.quantize`` of the imported tables (data types changed as in ``ModelSpec.with_data_types``).

        Tables that came quantized keep their TorchRec bytes exactly when their data type is unchanged;
        asked for another type, they are re-quantized from their dequantized values (logged).
        """
        from infer.quant.quantize import quantize

        spec = self.spec.with_data_types(data_type, overrides)
        model = quantize(spec, self.weights, device=device)
        kept = {
            name: rows for name, rows in self.quantized_rows.items() if spec.table(name).data_type == rows.data_type
        }
        for name in sorted(set(self.quantized_rows) - set(kept)):
            logger.info(
                "table %s: re-quantized from its dequantized %s rows to %s",
                name,
                self.quantized_rows[name].data_type.value,
                spec.table(name).data_type.value,
            )
        if kept:
            embeddings: Any = model.embeddings
            targets = embeddings.table_weights()
            with torch.no_grad():
                for table, (data, scale_bias) in zip(spec.tables, targets):
                    rows = kept.get(table.name)
                    if rows is None:
                        continue
                    data.copy_(rows.data)
                    if scale_bias is not None and rows.scale_bias is not None:
                        scale_bias.copy_(rows.scale_bias)
        return model


# ---------------------------------------------------------------------------------------------- models


def from_torchrec(model: nn.Module, data_type: DataType | str | None = None) -> ImportedModel:
    """Import the one ``EmbeddingBagCollection`` of a TorchRec ``model`` (or the EBC itself).

    Float EBCs give fp32 tables (served as ``data_type``, default INT8); a quantized EBC
    (``quantize_dynamic`` -> ``torchrec.quant.embedding_modules.EmbeddingBagCollection``) gives its stored
    rows and their data types, used bit for bit. Tables sharded by ``DistributedModelParallel`` (ShardedTensor
    or DTensor) are gathered collectively: every rank must call this, and every rank gets the full tables.
    For ``torchrec.models.dlrm.DLRM``/``DLRM_DCN``/``DLRM_Projection`` the spec carries the scriptable dense part.
    """
    _require_torchrec()
    root = _unwrap(model)
    name, module = _find_collection(root)
    configs = list(module.embedding_bag_configs() if hasattr(module, "embedding_bag_configs") else [])
    if not configs:
        configs = list(getattr(module, "_embedding_bag_configs", []))
    if not configs:
        raise ConfigError(f"module {name or type(module).__name__!r} has no embedding bag configs")
    quantized = _is_quantized(module)
    tables = tuple(_table_config(cfg, quantized, data_type, name) for cfg in configs)
    weights: dict[str, torch.Tensor] = {}
    rows: dict[str, QuantizedRows] = {}
    if quantized:
        from infer.quant.rowwise import dequantize_rows

        rows = _quantized_rows(module, {t.name: t.data_type for t in tables})
        for table in tables:
            stored = rows[table.name]
            weights[table.name] = dequantize_rows(
                stored.data, stored.scale_bias, table.data_type, table.embedding_dim
            ).contiguous()
    else:
        state = module.state_dict()
        for table in tables:
            weights[table.name] = _full_tensor(state[f"embedding_bags.{table.name}.weight"], table.name)
    spec = ModelSpec(tables)
    dense_arch = None
    dlrm = _find_dlrm(root)
    if dlrm is not None:
        from infer.interop.dlrm import dlrm_dense_arch

        dense_arch, num_dense, order = dlrm_dense_arch(dlrm)
        if order != spec.feature_names:
            raise ConfigError(
                f"the DLRM reads its sparse features in the order {list(order)} but its EmbeddingBagCollection "
                f"outputs {list(spec.feature_names)}; embserve keeps the collection's order"
            )
        # the dense part reads the pooled columns in the model's order and pooling: record them with it
        record_layout(dense_arch, PooledLayout.of_spec(spec))
        spec = spec.with_dense_arch(dense_arch, num_dense)
    logger.info(
        "imported %d tables from %s%s%s",
        len(tables),
        name or type(module).__name__,
        " (quantized rows kept)" if quantized else "",
        " with the DLRM dense part" if dense_arch is not None else "",
    )
    return ImportedModel(spec, weights, dense_arch, rows)


def _require_torchrec() -> None:
    try:
        import torchrec  # noqa: F401
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"{err}; infer.from_torchrec needs the torchrec extra: pip install 'embserve[torchrec]' "
            "(torchrec==1.8.0 with --no-deps next to fbgemm-gpu-cpu, see the Makefile)"
        ) from None


def _unwrap(model: nn.Module) -> nn.Module:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    while isinstance(model, DistributedModelParallel):
        model = model.module
    return model


def _unsupported_types() -> dict[type, str]:
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import (
        ManagedCollisionEmbeddingBagCollection,
        ManagedCollisionEmbeddingCollection,
    )
    from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

    return {
        EmbeddingCollection: "EmbeddingCollection (unpooled sequence embeddings)",
        QuantEmbeddingCollection: "quantized EmbeddingCollection (unpooled sequence embeddings)",
        ShardedEmbeddingCollection: "sharded EmbeddingCollection (unpooled sequence embeddings)",
        FeatureProcessedEmbeddingBagCollection: "FeatureProcessedEmbeddingBagCollection (feature processors)",
        ManagedCollisionEmbeddingBagCollection: "ManagedCollisionEmbeddingBagCollection (managed collision)",
        ManagedCollisionEmbeddingCollection: "ManagedCollisionEmbeddingCollection (managed collision)",
    }


def _collection_types() -> tuple[type, ...]:
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

    return (EmbeddingBagCollection, QuantEmbeddingBagCollection, ShardedEmbeddingBagCollection)


def _find_collection(root: nn.Module) -> tuple[str, Any]:
    unsupported = _unsupported_types()
    supported = _collection_types()
    found: list[tuple[str, Any]] = []
    for name, module in root.named_modules():
        for kind, what in unsupported.items():
            if isinstance(module, kind):
                raise ConfigError(
                    f"module {name or '<root>'!r} is a {what}, which embserve does not serve; supported: {_SUPPORTED}"
                )
        if isinstance(module, supported):
            found.append((name, module))
    if not found:
        raise ConfigError(f"{type(root).__name__} holds no EmbeddingBagCollection; supported: {_SUPPORTED}")
    if len(found) > 1:
        names = [n or "<root>" for n, _ in found]
        raise ConfigError(
            f"the model holds {len(found)} EmbeddingBagCollections ({names}); embserve serves one: "
            "merge their tables into one collection, or import each sub-module separately"
        )
    return found[0]


def _find_dlrm(root: nn.Module) -> nn.Module | None:
    from torchrec.models.dlrm import DLRM

    for module in root.modules():
        if isinstance(module, DLRM):
            return module
    return None


def _is_quantized(module: nn.Module) -> bool:
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

    return isinstance(module, QuantEmbeddingBagCollection)


def _table_config(cfg: Any, quantized: bool, data_type: DataType | str | None, module: str) -> TableConfig:
    from torchrec.modules.embedding_configs import PoolingType as TorchRecPooling

    pooling = {TorchRecPooling.SUM: PoolingType.SUM, TorchRecPooling.MEAN: PoolingType.MEAN}.get(cfg.pooling)
    if pooling is None:
        raise ConfigError(f"table {cfg.name!r}: pooling {cfg.pooling.name} is not served; use SUM or MEAN")
    if getattr(cfg, "num_embeddings_post_pruning", None) is not None:
        raise ConfigError(
            f"table {cfg.name!r} of {module or '<root>'!r} is pruned (num_embeddings_post_pruning); "
            f"embserve imports unpruned tables: {_SUPPORTED}"
        )
    if quantized:
        stored = cfg.data_type.name.lower()
        try:
            dtype = DataType(stored)
        except ValueError:
            raise ConfigError(
                f"table {cfg.name!r}: quantized data type {cfg.data_type.name} is not served; "
                "use INT8, INT4, INT2, FP16 or FP32"
            ) from None
    else:
        dtype = DataType.parse(data_type) if data_type is not None else DataType.INT8
    return TableConfig(
        cfg.name, int(cfg.num_embeddings), int(cfg.embedding_dim), tuple(cfg.feature_names), pooling, dtype
    )


def _quantized_rows(module: Any, data_types: Mapping[str, DataType]) -> dict[str, QuantizedRows]:
    """Every table's stored bytes from the quantized EBC's TBEs (one TBE per pooling type)."""
    out: dict[str, QuantizedRows] = {}
    for configs, tbe in zip(module._key_to_tables.values(), module._emb_modules):
        for cfg, (data, scale_bias) in zip(configs, tbe.split_embedding_weights()):
            out[cfg.name] = QuantizedRows(
                data.detach().cpu().clone(),
                None if scale_bias is None else scale_bias.detach().cpu().clone(),
                data_types[cfg.name],
            )
    return out


def _full_tensor(weight: Any, table: str) -> torch.Tensor:
    """A table's full tensor; ShardedTensor and DTensor values are gathered onto every rank (collective)."""
    import torch.distributed as dist

    if dist.is_available():
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        from torch.distributed.tensor import DTensor

        if isinstance(weight, ShardedTensor):
            blocks = [(shard.tensor, tuple(shard.metadata.shard_offsets)) for shard in weight.local_shards()]
            return _assemble(tuple(weight.size()), weight.dtype, blocks, getattr(weight, "_process_group", None))
        if isinstance(weight, DTensor):
            local = weight.to_local()
            if hasattr(local, "local_shards") and hasattr(local, "local_offsets"):
                # TorchRec's DTensors hold a LocalShardsWrapper: row-/table-wise blocks with their offsets
                blocks = [(t, tuple(o)) for t, o in zip(local.local_shards(), local.local_offsets())]
                return _assemble(tuple(weight.shape), weight.dtype, blocks, weight.device_mesh.get_group())
            return weight.full_tensor().detach().cpu()
    if not isinstance(weight, torch.Tensor):
        raise WeightsError(f"table {table!r}: weight is a {type(weight).__name__}, expected a tensor")
    return weight.detach().cpu()


def _assemble(
    shape: tuple[int, ...], dtype: torch.dtype, blocks: list[tuple[torch.Tensor, tuple[int, ...]]], group: Any
) -> torch.Tensor:
    """The full table from every rank's blocks: each rank writes its own into zeros and all ranks sum. Every
    element lives on exactly one rank, so the sum is the table, exactly."""
    import torch.distributed as dist

    full = torch.zeros(shape, dtype=dtype)
    for block, offsets in blocks:
        if block.numel() == 0:
            continue
        rows, cols = block.shape
        full[offsets[0] : offsets[0] + rows, offsets[1] : offsets[1] + cols].copy_(block.detach().cpu())
    dist.all_reduce(full, group=group)
    return full


# ---------------------------------------------------------------------------------------------- files


def load_torchrec_checkpoint(source: str | Path | Mapping[str, Any], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """``{table: fp32 tensor}`` for every table of ``spec`` from a TorchRec checkpoint.

    ``source`` is a ``torch.save``d state dict (memory-mapped), a torch.distributed.checkpoint (DCP) folder
    (read without a process group; only the tables are read), or an in-memory state dict (ShardedTensor and
    DTensor values are gathered collectively). Keys match on ``embedding_bags.<table>.weight`` whatever their
    prefix. Tables the spec lacks or the checkpoint lacks are listed together in one ``WeightsError``.
    """
    from infer.weights import check_weights

    if isinstance(source, Mapping):
        origin = "the state dict"
        tables = match_tables(list(source), spec, origin)
        weights = {name: _full_tensor(source[key], name) for name, key in tables.items()}
    else:
        path = Path(source)
        origin = str(path)
        if path.is_dir():
            weights = _read_dcp(path, spec)
        elif path.is_file():
            state = _torch_load(path)
            tables = match_tables(list(state), spec, origin)
            weights = {name: _full_tensor(state[key], name) for name, key in tables.items()}
        else:
            raise WeightsError(f"TorchRec checkpoint {origin!r} does not exist (a state dict file or a DCP folder)")
    try:
        check_weights(spec, weights)
    except WeightsError as err:
        raise WeightsError(f"{origin}: {err}") from None
    return weights


def spec_from_checkpoint(source: str | Path) -> ModelSpec:
    """A starting spec from a TorchRec checkpoint: one table per ``embedding_bags.<table>.weight`` with its
    shape, a feature named like the table, INT8, and its pooling not stated (``"pooling": null``: a state dict
    does not record it, and export refuses to guess); ``num_dense_features`` from a DLRM's dense arch when the
    checkpoint has one. State each table's pooling, edit feature names and data types before exporting.

    A pickled TorchRec module (``torch.save(model)``) gives the whole spec instead: its ``EmbeddingBagConfig``
    tables, features and pooling (stated), read as data without running the file (``infer.interop.pickled``)."""
    path = Path(source)
    all_shapes: dict[str, tuple[int, ...]] = {}
    if path.is_dir():
        all_shapes = {key: shape for key, (shape, _) in dcp_tensors(path).items()}
    elif path.is_file():
        try:
            state = _torch_load(path)
        except WeightsError:
            pickled = _spec_from_pickled_module(path)
            if pickled is None:
                raise
            return pickled
        all_shapes = {key: tuple(value.shape) for key, value in state.items() if hasattr(value, "shape")}
    else:
        raise WeightsError(f"TorchRec checkpoint {str(path)!r} does not exist (a state dict file or a DCP folder)")
    shapes: dict[str, tuple[int, ...]] = {}
    num_dense = 0
    for key, shape in all_shapes.items():
        found = TORCHREC_TABLE_KEY.search(key)
        if found:
            shapes.setdefault(found["table"], shape)
        elif _DLRM_DENSE_INPUT_KEY.search(key) and len(shape) == 2:
            num_dense = int(shape[1])
    if not shapes:
        raise WeightsError(f"{str(path)!r} holds no 'embedding_bags.<table>.weight' entries; is it a TorchRec model?")
    tables = []
    for name, shape in shapes.items():
        if len(shape) != 2:
            raise WeightsError(f"{str(path)!r}: table {name!r} has shape {list(shape)}; expected [rows, dim]")
        tables.append(TableConfig(name, int(shape[0]), int(shape[1]), (name,), pooling_stated=False))
    return ModelSpec(tuple(tables), num_dense)


def _spec_from_pickled_module(path: Path) -> ModelSpec | None:
    """The spec a pickled TorchRec module states (its configs read without running it), or None when the file
    holds none."""
    from infer.interop.pickled import read_pickled_model

    model = read_pickled_model(path)
    if model is None:
        return None
    poolings = {"SUM": PoolingType.SUM, "MEAN": PoolingType.MEAN}
    tables = []
    for table in model.tables:
        if table.pooling not in poolings:
            raise ConfigError(f"table {table.name!r}: pooling {table.pooling} is not served; use SUM or MEAN")
        tables.append(
            TableConfig(
                table.name, table.num_embeddings, table.embedding_dim, table.feature_names, poolings[table.pooling]
            )
        )
    logger.info("%s: %d tables read from the pickled %s (not run)", path, len(tables), model.root)
    return ModelSpec(tuple(tables), model.num_dense_features)


def _torch_load(path: Path) -> Mapping[str, Any]:
    data = load_tensor_file(path, "TorchRec checkpoint")
    if isinstance(data, Mapping) and "state_dict" in data and isinstance(data["state_dict"], Mapping):
        data = data["state_dict"]  # a training checkpoint {"state_dict": ..., "optimizer": ...}
    if not isinstance(data, Mapping):
        raise WeightsError(f"{str(path)!r} holds a {type(data).__name__}; expected a state dict")
    return data


def match_tables(keys: list[str], spec: ModelSpec, origin: str) -> dict[str, str]:
    """``{table: state dict key}``; missing and unknown tables in one error."""
    by_table: dict[str, list[str]] = {}
    for key in keys:
        found = TORCHREC_TABLE_KEY.search(key)
        if found:
            by_table.setdefault(found["table"], []).append(key)
    names = [t.name for t in spec.tables]
    missing = [n for n in names if n not in by_table]
    extra = sorted(n for n in by_table if n not in names)
    if missing or extra:
        raise WeightsError(
            f"{origin}: the checkpoint's tables do not match the spec: {table_mismatch(missing, extra)}; "
            f"keys are matched on 'embedding_bags.<table>.weight' (the spec has {names}); "
            "rename the spec's tables or write a spec with `embserve spec --from-torchrec`"
        )
    duplicated = {n: by_table[n] for n in names if len(by_table[n]) > 1}
    if duplicated:
        raise WeightsError(f"{origin}: tables found under several prefixes {duplicated}; keep one collection")
    return {n: by_table[n][0] for n in names}


def dcp_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # noqa: BLE001 - a missing or corrupt .metadata
        raise WeightsError(f"{str(path)!r} is not a readable DCP checkpoint (its .metadata): {err}") from None
    return {
        key: (tuple(meta.size), meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }


def _read_dcp(path: Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Read only the spec's tables from a DCP folder, without a process group."""
    tensors = dcp_tensors(path)
    tables = match_tables(list(tensors), spec, str(path))
    for table in spec.tables:
        shape, dtype = tensors[tables[table.name]]
        expected = (table.num_embeddings, table.embedding_dim)
        if shape != expected or not dtype.is_floating_point:
            raise WeightsError(
                f"{str(path)!r}: table {table.name!r} is stored as {dtype} {list(shape)}; the spec's "
                f"[num_embeddings, embedding_dim] = {list(expected)} (floating point)"
            )
    state = read_dcp_tensors(path, {key: tensors[key] for key in tables.values()})
    return {name: state[key] for name, key in tables.items()}


def read_dcp_tensors(path: Path, wanted: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """The tensors ``wanted`` (key -> stored shape and dtype) read from a DCP folder without a process group; the
    folder's other entries are not read."""
    import torch.distributed.checkpoint as dcp

    state = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in wanted.items()}
    try:
        with warnings.catch_warnings():
            # reading without a process group is the point; DCP warns that it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
    except Exception as err:  # noqa: BLE001 - DCP wraps reader failures in several types
        raise WeightsError(f"cannot read the tables from DCP checkpoint {str(path)!r}: {err}") from None
    return state
