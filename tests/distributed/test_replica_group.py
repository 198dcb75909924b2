"""``--replicas 2`` on 3 "hosts" (processes on 127.0.0.1, gloo): served outputs on every front end equal fp32
``embedding_bag`` on the dequantized tables (each table's ids go to exactly one replica: a second one would add
its columns twice), and a host killed with SIGKILL under load: the survivors re-form a 2-member group without
restarting and answer every call correctly, then stop cleanly."""

from __future__ import annotations

import signal

import pytest
import torch
from grpc_health.v1 import health_pb2

from infer.artifact.hosts import export_hosts
from infer.planner.replicas import place_replicas
from infer.quant.quantize import dequantized_weights
from infer.reference import FloatEmbeddingBagCollection
from server.client import EmbserveClient
from server.group.members import REFORMED_LINE
from tests.conftest import random_batch
from tests.distributed.conftest import host_plan
from tests.distributed.test_serving import SharedGroup, _Group, _health, _Load
from tests.support.call_contract import assert_matches

HOSTS = 3
REPLICAS = 2
LOST_HOST_OPTIONS = ("--failure-grace-s", "3")


@pytest.fixture(scope="module")
def replica_artifacts(quantized, tmp_path_factory):
    """kind -> a 3-host artifact whose plan holds every host's shards on the next host too."""
    root = tmp_path_factory.mktemp("replicas")
    return {
        kind: export_hosts(quantized, root / kind, place_replicas(host_plan(quantized.spec, kind, HOSTS), REPLICAS))
        for kind in ("table", "row")
    }


@pytest.fixture(scope="module")
def fp32_reference(quantized):
    return FloatEmbeddingBagCollection(quantized.spec, dequantized_weights(quantized.spec, quantized))


def _shared_group(artifact, folder):
    """A replicated group the module's tests share (each start costs a torch import and a part load per host):
    it serves the fp32 check, then is taken by the lost-host test that loses a host (or stopped at the
    module's end: SIGTERM to host 1, every host exits 0, drained, no stack trace)."""
    shared = SharedGroup(lambda: _Group(artifact, HOSTS, folder, *LOST_HOST_OPTIONS), 1)
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def table_group(replica_artifacts, tmp_path_factory):
    """The table-wise replicated group (``_shared_group``): lost-host [dies] takes it."""
    yield from _shared_group(replica_artifacts["table"], tmp_path_factory.mktemp("table"))


@pytest.fixture(scope="module")
def row_group(replica_artifacts, tmp_path_factory):
    """The row-wise replicated group (``_shared_group``): lost-host [hangs] takes it."""
    yield from _shared_group(replica_artifacts["row"], tmp_path_factory.mktemp("row"))


@pytest.mark.parametrize("kind", ["table", "row"])
def test_replicated_plan_serves_the_fp32_reference_on_every_front_end(fp32_reference, quantized, request, kind):
    """Every front end's Lookup equals fp32 ``embedding_bag``; SIGTERM to host 1 then stops every host with exit
    0 (the groups are the module's: that stop is ``_shared_group``'s, unless a lost-host test took the group)."""
    spec = quantized.spec
    batches = [random_batch(spec, batch_size=3 + 4 * i, weighted=i % 2 == 1, seed=600 + i) for i in range(3)]
    shared = request.getfixturevalue(f"{kind}_group")
    group = shared.use()
    for port in group.ports:
        with EmbserveClient(f"127.0.0.1:{port}") as client:
            for batch in batches:
                got = client.lookup(batch)
                with torch.inference_mode():
                    want = fp32_reference(batch)
                assert float(want.abs().max()) > 0, (kind, port)
                assert_matches(got, want)
    shared.use()  # every host still runs


@pytest.mark.parametrize(
    "signum, kind, stopped", [(signal.SIGKILL, "table", 0), (signal.SIGSTOP, "row", 1)], ids=["dies", "hangs"]
)
def test_a_lost_host_the_survivors_reform_and_serve_every_call(fp32_reference, quantized, request, signum, kind,
                                                                   stopped):  # fmt: skip
    """SIGKILL to host 2 of the table-wise group (or SIGSTOP: a hang, noticed by the collective timeout, of the
    row-wise one; host 0 holds the store) while 6 clients call hosts 0 and 1: both survivors print that the group
    re-formed with members [0, 1], every call before, during and after is answered OK and equals the reference
    (the failed step's callers are retried in the new group, new calls wait for it), health stays SERVING, and
    SIGTERM to host ``stopped`` then stops both survivors with exit 0."""
    spec = quantized.spec
    batches = [random_batch(spec, batch_size=6, weighted=i % 2 == 0, seed=700 + i) for i in range(3)]
    with torch.inference_mode():
        expected = [fp32_reference(b) for b in batches]
    # the module's group (it served the fp32 check first, when that ran), or a new one
    group = request.getfixturevalue(f"{kind}_group").take()
    try:
        survivors = group.ports[:2]
        load = _Load(survivors, batches, expected, clients=6)
        load.wait_for_ok(20)
        group.processes[2].send_signal(signum)
        for rank in (0, 1):
            line = group.readers[rank].wait_for(REFORMED_LINE, timeout=120)
            assert "members [0, 1]" in line and "lost [2]" in line, line
        after_reform = load.outcomes["OK"]
        load.wait_for_ok(after_reform + 40)  # the re-formed group answers on both front ends
        assert not load.outcomes.keys() - {"OK"}, load.outcomes
        for port in survivors:
            assert _health(port) == health_pb2.HealthCheckResponse.SERVING
            with EmbserveClient(f"127.0.0.1:{port}") as client:
                assert_matches(client.lookup(batches[0]), expected[0])
        load.join(30)
        assert set(load.outcomes) == {"OK"} and load.wrong == 0, load.outcomes
        group.processes[stopped].send_signal(signal.SIGTERM)
        assert [group.processes[r].wait(timeout=60) for r in (0, 1)] == [0, 0], (group.stderr(0), group.stderr(1))
        for rank in (0, 1):
            assert "every rank drained" in group.stderr(rank) and "Traceback" not in group.stderr(rank)
    finally:
        group.kill()
