"""Sharded quantized models: a plan's shards placed on the devices of one host and run in parallel."""
