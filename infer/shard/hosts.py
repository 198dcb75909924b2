"""One host's part of a plan that spans several hosts: the shards of its ranks, in one process.

A plan's topology groups its ranks into hosts (``local_world_size`` devices each; rank r lives on host
r // local_world_size, device r % local_world_size). Host h's part is a sharded collection of only its ranks,
built with ``partial=True``: its output has its own columns filled and zeros elsewhere, and row-wise partial
sums and MEAN features not yet finished. The sum of every host's output, divided for MEAN features by the bag
lengths (``finish_partial``), is the one-process model's output.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from infer.config import ModelSpec, PoolingType
from infer.errors import ConfigError, PlanError, PlanErrorKind
from infer.modules.collection import EmbserveModel, QuantizedEmbeddingBagCollection, placed_dense_arch
from infer.modules.sharded import EmptyPartialCollection, ShardedEmbeddingBagCollection
from infer.planner.types import ShardingPlan
from infer.shard.builder import DeviceLayout, build_device_shards, check_plan, device_layouts, kernel_table_weights

logger = logging.getLogger(__name__)


def num_hosts(plan: ShardingPlan) -> int:
    topology = plan.topology
    return topology.world_size // topology.local_world_size


def host_of_rank(plan: ShardingPlan, rank: int) -> int:
    return rank // plan.topology.local_world_size


def local_device(plan: ShardingPlan, rank: int) -> str:
    """The torch device of plan rank ``rank`` on its own host: ``cpu``, or ``cuda:<local rank>``."""
    topology = plan.topology
    return f"cuda:{rank % topology.local_world_size}" if topology.is_cuda else "cpu"


def host_layouts(spec: ModelSpec, plan: ShardingPlan, host: int) -> list[DeviceLayout]:
    """The device layouts (``device_layouts``) of host ``host``'s ranks, in rank order."""
    hosts = num_hosts(plan)
    if not 0 <= host < hosts:
        raise PlanError(f"host {host} is outside the plan's {hosts} hosts", PlanErrorKind.INVALID_PLAN)
    return [layout for layout in device_layouts(spec, plan) if host_of_rank(plan, layout.rank) == host]


def shard_host(
    model: EmbserveModel, plan: ShardingPlan, host: int, device_map: Mapping[str, str] | None = None
) -> EmbserveModel:
    """Host ``host``'s part of ``model`` (from ``infer.quantize``) sharded by ``plan``: its shards only, a partial
    output (see the module docstring), and the dense part on host 0 alone (rank 0 finishes the output)."""
    spec = model.spec
    source = model.embeddings
    if not isinstance(source, QuantizedEmbeddingBagCollection):
        raise ConfigError(
            f"shard_host takes the unsharded model returned by infer.quantize(), got one whose embeddings are "
            f"{type(source).__name__}; quantize the tables first"
        )
    check_plan(spec, plan)
    mapping = dict(device_map or {})
    source_weights = kernel_table_weights(source)
    shards = []
    for layout in host_layouts(spec, plan, host):
        device = local_device(plan, layout.rank)
        shards.append(build_device_shards(spec, layout, mapping.get(device, device), source_weights))
        for table in shards[-1].block_table_names:  # a block table lies on one device of one host, with its remap
            shards[-1].set_block_remap(table, source.block_ranks(table))
    output_device = mapping.get(local_device(plan, host * plan.topology.local_world_size), "cpu")
    collection: torch.nn.Module = ShardedEmbeddingBagCollection(spec, shards, output_device, False, partial=True)
    if not shards:
        collection = EmptyPartialCollection(spec)
    logger.debug("host %d: %d devices with shards", host, len(shards))
    dense_arch = placed_dense_arch(model.dense_arch, output_device) if host == 0 and model.has_dense else None
    return EmbserveModel(spec, collection, dense_arch)


def finish_partial(spec: ModelSpec, summed: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The model's pooled output from the sum of every host's partial output: MEAN features divided by their
    bag lengths (an empty bag stays zero), in place."""
    features = spec.features
    batch = lengths.numel() // len(features) if features else 0
    counts: torch.Tensor | None = None
    for index, feature in enumerate(features):
        if feature.pooling != PoolingType.MEAN:
            continue
        if counts is None:
            counts = lengths.view(len(features), batch).to(device=summed.device, dtype=summed.dtype).clamp(min=1.0)
        summed[:, feature.column_start : feature.column_end].div_(counts[index].unsqueeze(1))
    return summed
