"""Sharded quantized models: a plan's shards placed on the devices of one host and run in parallel."""

from infer.shard.builder import check_plan, plan_devices, shard_model
from infer.shard.plans import make_plan

__all__ = ["check_plan", "make_plan", "plan_devices", "shard_model"]
