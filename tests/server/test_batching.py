"""Dynamic batching over the wire: merged requests get their own rows; full queue; deadlines and cancellation."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from server.adapters.v1 import codec
from server.client import EmbserveClient
from server.proto import inference_pb2 as pb
from tests.conftest import random_batch
from tests.server.support import CALL_TIMEOUT, NUM_DENSE, lookup_request, rpc_error, wait_until

NUM_CLIENTS = 32


def test_concurrent_clients_each_get_their_own_rows(start_server, dense_artifact, dense_runtime, spec):
    # a 100 ms batching window and a barrier: the 32 requests arrive well inside one window
    served = start_server(dense_artifact, max_delay_us=100_000, batch_wait="always")
    batches = [
        random_batch(
            spec,
            batch_size=1 + i % 7,
            weighted=i % 2 == 1,
            seed=100 + i,
            id_dtype=torch.int32 if i % 3 == 0 else torch.int64,
        )
        for i in range(NUM_CLIENTS)
    ]
    clients = [EmbserveClient(served.address, timeout=CALL_TIMEOUT) for _ in range(NUM_CLIENTS)]
    for c in clients:
        c.metadata()  # connect first, so the requests themselves leave together
    barrier = threading.Barrier(NUM_CLIENTS, timeout=CALL_TIMEOUT)

    def one(i: int) -> torch.Tensor:
        barrier.wait()
        if i % 4 == 3:  # some in the typed form, straight through the stub
            stub = served.stub()
            response = stub.Lookup(lookup_request(batches[i], typed=True), timeout=CALL_TIMEOUT)
            return codec.decode_embeddings(response)
        return clients[i].lookup(batches[i], fp16=i % 5 == 4)

    try:
        with ThreadPoolExecutor(NUM_CLIENTS) as pool:
            results = list(pool.map(one, range(NUM_CLIENTS), timeout=3 * CALL_TIMEOUT))
    finally:
        for c in clients:
            c.close()
    for i, (batch, got) in enumerate(zip(batches, results)):
        expected = dense_runtime.lookup(batch)
        if i % 4 != 3 and i % 5 == 4:
            expected = expected.to(torch.float16).to(torch.float32)
        assert torch.equal(got, expected), f"client {i} got rows that are not its own"

    # every request was in exactly one batch, and at least one batch merged several requests
    # warm-up batches run on the forward threads directly, not through the batcher: not counted here
    assert served.metric("embserve_batch_requests_sum") == NUM_CLIENTS
    batches_run = served.metric("embserve_batch_requests_count")
    single_request_batches = served.metric("embserve_batch_requests_bucket", {"le": "1.0"})
    assert single_request_batches < batches_run, "no batch merged more than one request"
    assert batches_run < NUM_CLIENTS
    examples = sum(b.batch_size for b in batches)
    assert served.metric("embserve_batch_examples_sum") == examples
    assert served.metric("embserve_requests_total", {"method": "Lookup", "code": "OK"}) == NUM_CLIENTS


def test_concurrent_predictions_are_batched_too(start_server, dense_artifact, dense_runtime, spec):
    served = start_server(dense_artifact, max_delay_us=100_000, batch_wait="always")
    stub = served.stub()
    stub.GetModelMetadata(pb.GetModelMetadataRequest(), timeout=CALL_TIMEOUT)
    generator = torch.Generator().manual_seed(3)
    cases = []
    for i in range(8):
        batch = random_batch(spec, batch_size=2 + i, weighted=i % 2 == 0, seed=200 + i)
        cases.append((batch, torch.randn(batch.batch_size, NUM_DENSE, generator=generator)))
    futures = [
        stub.Predict.future(
            pb.PredictRequest(sparse=codec.encode_packed(b), dense_features=d.numpy().tobytes()), timeout=CALL_TIMEOUT
        )
        for b, d in cases
    ]
    for (batch, dense), future in zip(cases, futures):
        scores = torch.frombuffer(bytearray(future.result().scores), dtype=torch.float32)
        torch.testing.assert_close(scores, dense_runtime.predict(batch, dense), rtol=1e-5, atol=1e-5)
    assert served.metric("embserve_batch_requests_count") < 8 + 2


def test_requests_over_the_batch_limit_together_are_split(start_server, dense_artifact, dense_runtime, spec):
    # 5-example requests against a limit of 8: never two in one batch
    served = start_server(dense_artifact, max_delay_us=50_000, max_batch_size=8, warmup_batches=0, batch_wait="always")
    stub = served.stub()
    stub.GetModelMetadata(pb.GetModelMetadataRequest(), timeout=CALL_TIMEOUT)
    batches = [random_batch(spec, batch_size=5, seed=300 + i) for i in range(4)]
    futures = [stub.Lookup.future(lookup_request(b), timeout=CALL_TIMEOUT) for b in batches]
    for batch, future in zip(batches, futures):
        assert torch.equal(codec.decode_embeddings(future.result()), dense_runtime.lookup(batch))
    assert served.metric("embserve_batch_examples_bucket", {"le": "8.0"}) == 4
    assert served.metric("embserve_batch_examples_count") == 4


def test_merging_stops_at_max_merge_examples_and_larger_requests_run_alone(
    start_server, dense_artifact, dense_runtime, spec
):
    # a merge limit of 8 under a batch limit of 64: 5-example requests never share a forward, and a
    # 20-example request (over the merge limit, under the batch limit) is served, alone
    served = start_server(
        dense_artifact,
        max_delay_us=50_000,
        max_batch_size=64,
        max_merge_examples=8,
        warmup_batches=0,
        batch_wait="always",
    )
    stub = served.stub()
    stub.GetModelMetadata(pb.GetModelMetadataRequest(), timeout=CALL_TIMEOUT)
    batches = [random_batch(spec, batch_size=5, seed=400 + i) for i in range(4)]
    batches.append(random_batch(spec, batch_size=20, seed=404))
    futures = [stub.Lookup.future(lookup_request(b), timeout=CALL_TIMEOUT) for b in batches]
    for batch, future in zip(batches, futures):
        assert torch.equal(codec.decode_embeddings(future.result()), dense_runtime.lookup(batch))
    assert served.metric("embserve_batch_examples_count") == 5
    assert served.metric("embserve_batch_examples_bucket", {"le": "8.0"}) == 4


def test_full_queue_is_resource_exhausted(start_server, gated, dense_runtime, spec):
    runtime, gate = gated
    served = start_server(runtime, max_queue=1, forward_threads=1, max_delay_us=0)
    stub = served.stub()
    first, second, third = (random_batch(spec, batch_size=3, seed=400 + i) for i in range(3))
    gate.hold()
    running = stub.Lookup.future(lookup_request(first), timeout=CALL_TIMEOUT)
    gate.wait_entered()  # the only worker is inside the model with `first`
    queued = stub.Lookup.future(lookup_request(second), timeout=CALL_TIMEOUT)
    wait_until(lambda: served.running.servicer.lookups.depth == 1, what="the second request to be queued")
    assert served.metric("embserve_queue_depth") == 1

    error = rpc_error(lambda: stub.Lookup(lookup_request(third), timeout=CALL_TIMEOUT))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in error.details()
    assert served.health() == health_pb2.HealthCheckResponse.SERVING

    gate.release()
    assert torch.equal(codec.decode_embeddings(running.result()), dense_runtime.lookup(first))
    assert torch.equal(codec.decode_embeddings(queued.result()), dense_runtime.lookup(second))
    response = stub.Lookup(lookup_request(third), timeout=CALL_TIMEOUT)
    assert torch.equal(codec.decode_embeddings(response), dense_runtime.lookup(third))
    assert served.metric("embserve_queue_depth") == 0
    assert served.metric("embserve_requests_total", {"method": "Lookup", "code": "RESOURCE_EXHAUSTED"}) == 1


def test_deadline_while_waiting_for_a_batch(start_server, gated, dense_runtime, spec):
    # one worker, a 1 s batching window: a 300 ms deadline expires while the request waits for company
    runtime, gate = gated
    served = start_server(runtime, max_delay_us=1_000_000, forward_threads=1, warmup_batches=0)
    stub = served.stub()
    stub.GetModelMetadata(pb.GetModelMetadataRequest(), timeout=CALL_TIMEOUT)
    # a lone caller is served at once; callers that overlap (one queued while another runs) make the server
    # wait for company from then on
    pair = [random_batch(spec, batch_size=1, seed=498 + i) for i in range(2)]
    gate.hold()
    running = stub.Lookup.future(lookup_request(pair[0]), timeout=CALL_TIMEOUT)
    gate.wait_entered()
    queued = stub.Lookup.future(lookup_request(pair[1]), timeout=CALL_TIMEOUT)
    wait_until(lambda: served.metric("embserve_queue_depth") == 1, what="the second call to queue")
    gate.release()
    for call, b in zip((running, queued), pair):
        assert torch.equal(codec.decode_embeddings(call.result()), dense_runtime.lookup(b))
    merged_before = served.metric("embserve_batch_requests_sum")
    batch = random_batch(spec, batch_size=4, seed=500)
    error = rpc_error(lambda: stub.Lookup(lookup_request(batch), timeout=0.3))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    later = random_batch(spec, batch_size=6, seed=501)
    response = stub.Lookup(lookup_request(later), timeout=CALL_TIMEOUT)
    assert torch.equal(codec.decode_embeddings(response), dense_runtime.lookup(later))

    # counted DEADLINE_EXCEEDED, or CANCELLED where the call reached a loaded server late: the client's deadline
    # then passes first, and its cancel arrives while the server's own clock (from arrival) still has time left
    def ended() -> float:
        return sum(
            served.metric("embserve_requests_total", {"method": "Lookup", "code": code})
            for code in ("DEADLINE_EXCEEDED", "CANCELLED")
        )

    wait_until(lambda: ended() == 1, what="the expired call's metric")
    # the expired request was dropped before the merge: only `later` reached the model
    assert served.metric("embserve_batch_requests_sum") == merged_before + 1
    assert served.metric("embserve_batch_examples_sum") == 2 + 6
    assert served.health() == health_pb2.HealthCheckResponse.SERVING


def test_a_lone_caller_does_not_wait_out_the_batching_window(start_server, dense_artifact, dense_runtime, spec):
    # a 60 s window and calls with a much shorter deadline: a lone closed-loop caller has no company to wait for
    served = start_server(dense_artifact, max_delay_us=60_000_000, forward_threads=1, warmup_batches=0)
    stub = served.stub()
    for seed in range(3):
        batch = random_batch(spec, batch_size=2, seed=700 + seed)
        response = stub.Lookup(lookup_request(batch), timeout=CALL_TIMEOUT)
        assert torch.equal(codec.decode_embeddings(response), dense_runtime.lookup(batch))
    assert served.metric("embserve_batch_requests_sum") == 3


def test_deadline_during_the_forward(start_server, gated, dense_runtime, spec):
    runtime, gate = gated
    served = start_server(runtime, forward_threads=1, max_delay_us=0)
    stub = served.stub()
    batch = random_batch(spec, batch_size=4, seed=600)
    gate.hold()
    expiring = stub.Lookup.future(lookup_request(batch), timeout=1.0)
    gate.wait_entered()
    with pytest.raises(grpc.RpcError) as caught:
        expiring.result(timeout=CALL_TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    gate.release()  # the forward finishes for a caller that is gone

    later = random_batch(spec, batch_size=2, seed=601)
    response = stub.Lookup(lookup_request(later), timeout=CALL_TIMEOUT)
    assert torch.equal(codec.decode_embeddings(response), dense_runtime.lookup(later))


def test_cancelled_call_leaves_the_server_serving(start_server, gated, dense_runtime, spec):
    runtime, gate = gated
    served = start_server(runtime, forward_threads=1, max_delay_us=0)
    stub = served.stub()
    gate.hold()
    cancelled = stub.Lookup.future(lookup_request(random_batch(spec, 2, seed=700)), timeout=CALL_TIMEOUT)
    gate.wait_entered()
    assert cancelled.cancel()
    labels = {"method": "Lookup", "code": "CANCELLED"}
    wait_until(lambda: served.metric("embserve_requests_total", labels) == 1, what="the server to see the cancel")
    gate.release()
    batch = random_batch(spec, batch_size=3, seed=701)
    response = stub.Lookup(lookup_request(batch), timeout=CALL_TIMEOUT)
    assert torch.equal(codec.decode_embeddings(response), dense_runtime.lookup(batch))
