"""A host loads only its part: it maps its own weight files and no other host's, and its anonymous RSS after
load is at most its part file's bytes plus the RSS of a process that loaded a tiny one-host sharded model (torch,
fbgemm, embserve, TorchScript code: the fixed cost), each measured in a fresh process.

The check uses anonymous RSS (RssAnon: heap and tensors), which a copy of any host's tables would land in; the
mapped tables are file-backed, and the file-backed part of VmRSS (shared libraries' pages too) moves by tens of
MB with the page cache of a shared machine, so VmRSS is printed but not compared."""

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
folder = str(Path(sys.argv[1]).resolve()) + "/"
rows = [line.split(None, 5) for line in Path("/proc/self/maps").read_text().splitlines()]  # the 6th field: the path
mapped = sorted({row[5][len(folder):] for row in rows if len(row) == 6 and row[5].startswith(folder)})
print(",".join(mapped))
print(rss("RssAnon"), rss("VmRSS"))  # while `loaded` is alive
"""


def _rss_after_load(artifact, which: str) -> tuple[int, int, set[str]]:
    """(RssAnon, VmRSS, the artifact's files it maps) of a fresh process right after it loaded ``artifact``
    (whole, or host ``which``'s part)."""
    out = subprocess.run(
        [sys.executable, "-c", _RSS, str(artifact), which], capture_output=True, text=True, cwd=ROOT, check=True
    )
    *_, mapped, sizes = out.stdout.strip().splitlines()
    anon, total = sizes.split()
    return int(anon), int(total), set(filter(None, mapped.split(",")))


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
    overhead, overhead_total, _ = _rss_after_load(tiny, "whole")
    manifest = Manifest.read(big_host_artifact)
    weights = [{n for n in manifest.host_files(h) if n.endswith(".bin")} for h in range(manifest.num_hosts)]
    table_bytes = [sum(manifest.file(n).bytes for n in files) for files in weights]
    assert min(table_bytes) > 2 * SLACK, table_bytes  # a copy of any host's tables would pass SLACK
    for host, part in enumerate(manifest.host_parts):
        part_bytes = manifest.file(part).bytes
        rss, total, mapped = _rss_after_load(big_host_artifact, str(host))
        print(
            f"host {host}: maps {sorted(mapped)} ({table_bytes[host] / 1e6:.1f} MB of tables); RssAnon "
            f"{rss / 1e6:.1f} MB <= part {part_bytes / 1e6:.1f} MB + tiny one-host overhead {overhead / 1e6:.1f} MB "
            f"(VmRSS {total / 1e6:.1f} MB, tiny {overhead_total / 1e6:.1f} MB)"
        )
        assert mapped == weights[host], (host, mapped, weights)  # its own tables, mapped; no other host's
        # no table is copied into anonymous memory; SLACK covers the allocator's rounding between processes
        assert rss <= part_bytes + overhead + SLACK, (host, rss, part_bytes, overhead)
