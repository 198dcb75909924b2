"""The inference planner: which device every table (or shard of one) goes to, and how it is split."""
