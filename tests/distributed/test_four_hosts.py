"""Four "hosts" (four processes on 127.0.0.1, gloo) serving by ids all-to-all: outputs of table-, row-, column-wise
and mixed plans against fp32 ``embedding_bag`` on the dequantized tables, and every follower receiving only the
ids its shards own (bytes counted by the exchange, expected counted by hand from the plan)."""

from __future__ import annotations

import pytest
import torch

from infer.artifact.hosts import export_hosts
from infer.features import SparseFeatures
from infer.planner.types import ShardingType
from server.group.leader import COMBINE_ALL_TO_ALL, HEADER_SIZE
from tests.conftest import random_batch
from tests.distributed.conftest import NUM_DENSE, host_plan, run_group
from tests.support.call_contract import Reference, assert_matches

HOSTS = 4
PLANS = ("table", "row", "column", "mixed")


def _batches(spec):
    batches = []
    for seed in range(3):
        batch = random_batch(spec, batch_size=6 + 5 * seed, max_len=6, weighted=seed == 1, seed=200 + seed)
        dense = torch.randn(batch.batch_size, NUM_DENSE, generator=torch.Generator().manual_seed(seed))
        batches.append(
            {"keys": list(batch.keys), "values": batch.values, "lengths": batch.lengths, "weights": batch.weights,
             "dense": dense}
        )  # fmt: skip
    return batches


def _owned_ids(spec, plan, batch, host: int) -> tuple[int, int]:
    """By hand: (ids, features) host ``host`` needs of ``batch``: every id of a feature whose table has a
    shard on the host, or for row-wise tables only the ids inside the host's row blocks."""
    shards = {t.table: t for t in plan.tables}
    size = batch["lengths"].numel() // len(spec.features)
    ids, features, start = 0, 0, 0
    for index, info in enumerate(spec.features):
        count = int(batch["lengths"][index * size : (index + 1) * size].sum())
        feature_ids = batch["values"][start : start + count]
        start += count
        table_plan = shards[info.table]
        mine = [s for s in table_plan.shards if s.device == host]
        if not mine:
            continue
        features += 1
        if table_plan.sharding_type == ShardingType.ROW_WISE:
            ids += sum(int(((feature_ids >= s.row_offset) & (feature_ids < s.row_offset + s.num_rows)).sum())
                       for s in mine)  # fmt: skip
        else:
            ids += count
    return ids, features


@pytest.mark.slow
def test_four_hosts_match_fp32_reference_and_move_only_owned_ids(quantized, tmp_path):
    spec = quantized.spec
    plans = {kind: host_plan(spec, kind, HOSTS) for kind in PLANS}
    artifacts = {kind: str(export_hosts(quantized, tmp_path / kind, plan)) for kind, plan in plans.items()}
    batches = _batches(spec)
    torch.save(batches, tmp_path / "batches.pt")
    job = {"artifacts": artifacts, "batches": str(tmp_path / "batches.pt"), "out": str(tmp_path / "out.pt"),
           "timeout_s": 60, "combines": [COMBINE_ALL_TO_ALL]}  # fmt: skip
    run_group(job, HOSTS, tmp_path, timeout_s=300)
    results = torch.load(tmp_path / "out.pt")
    reference = Reference(spec, quantized)
    for kind in PLANS:
        for batch, (pooled, scores) in zip(batches, results[(kind, COMBINE_ALL_TO_ALL)]):
            features = SparseFeatures(tuple(batch["keys"]), batch["values"], batch["lengths"], batch["weights"])
            want = reference.pooled(features)
            assert_matches(pooled, want)
            with torch.no_grad():  # TinyOverArch gives one score per example
                assert_matches(scores, spec.dense_arch(batch["dense"], want).reshape(-1))
    for host in range(1, HOSTS):
        received = torch.load(f"{tmp_path / 'out.pt'}.rank{host}")
        for kind, plan in plans.items():
            want = 0
            for batch in batches:
                ids, features = _owned_ids(spec, plan, batch, host)
                size = batch["lengths"].numel() // len(spec.features)
                per_forward = (HEADER_SIZE + HOSTS) * 8 + ids * 4 + features * size * 4
                per_forward += ids * 4 if batch["weights"] is not None else 0
                want += 2 * per_forward  # a lookup and a predict per batch
            assert received[kind] == want, (kind, host, received[kind], want)
