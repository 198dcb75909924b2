"""A host loads only its part: its RSS after load is at most its part's bytes plus the RSS of a process that
loaded a tiny one-host sharded model (torch, fbgemm, embserve, TorchScript code: the fixed cost), each measured
in a fresh process.

The check uses anonymous RSS (RssAnon: heap and tensors); the file-backed part of VmRSS (shared libraries'
pages) moves by tens of MB with the page cache of a shared machine, so VmRSS is printed but not compared."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from infer.artifact.export import export
from infer.artifact.hosts import export_hosts
from infer.artifact.manifest import Manifest
from infer.config import ModelSpec, TableConfig
from infer.planner.types import ComputeDevice, ShardingType, Topology
from infer.quant.quantize import quantize
from infer.shard.builder import shard_model
from infer.shard.plans import make_plan
from infer.weights import random_weights
from tests.conftest import small_spec
from tests.distributed.conftest import ROOT

SLACK = 4 << 20
_RSS = """
import sys
from pathlib import Path

def rss(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

if sys.argv[2] == "whole":
    import infer
    loaded = infer.load(sys.argv[1])
else:
    from infer.artifact.hosts import load_host_part
    loaded = load_host_part(sys.argv[1], int(sys.argv[2]))
print(rss("RssAnon"), rss("VmRSS"))  # while `loaded` is alive
"""


def _rss_after_load(artifact, which: str) -> tuple[int, int]:
    """(RssAnon, VmRSS) of a fresh process right after it loaded ``artifact`` (whole, or host ``which``'s part)."""
    out = subprocess.run(
        [sys.executable, "-c", _RSS, str(artifact), which], capture_output=True, text=True, cwd=ROOT, check=True
    )
    anon, total = out.stdout.strip().splitlines()[-1].split()
    return int(anon), int(total)


@pytest.fixture(scope="module")
def big_host_artifact(tmp_path_factory):
    """4 INT8 tables of 13.6 MB: host 0 holds three, host 1 one (the split the check must tell apart)."""
    spec = ModelSpec(tuple(TableConfig(f"t{i}", 200_000, 64, (f"f{i}",)) for i in range(4)))
    model = quantize(spec, random_weights(spec, seed=1))
    layout = {"t0": (ShardingType.TABLE_WISE, (0,)), "t1": (ShardingType.ROW_WISE, (0, 1)),
              "t2": (ShardingType.TABLE_WISE, (0,)), "t3": (ShardingType.COLUMN_WISE, (0, 1))}  # fmt: skip
    plan = make_plan(spec, 2, layout)
    plan = dataclasses.replace(plan, topology=Topology(2, ComputeDevice.CPU, local_world_size=1))
    return export_hosts(model, tmp_path_factory.mktemp("big") / "artifact", plan)


def test_host_rss_is_its_part_plus_one_host_overhead(big_host_artifact, tmp_path):
    spec = small_spec()
    tiny_plan = make_plan(
        spec, 2, {"shared": (ShardingType.TABLE_WISE, (0,)), "single": (ShardingType.TABLE_WISE, (1,))}
    )
    tiny_model = shard_model(quantize(spec, random_weights(spec)), tiny_plan)
    tiny = export(tiny_model, tmp_path / "tiny", plan=tiny_plan)
    overhead, overhead_total = _rss_after_load(tiny, "whole")
    manifest = Manifest.read(big_host_artifact)
    parts = [manifest.file(part).bytes for part in manifest.host_parts]
    for host, part_bytes in enumerate(parts):
        rss, total = _rss_after_load(big_host_artifact, str(host))
        print(
            f"host {host}: RssAnon {rss / 1e6:.1f} MB <= part {part_bytes / 1e6:.1f} MB + tiny one-host overhead "
            f"{overhead / 1e6:.1f} MB (VmRSS {total / 1e6:.1f} MB, tiny {overhead_total / 1e6:.1f} MB)"
        )
        # the load adds the part's bytes almost exactly; SLACK covers the allocator's rounding between processes
        assert rss <= part_bytes + overhead + SLACK, (host, rss, part_bytes, overhead)
        others = sum(parts) - part_bytes  # and at most half of the other hosts' bytes could be here
        assert rss < overhead + part_bytes + others / 2, (host, rss, parts, overhead)
