"""One rank of a test group (run as a subprocess with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, like torchrun
sets them): for each artifact of the job, load this host's part and serve rank 0's forwards; rank 0 runs the
job's batches through a ``Runtime`` on ``server.group.leader.DistributedModel`` (ids all-to-all, then the
broadcast designs: partials combined by reduce, then by gather) and saves the outputs."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from infer.artifact.hosts import load_host_part
from infer.artifact.runtime import Runtime
from infer.features import SparseFeatures
from server.group.exchange import Exchange
from server.group.leader import (
    COMBINE_ALL_TO_ALL,
    COMBINE_GATHER,
    COMBINE_REDUCE,
    JOINED_LINE,
    DistributedModel,
    GroupConfig,
    follow,
    join_group,
)
from server.group.routing import group_routing

COMBINES = (COMBINE_ALL_TO_ALL, COMBINE_REDUCE, COMBINE_GATHER)


def main(job_path: str) -> int:
    job = json.loads(open(job_path).read())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batches = torch.load(job["batches"])
    joined = False
    results = {}
    received: dict[str, int] = {}  # a follower's bytes received per artifact (all-to-all forwards)
    for name, artifact in job["artifacts"].items():
        part = load_host_part(artifact, rank)
        if not joined:
            device = join_group(part, rank, world_size, job["timeout_s"])
            print(f"{JOINED_LINE} {rank}", flush=True)
            joined = True
        if rank != 0:
            exchange = Exchange(group_routing(part.manifest.spec, part.plan), rank, device)
            if follow(part, device, exchange) != 0:
                return 1
            received[name] = exchange.bytes_received
            continue
        for combine in job.get("combines", COMBINES):  # the followers read the mode from each header
            config = GroupConfig(collective_timeout_s=job["timeout_s"], combine=combine)
            model = DistributedModel(part, config, device)
            runtime = Runtime(part.path, part.manifest, model)  # type: ignore[arg-type]
            outputs = []
            for batch in batches:
                features = SparseFeatures(tuple(batch["keys"]), batch["values"], batch["lengths"], batch["weights"])
                pooled = runtime.lookup(features)
                scores = runtime.predict(features, batch["dense"]) if part.manifest.has_dense else None
                outputs.append((pooled, scores))
            results[(name, combine)] = outputs
        if not model.stop_group():
            return 1
    if rank == 0:
        torch.save(results, job["out"])
    else:
        torch.save(received, f"{job['out']}.rank{rank}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
