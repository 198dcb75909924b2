"""The inference planner: which device every table (or shard of one) goes to, and how it is split.

Stages (one file each, interfaces in ``types``): enumerate sharding options, estimate their storage
and cost, propose combinations, partition them onto devices; ``EmbeddingPlanner`` runs them.
"""

from infer.planner.enumerators import EmbeddingEnumerator
from infer.planner.partitioners import ExactPartitioner, GreedyPartitioner
from infer.planner.planner import EmbeddingPlanner, plan_for_inference
from infer.planner.proposers import DynamicProgrammingProposer, GreedyProposer, UniformProposer
from infer.planner.shard_estimators import InferencePerfEstimator, InferenceStorageEstimator
from infer.planner.stats import format_stats, plot_plan
from infer.planner.storage_reservations import HeuristicalStorageReservation
from infer.planner.types import (
    ComputeDevice,
    ParameterConstraints,
    Placement,
    Shard,
    ShardingPlan,
    ShardingType,
    TablePlan,
    Topology,
    load_constraints,
)
from infer.planner.utils import format_bytes, parse_bytes

__all__ = [
    "ComputeDevice",
    "DynamicProgrammingProposer",
    "EmbeddingEnumerator",
    "EmbeddingPlanner",
    "ExactPartitioner",
    "GreedyPartitioner",
    "GreedyProposer",
    "HeuristicalStorageReservation",
    "InferencePerfEstimator",
    "InferenceStorageEstimator",
    "ParameterConstraints",
    "Placement",
    "Shard",
    "ShardingPlan",
    "ShardingType",
    "TablePlan",
    "Topology",
    "UniformProposer",
    "format_bytes",
    "format_stats",
    "load_constraints",
    "parse_bytes",
    "plan_for_inference",
    "plot_plan",
]
