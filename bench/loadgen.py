# ruff: noqa: E402
"""MLPerf LoadGen drives ``embserve serve``: the highest Server-scenario QPS under a p99 bound, and Offline.

The script exports the built-in demo model (``infer.demo``: eight mixed-dtype tables and a DLRM-style over-arch
on 13 dense features, what ``embserve demo`` builds), starts ``embserve serve`` on it (a subprocess on a free
loopback port) and lets LoadGen (``mlperf_loadgen``, the ``bench`` extra) send to it over embserve.v1 and over
the Open Inference Protocol (gRPC).

One LoadGen sample is one query of ``--batch-size`` rows (64): one Predict (``--method lookup``: one Lookup)
request, the DLRM convention. Queries are seeded, with DLRM-style multi-hot ids (a fixed number of ids per
feature, ``MULTI_HOT``) and random dense features, and encoded once up front, so the client spends its CPU on
gRPC alone. The system under test never blocks LoadGen's thread: every sample goes out as a gRPC future (at most
``--max-in-flight`` at a time, the rest wait in a backlog) and ``QuerySamplesComplete`` is called from the
completion callback with the output's bytes.

Server scenario (Poisson arrivals, one sample per query): probes of ``--min-duration-s`` seconds double
``server_target_qps`` until LoadGen says the p99 bound (``--p99-ms``) is missed, then bisect; one confirmation run
of ``--confirm-duration-s`` at the highest passing QPS gives LoadGen's verdict ("Result is : VALID", early stopping
included); an INVALID confirmation steps the QPS down and tries again (``--confirm-attempts``). Offline: every
sample in one query, as fast as the server answers. Before each case and after its last run the in-process
runtime (``infer.load`` of the same artifact) runs the same queries back to back on 1 and on every core's threads:
the best of each, averaged, is the ceiling. Each case prints one JSON line (qps, p99_ms, valid, ceiling_qps,
ratio_to_ceiling, server and client CPU per query, load_avg, ...); confirmation and Offline runs log every response
(LoadGen's accuracy log) and compare it with the in-process runtime on the same query (lookups bit for bit, scores
to fp32 rounding: merged batches may block the dense GEMMs differently).

    python bench/loadgen.py                                  # both protocols, Server and Offline
    python bench/loadgen.py --quick                          # a short smoke run
    python bench/loadgen.py --baseline main.jsonl            # ratios to an earlier run's lines
    python bench/loadgen.py --protocols oip --scenarios server -- --forward-threads 2   # after --: serve flags
    python bench/loadgen.py --workers 1 2                    # every case on 1, then 2 server processes, and ratios
    python bench/loadgen.py --native --method lookup         # and on embserve-server (9 x 20 ids, batch 64)

``--workers 1 2`` serves every case once per server-process count (``embserve serve --workers N``); each line
says which, and a ``loadgen_workers`` line per protocol and scenario gives N's QPS over the first count's, same
run. The client sends over ``--channels`` connections in turn (the kernel spreads connections, not calls, over
the workers); the server's CPU is the instance's and its workers'.

``--native`` serves every case once more with the native binary (``embserve serve --native``; ``make server``
builds it), and a ``loadgen_native`` line per protocol and scenario gives its QPS, validity, ratio to the
in-process ceiling and server CPU per query beside the Python server's of the same run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as ``python bench/loadgen.py``, this folder heads sys.path and would shadow the ``server`` package;
# the repository root takes its place.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import grpc
import numpy as np
import torch

from bench.served import process_cpu_seconds
from infer.artifact.export import export
from infer.artifact.load import load
from infer.artifact.runtime import Runtime
from infer.config import ModelSpec
from infer.demo import demo_spec
from infer.features import SparseFeatures
from infer.quant.quantize import quantize
from infer.weights import random_weights
from server.adapters.oip import codec as oc
from server.adapters.v1 import codec
from server.launch import spawn_server
from server.oip_client import infer_request
from server.proto import inference_pb2 as pb
from server.proto import inference_pb2_grpc as pb_grpc
from server.proto import open_inference_grpc_pb2_grpc as oip_grpc

HOST = "127.0.0.1"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# ids per bag of each demo feature (DLRM-style multi-hot: fixed per feature); other models' features get the default
MULTI_HOT = {
    "user_id": 1,
    "item_id": 1,
    "last_clicked_item": 20,
    "ad_id": 1,
    "query_tokens": 8,
    "publisher": 1,
    "city": 1,
    "device_type": 1,
    "item_category": 3,
}
DEFAULT_MULTI_HOT = 4
WARMUP_QUERIES = 8
MIN_SEARCH_QPS = 1.0  # a search that misses the bound even below 1 query/s stops: the host is the limit
MAX_DURATION_FACTOR = 3  # a Server run issues for at most 3x its minimum duration
START_FRACTION_OF_CEILING = 20  # the first Server probe: ceiling / 20, below today's server; probes double from it
TARGET_RATIO_TO_CEILING = 0.6  # issue 27, the combined work: >= 0.6x the in-process ceiling, VALID
TARGET_RATIO_TO_BASELINE = 2.0  # and >= 2x today's QPS (``--baseline``: today's lines)
SCORE_RTOL, SCORE_ATOL = 1e-5, 1e-6  # scores of a merged batch: fp32 rounding of the dense GEMMs
LOADGEN_EXTRA = "mlcommons-loadgen==6.0.17 (pip install 'embserve[bench]')"


def _loadgen() -> Any:
    try:
        import mlperf_loadgen
    except ImportError as err:
        raise SystemExit(f"bench/loadgen.py needs MLPerf LoadGen: {LOADGEN_EXTRA}") from err
    return mlperf_loadgen


# ---------------------------------------------------------------------------------------------- queries
@dataclass(frozen=True)
class Query:
    """One LoadGen sample: a request of ``features.batch_size`` rows (and their dense features)."""

    features: SparseFeatures
    dense: torch.Tensor | None


def multi_hot(feature: str) -> int:
    return MULTI_HOT.get(feature, DEFAULT_MULTI_HOT)


def make_queries(spec: ModelSpec, count: int, batch_size: int, seed: int) -> list[Query]:
    """``count`` seeded queries: uniform ids, ``multi_hot(feature)`` per bag; N(0, 1) dense features."""
    generator = torch.Generator().manual_seed(seed)
    queries = []
    for _ in range(count):
        values, lengths = [], []
        for info in spec.features:
            hot = multi_hot(info.name)
            values.append(torch.randint(0, info.num_embeddings, (batch_size * hot,), generator=generator))
            lengths.append(torch.full((batch_size,), hot, dtype=torch.int32))
        dense = (
            torch.randn(batch_size, spec.num_dense_features, generator=generator) if spec.num_dense_features else None
        )
        queries.append(Query(SparseFeatures(spec.feature_names, torch.cat(values), torch.cat(lengths)), dense))
    return queries


def reference_output(runtime: Runtime, query: Query, method: str) -> torch.Tensor:
    """What the in-process runtime answers to ``query``: scores ``[batch]`` or embeddings ``[batch, dim]``."""
    if method == "predict":
        assert query.dense is not None
        return runtime.predict(query.features, query.dense)
    return runtime.lookup(query.features)


def outputs_match(got: torch.Tensor, expected: torch.Tensor, method: str) -> bool:
    if got.shape != expected.shape:
        return False
    if method == "lookup":
        return torch.equal(got, expected)
    return torch.allclose(got, expected, rtol=SCORE_RTOL, atol=SCORE_ATOL)


# ---------------------------------------------------------------------------------------------- the wire
@dataclass(frozen=True)
class Wire:
    """One protocol's pre-encoded requests, the call that sends one, and where its response keeps the output."""

    protocol: str
    method: str
    calls: tuple[Any, ...]  # a grpc.UnaryUnaryMultiCallable per connection (samples take them in turn)
    requests: tuple[Any, ...]
    output_of: Callable[[Any], bytes]  # the response's raw float32 output (scores or embeddings)
    output_bytes: int  # what a well-formed answer carries


def make_wire(
    channels: Sequence[grpc.Channel],
    protocol: str,
    method: str,
    queries: Sequence[Query],
    model_name: str,
    output_dim: int,
) -> Wire:
    batch_size = queries[0].features.batch_size
    output_bytes = 4 * batch_size * (1 if method == "predict" else output_dim)
    if protocol == "oip":
        calls = tuple(oip_grpc.GRPCInferenceServiceStub(c).ModelInfer for c in channels)
        outputs = (oc.SCORES,) if method == "predict" else (oc.EMBEDDINGS,)
        requests = tuple(
            infer_request(model_name, "", q.features, q.dense if method == "predict" else None, outputs=outputs)
            for q in queries
        )
        return Wire(protocol, method, calls, requests, lambda r: r.raw_output_contents[0], output_bytes)
    stubs = [pb_grpc.InferenceServiceStub(c) for c in channels]
    if method == "predict":
        predicts = tuple(
            pb.PredictRequest(
                sparse=codec.encode_packed(q.features),
                dense_features=q.dense.contiguous().numpy().tobytes() if q.dense is not None else b"",
            )
            for q in queries
        )
        return Wire(protocol, method, tuple(s.Predict for s in stubs), predicts, lambda r: r.scores, output_bytes)
    lookups = tuple(
        pb.LookupRequest(sparse=codec.encode_packed(q.features), output_type=pb.OUTPUT_TYPE_FP32) for q in queries
    )
    return Wire(protocol, method, tuple(s.Lookup for s in stubs), lookups, lambda r: r.embeddings, output_bytes)


# ---------------------------------------------------------------------------------------------- system under test
class GrpcSut:
    """LoadGen's system under test: each sample is one gRPC future; completions report back from gRPC's thread.

    ``issue_query`` only queues the samples and starts as many calls as ``max_in_flight`` allows; each
    completion starts the next queued sample, so an Offline query of thousands of samples never floods the
    server's queue and LoadGen's thread never waits on the network.
    """

    def __init__(self, wire: Wire, max_in_flight: int, timeout_s: float) -> None:
        self.wire = wire
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self._lg = _loadgen()
        self._lock = threading.Lock()
        self._backlog: collections.deque[Any] = collections.deque()
        self._in_flight = 0
        self._local = threading.local()
        self.issued = 0
        self.sent = 0  # calls started: each takes the next connection in turn
        self.completed = 0
        self.errors: collections.Counter[str] = collections.Counter()

    def issue_query(self, samples: Sequence[Any]) -> None:
        with self._lock:
            self.issued += len(samples)
            self._backlog.extend(samples)
        self._pump()

    def flush_queries(self) -> None:
        """Nothing is held back: every sample is sent as soon as there is room."""

    def _pump(self) -> None:
        # A future that is already done runs its callback inside add_done_callback, which pumps again: the
        # outer loop on this thread sends instead, so the stack does not grow with the backlog.
        if getattr(self._local, "pumping", False):
            return
        self._local.pumping = True
        try:
            while True:
                with self._lock:
                    if not self._backlog or self._in_flight >= self.max_in_flight:
                        return
                    sample = self._backlog.popleft()
                    self._in_flight += 1
                    call = self.wire.calls[self.sent % len(self.wire.calls)]
                    self.sent += 1
                future = call.future(self.wire.requests[sample.index], timeout=self.timeout_s)
                future.add_done_callback(lambda done, sample=sample: self._complete(sample, done))
        finally:
            self._local.pumping = False

    def _complete(self, sample: Any, future: Any) -> None:
        data = b""
        try:
            data = self.wire.output_of(future.result())
            if len(data) != self.wire.output_bytes:
                self._count_error("BAD_RESPONSE")
                data = b""
        except grpc.RpcError as err:
            self._count_error(err.code().name if callable(getattr(err, "code", None)) else "RPC_ERROR")
        except (grpc.FutureCancelledError, IndexError, AttributeError, ValueError) as err:
            # a cancelled call or a response without its output still completes the sample (LoadGen waits for all)
            self._count_error(type(err).__name__)
        buffer = np.frombuffer(data, dtype=np.uint8)
        address = buffer.ctypes.data if len(data) else 0
        self._lg.QuerySamplesComplete([self._lg.QuerySampleResponse(sample.id, address, len(data))])
        with self._lock:
            self.completed += 1
            self._in_flight -= 1
        self._pump()

    def _count_error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1


# ---------------------------------------------------------------------------------------------- one LoadGen run
@dataclass(frozen=True)
class RunSettings:
    """What one LoadGen run is asked for."""

    scenario: str  # "server" or "offline"
    qps: float  # server_target_qps, or offline_expected_qps
    min_duration_s: float
    min_query_count: int
    p99_ms: float
    log_responses: bool  # every response into LoadGen's accuracy log (checked against the runtime afterwards)
    # LoadGen stops issuing here even when min_query_count is not reached yet (the verdict then says so): at a
    # low QPS the query count would otherwise stretch a run to minutes
    max_duration_s: float = 0.0


@dataclass(frozen=True)
class RunResult:
    """LoadGen's own verdict and numbers of one run (from its summary and detail logs), and the SUT's counts."""

    settings: RunSettings
    verdict: str  # "VALID" / "INVALID", from mlperf_log_summary.txt
    perf_constraints_met: bool  # Server: LoadGen's p99 <= the bound
    early_stopping_met: bool | None
    min_duration_met: bool
    completed_qps: float  # Server: completed samples/s; Offline: samples/s
    scheduled_qps: float | None
    p50_ms: float
    p99_ms: float
    loadgen_samples: int  # what LoadGen issued: queries (not those a max duration cut off) x samples per query
    issued: int
    completed: int
    errors: dict[str, int]
    log_dir: Path
    server_cpu_s: float  # CPU of the server process during the run (NaN when unknown)
    client_cpu_s: float  # CPU of this process (LoadGen and the gRPC client) during the run

    @property
    def valid(self) -> bool:
        return self.verdict == "VALID"

    @property
    def meets_bound(self) -> bool:
        """A search probe passes: LoadGen's p99 within the bound, every call answered well."""
        return self.perf_constraints_met and not self.errors and self.completed == self.issued


def read_detail_log(path: Path) -> dict[str, Any]:
    """The ``:::MLLOG {json}`` lines of LoadGen's detail log as key -> value (the last one of a key wins)."""
    values: dict[str, Any] = {}
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith(":::MLLOG "):
            try:
                entry = json.loads(line[len(":::MLLOG ") :])
            except json.JSONDecodeError:
                continue
            values[entry["key"]] = entry["value"]
    return values


def read_verdict(summary: Path) -> str:
    for line in summary.read_text(errors="replace").splitlines():
        if line.startswith("Result is"):
            return line.split(":", 1)[1].strip()
    return "MISSING"


def read_accuracy_log(path: Path) -> list[tuple[int, bytes]]:
    """(sample index, response bytes) of every response LoadGen logged."""
    return [(int(entry["qsl_idx"]), bytes.fromhex(entry["data"])) for entry in json.loads(path.read_text() or "[]")]


def run_loadgen(
    sut: GrpcSut, sample_count: int, settings: RunSettings, log_dir: Path, server_pid: int | None = None
) -> RunResult:
    lg = _loadgen()
    test = lg.TestSettings()
    test.mode = lg.TestMode.PerformanceOnly
    test.min_duration_ms = round(1000 * settings.min_duration_s)
    test.min_query_count = settings.min_query_count
    test.max_duration_ms = round(1000 * settings.max_duration_s)
    if settings.scenario == "server":
        test.scenario = lg.TestScenario.Server
        test.server_target_qps = settings.qps
        test.server_target_latency_ns = round(settings.p99_ms * 1e6)
        test.server_target_latency_percentile = 0.99
    else:
        test.scenario = lg.TestScenario.Offline
        test.offline_expected_qps = settings.qps
    test.accuracy_log_probability = 1.0 if settings.log_responses else 0.0
    log_dir.mkdir(parents=True, exist_ok=True)
    log = lg.LogSettings()
    log.log_output.outdir = str(log_dir)
    log.log_output.copy_summary_to_stdout = False
    log.enable_trace = False
    issued_before, completed_before, errors_before = sut.issued, sut.completed, collections.Counter(sut.errors)
    handle = lg.ConstructSUT(sut.issue_query, sut.flush_queries)
    qsl = lg.ConstructQSL(sample_count, sample_count, lambda _: None, lambda _: None)
    server_cpu = process_cpu_seconds(server_pid) if server_pid else float("nan")
    client_cpu = time.process_time()
    try:
        lg.StartTestWithLogSettings(handle, qsl, test, log, "")  # "": no audit.config from the working folder
    finally:
        client_cpu = time.process_time() - client_cpu
        server_cpu = (process_cpu_seconds(server_pid) if server_pid else float("nan")) - server_cpu
        lg.DestroyQSL(qsl)
        lg.DestroySUT(handle)
    detail = read_detail_log(log_dir / "mlperf_log_detail.txt")
    completed_key = "result_completed_samples_per_sec" if settings.scenario == "server" else "result_samples_per_second"
    return RunResult(
        settings=settings,
        verdict=read_verdict(log_dir / "mlperf_log_summary.txt"),
        perf_constraints_met=bool(detail.get("result_perf_constraints_met", settings.scenario == "offline")),
        early_stopping_met=detail.get("early_stopping_met"),
        min_duration_met=bool(detail.get("result_min_duration_met", False)),
        completed_qps=float(detail.get(completed_key, 0.0)),
        scheduled_qps=detail.get("result_scheduled_samples_per_sec"),
        p50_ms=float(detail.get("result_50.00_percentile_latency_ns", float("nan"))) / 1e6,
        p99_ms=float(detail.get("result_99.00_percentile_latency_ns", float("nan"))) / 1e6,
        loadgen_samples=int(detail.get("result_query_count", 0)) * int(detail.get("generated_samples_per_query", 0)),
        issued=sut.issued - issued_before,
        completed=sut.completed - completed_before,
        errors=dict(collections.Counter(sut.errors) - errors_before),
        log_dir=log_dir,
        server_cpu_s=server_cpu,
        client_cpu_s=client_cpu,
    )


def check_responses(
    result: RunResult, runtime: Runtime, queries: Sequence[Query], method: str, output_dim: int
) -> tuple[int, int]:
    """(responses LoadGen logged, how many equal the in-process runtime's output on the same query)."""
    logged = read_accuracy_log(result.log_dir / "mlperf_log_accuracy.json")
    expected: dict[int, torch.Tensor] = {}
    equal = 0
    for index, data in logged:
        if index not in expected:
            expected[index] = reference_output(runtime, queries[index], method)
        got = torch.frombuffer(bytearray(data), dtype=torch.float32) if data else torch.empty(0)
        if method == "lookup":
            got = got.view(-1, output_dim)
        equal += outputs_match(got, expected[index], method)
    return len(logged), equal


# ---------------------------------------------------------------------------------------------- search
@dataclass
class Search:
    """The probes of a Server-scenario search: (target QPS, LoadGen's p99 ms, passed)."""

    probes: list[tuple[float, float, bool]] = field(default_factory=list)
    best: float = 0.0


def search_server_qps(
    probe: Callable[[float], RunResult], start_qps: float, tolerance: float, max_probes: int
) -> Search:
    """Double the target QPS from ``start_qps`` until a probe misses the p99 bound, then bisect between the highest
    pass and the lowest miss until they are within ``tolerance`` (relative) or ``max_probes`` ran; halving stops
    below ``MIN_SEARCH_QPS``."""
    search = Search()
    low, high = 0.0, float("inf")
    qps = start_qps
    for _ in range(max_probes):
        result = probe(qps)
        passed = result.meets_bound
        search.probes.append((round(qps, 2), round(result.p99_ms, 3), passed))
        if passed:
            low = qps
        else:
            high = qps
        # no miss yet (high is inf) is never "close enough": inf - low <= inf would end a search that only passed
        if high < float("inf") and high - low <= tolerance * high or (low == 0 and qps / 2 < MIN_SEARCH_QPS):
            break
        qps = qps * 2 if high == float("inf") else (low + high) / 2 if low > 0 else qps / 2
    search.best = low
    return search


# ---------------------------------------------------------------------------------------------- ceiling
def measure_ceiling(runtime: Runtime, queries: Sequence[Query], method: str, seconds: float, threads: int) -> float:
    """Queries per second of the in-process runtime: ``threads`` threads calling it back to back on the pool."""
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    deadline = [0.0]

    def body(index: int) -> None:
        position = index * 7
        start.wait()
        while time.perf_counter() < deadline[0]:
            reference_output(runtime, queries[position % len(queries)], method)
            position += 1
            counts[index] += 1

    workers = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    began = time.perf_counter()
    deadline[0] = began + seconds
    start.wait()
    for worker in workers:
        worker.join()
    return sum(counts) / (time.perf_counter() - began)


def ceiling_row(runtime: Runtime, queries: Sequence[Query], method: str, seconds: float) -> dict[str, float]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    row = {}
    for threads in sorted({1, cores}):
        row[f"ceiling_qps_{threads}_thread{'s' if threads > 1 else ''}"] = round(
            measure_ceiling(runtime, queries, method, seconds, threads), 1
        )
    row["ceiling_qps"] = max(row.values())
    return row


def mean_ceiling(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The ceiling measured before a case's runs and after its last one, averaged (a drifting host hits both)."""
    row = {key: round((before[key] + after[key]) / 2, 1) for key in before}
    row["ceiling_qps_before"], row["ceiling_qps_after"] = before["ceiling_qps"], after["ceiling_qps"]
    return row


# ---------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Plan:
    """Everything a case needs from the command line."""

    method: str
    p99_ms: float
    min_duration_s: float
    min_query_count: int
    confirm_duration_s: float
    confirm_min_queries: int
    confirm_attempts: int
    confirm_step: float
    max_probes: int
    tolerance: float
    start_qps: float
    server_qps: float
    offline_duration_s: float
    offline_expected_qps: float
    ceiling_s: float
    max_in_flight: int
    timeout_s: float


class Case:
    """One protocol x scenario against a running server; ``row()`` is its JSON line."""

    def __init__(
        self,
        plan: Plan,
        wire: Wire,
        runtime: Runtime,
        queries: Sequence[Query],
        log_root: Path,
        output_dim: int,
        server_pid: int,
    ) -> None:
        self.plan, self.wire, self.runtime, self.queries = plan, wire, runtime, queries
        self.log_root, self.output_dim, self.server_pid = log_root, output_dim, server_pid
        self.sut = GrpcSut(wire, plan.max_in_flight, plan.timeout_s)
        self._runs = 0

    def run(self, settings: RunSettings) -> RunResult:
        self._runs += 1
        folder = self.log_root / f"{self.wire.protocol}-{settings.scenario}-{self._runs:02d}"
        return run_loadgen(self.sut, len(self.queries), settings, folder, self.server_pid)

    def ceiling(self) -> dict[str, float]:
        return ceiling_row(self.runtime, self.queries, self.plan.method, self.plan.ceiling_s)

    def server(self) -> dict[str, Any]:
        plan = self.plan
        ceiling = self.ceiling()
        search = Search()
        if plan.server_qps > 0:
            qps = plan.server_qps
        else:
            start = plan.start_qps or max(1.0, ceiling["ceiling_qps"] / START_FRACTION_OF_CEILING)
            search = search_server_qps(
                lambda q: self.run(
                    RunSettings(
                        "server",
                        q,
                        plan.min_duration_s,
                        plan.min_query_count,
                        plan.p99_ms,
                        False,
                        MAX_DURATION_FACTOR * plan.min_duration_s,
                    )
                ),
                start,
                plan.tolerance,
                plan.max_probes,
            )
            qps = search.best
        confirm = None
        for _ in range(plan.confirm_attempts if qps > 0 else 0):
            confirm = self.run(
                RunSettings(
                    "server",
                    qps,
                    plan.confirm_duration_s,
                    plan.confirm_min_queries,
                    plan.p99_ms,
                    True,
                    MAX_DURATION_FACTOR * plan.confirm_duration_s,
                )
            )
            if (confirm.valid and confirm.meets_bound) or plan.server_qps > 0:
                break
            qps *= plan.confirm_step
        row = self.row("server", confirm, mean_ceiling(ceiling, self.ceiling()))
        row["search"] = search.probes
        return row

    def offline(self, hint_qps: float) -> dict[str, Any]:
        plan = self.plan
        ceiling = self.ceiling()
        # the server merges concurrent requests into larger batches: Offline may pass the batch-64 ceiling
        expected = plan.offline_expected_qps or max(hint_qps, ceiling["ceiling_qps"])
        result = None
        for _ in range(3):  # a run that ended before the minimum duration is repeated with a larger query
            result = self.run(RunSettings("offline", expected, plan.offline_duration_s, 1, plan.p99_ms, True))
            if result.min_duration_met or plan.offline_expected_qps:
                break
            expected = result.completed_qps * 1.3
        return self.row("offline", result, mean_ceiling(ceiling, self.ceiling()))

    def row(self, scenario: str, result: RunResult | None, ceiling: dict[str, float]) -> dict[str, Any]:
        row: dict[str, Any] = {
            "bench": "loadgen",
            "protocol": self.wire.protocol,
            "scenario": scenario,
            "method": self.plan.method,
            "batch_size": self.queries[0].features.batch_size,
        }
        if result is None:  # no QPS met the bound: nothing to confirm
            row |= {"qps": 0.0, "valid": False, "result": "NO_PASSING_QPS", **ceiling, "ratio_to_ceiling": 0.0}
        else:
            logged, equal = check_responses(result, self.runtime, self.queries, self.plan.method, self.output_dim)
            qps = result.completed_qps
            row |= {
                "qps": round(qps, 2),
                "target_qps": round(result.settings.qps, 2),
                "valid": result.valid,
                "result": result.verdict,
                "p99_ms": round(result.p99_ms, 3),
                "p50_ms": round(result.p50_ms, 3),
                "p99_bound_ms": self.plan.p99_ms if scenario == "server" else None,
                "p99_met": result.perf_constraints_met if scenario == "server" else None,
                "early_stopping_met": result.early_stopping_met,
                "min_duration_met": result.min_duration_met,
                "loadgen_samples": result.loadgen_samples,
                "issued": result.issued,
                "completed": result.completed,
                "errors": sum(result.errors.values()),
                "error_kinds": result.errors,
                "server_cpu_ms_per_query": round(1e3 * result.server_cpu_s / max(1, result.completed), 3),
                "client_cpu_ms_per_query": round(1e3 * result.client_cpu_s / max(1, result.completed), 3),
                "responses_checked": logged,
                "outputs_equal": logged == result.loadgen_samples and equal == logged,
                **ceiling,
                "ratio_to_ceiling": round(qps / ceiling["ceiling_qps"], 3) if ceiling["ceiling_qps"] else None,
                "log_dir": str(result.log_dir),
            }
        row["target_ratio_to_ceiling"] = TARGET_RATIO_TO_CEILING
        row["ratio_to_ceiling_ok"] = bool(row["valid"]) and (row["ratio_to_ceiling"] or 0) >= TARGET_RATIO_TO_CEILING
        row["load_avg"] = [round(x, 2) for x in os.getloadavg()]
        return row


def with_baseline(row: dict[str, Any], baseline: dict[tuple[str, str, str, int], float]) -> dict[str, Any]:
    """The ratio to an earlier run's QPS of the same case (``--baseline``) and the issue's 2x target."""
    before = baseline.get((row["protocol"], row["scenario"], row["method"], row["batch_size"]))
    if before:
        ratio = row["qps"] / before
        row |= {
            "baseline_qps": before,
            "ratio_to_baseline": round(ratio, 3),
            "target_ratio_to_baseline": TARGET_RATIO_TO_BASELINE,
            "ratio_to_baseline_ok": bool(row["valid"]) and ratio >= TARGET_RATIO_TO_BASELINE,
        }
    return row


def read_baseline(path: Path) -> dict[tuple[str, str, str, int], float]:
    baseline = {}
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            if row.get("bench") == "loadgen" and row.get("valid"):  # an INVALID run is no baseline
                baseline[(row["protocol"], row["scenario"], row["method"], row["batch_size"])] = float(row["qps"])
    return baseline


# ---------------------------------------------------------------------------------------------- main
def build_demo_artifact(out_dir: Path) -> Path:
    """The demo model with its dense part, as ``embserve demo`` exports it."""
    spec = demo_spec()
    return export(quantize(spec, random_weights(spec, seed=0)), out_dir / "artifact")


def stop_server(process: subprocess.Popen[str]) -> int | None:
    """SIGTERM (the server drains and exits 0); killed and reported as None when it does not exit in time."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
        return None


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    own, server_args = list(argv), []
    if "--" in own:
        split = own.index("--")
        own, server_args = own[:split], own[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocols", nargs="+", choices=("v1", "oip"), default=["v1", "oip"])
    parser.add_argument("--scenarios", nargs="+", choices=("server", "offline"), default=["server", "offline"])
    parser.add_argument("--method", choices=("predict", "lookup"), default="predict", help="Predict (scores) or Lookup")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per query (one LoadGen sample)")
    parser.add_argument("--pool", type=int, default=512, help="distinct queries (LoadGen's sample count)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--p99-ms", type=float, default=10.0, help="Server scenario: the p99 latency bound")
    parser.add_argument("--min-duration-s", type=float, default=2.0, help="Server: seconds per search probe")
    parser.add_argument("--min-query-count", type=int, default=256, help="Server: queries per search probe at least")
    parser.add_argument("--confirm-duration-s", type=float, default=15.0, help="Server: the confirmation run")
    parser.add_argument("--confirm-min-queries", type=int, default=1024, help="Server: its queries at least")
    parser.add_argument("--confirm-attempts", type=int, default=3, help="Server: INVALID steps the QPS down, retries")
    parser.add_argument("--confirm-step", type=float, default=0.9, help="Server: the QPS factor of each step down")
    parser.add_argument("--max-probes", type=int, default=10, help="Server: search probes at most")
    parser.add_argument("--tolerance", type=float, default=0.05, help="Server: search until pass/miss are this close")
    parser.add_argument("--start-qps", type=float, default=0.0, help="Server: first probe (0: ceiling / 20)")
    parser.add_argument("--server-qps", type=float, default=0.0, help="Server: no search, one run at this QPS")
    parser.add_argument("--offline-duration-s", type=float, default=10.0, help="Offline: LoadGen's min duration")
    parser.add_argument(
        "--offline-expected-qps", type=float, default=0.0, help="Offline: (0: the Server QPS found, or ceiling / 4)"
    )
    parser.add_argument("--ceiling-s", type=float, default=2.0, help="in-process seconds per thread count per case")
    parser.add_argument("--max-in-flight", type=int, default=256, help="calls outstanding at most")
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of one call, seconds")
    parser.add_argument("--artifact", default=None, help="serve this exported artifact instead of the demo model")
    parser.add_argument("--model-name", default=None, help="OIP model name (default: the artifact's folder name)")
    parser.add_argument("--log-dir", default=None, help="keep LoadGen's logs here (default: a temporary folder)")
    parser.add_argument("--baseline", default=None, help="JSON lines of an earlier run: ratios and the 2x target")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (short runs, small pool)")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1], help="server processes (embserve serve --workers); each count"
    )
    parser.add_argument(
        "--channels", type=int, default=4, help="client connections, samples take them in turn (default 4)"
    )
    parser.add_argument(
        "--native",
        action="store_true",
        help="also serve every case with embserve-server (embserve serve --native) and print its ratios to the "
        "Python server, same run",
    )
    args = parser.parse_args(own)
    if args.quick:
        quick = {
            "pool": 64,
            "min_duration_s": 0.5,
            "min_query_count": 20,
            "confirm_duration_s": 1.0,
            "confirm_min_queries": 50,
            "confirm_attempts": 1,
            "max_probes": 4,
            "tolerance": 0.25,
            "offline_duration_s": 1.0,
            "ceiling_s": 0.3,
        }
        for name, value in quick.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    if args.channels < 1 or min(args.workers) < 1:
        parser.error("--channels and --workers must be >= 1")
    if args.batch_size < 1 or args.pool < 1 or args.max_in_flight < 1 or args.p99_ms <= 0:
        parser.error("--batch-size, --pool and --max-in-flight must be >= 1, --p99-ms > 0")
    return args, server_args


def main(argv: Sequence[str] | None = None) -> int:
    args, server_args = parse_args(sys.argv[1:] if argv is None else argv)
    plan = Plan(
        args.method, args.p99_ms, args.min_duration_s, args.min_query_count, args.confirm_duration_s,
        args.confirm_min_queries, args.confirm_attempts, args.confirm_step, args.max_probes, args.tolerance,
        args.start_qps, args.server_qps, args.offline_duration_s, args.offline_expected_qps, args.ceiling_s,
        args.max_in_flight, args.timeout,
    )  # fmt: skip
    baseline = read_baseline(Path(args.baseline)) if args.baseline else {}
    _loadgen()  # fail before exporting anything when the extra is missing
    with tempfile.TemporaryDirectory(prefix="embserve-loadgen-") as tmp:
        artifact = Path(args.artifact) if args.artifact else build_demo_artifact(Path(tmp))
        log_root = Path(args.log_dir) if args.log_dir else Path(tmp) / "loadgen"
        runtime = load(artifact, intra_op_threads=1)
        if args.method == "predict" and not runtime.has_dense:
            raise SystemExit(f"{artifact} has no dense part: use --method lookup")
        queries = make_queries(runtime.spec, args.pool, args.batch_size, args.seed)
        for query in queries[:WARMUP_QUERIES]:  # TorchScript optimizes its graph on the first calls
            reference_output(runtime, query, args.method)
        rows: list[dict[str, Any]] = []
        exit_codes: list[int | None] = []
        for workers in args.workers:
            process, port = spawn_server(artifact, "--python", "--workers", str(workers), *server_args)
            try:
                rows += serve_cases(
                    args, plan, artifact, runtime, queries, log_root, baseline, port, process.pid, workers
                )
            finally:
                exit_codes.append(stop_server(process))
        if args.native:
            process, port = spawn_server(artifact, "--native", *server_args)
            try:
                rows += serve_cases(
                    args, plan, artifact, runtime, queries, log_root, baseline, port, process.pid, 1, "native"
                )
            finally:
                exit_codes.append(stop_server(process))
            for row in compare_native(rows, args.workers[0]):
                print(json.dumps(row), flush=True)
        rows_python = [r for r in rows if r["server"] == "python"]
        for row in compare_workers(rows_python, args.workers):
            print(json.dumps(row), flush=True)
        exit_code = next((code for code in exit_codes if code != 0), 0)
        summary = {
            "bench": "loadgen_summary",
            "cases": len(rows),
            "all_valid": all(r["valid"] for r in rows),
            "all_outputs_equal": all(r.get("outputs_equal", False) for r in rows),
            "total_errors": sum(r.get("errors", 0) for r in rows),
            "server_exit_code": exit_code,
            "workers": args.workers,
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        }
        print(json.dumps(summary), flush=True)
    ok = exit_code == 0 and summary["total_errors"] == 0 and summary["all_outputs_equal"]
    return 0 if ok else 1


def serve_cases(
    args: argparse.Namespace,
    plan: Plan,
    artifact: Path,
    runtime: Runtime,
    queries: Sequence[Query],
    log_root: Path,
    baseline: dict[tuple[str, str, str, int], float],
    port: int,
    server_pid: int,
    workers: int,
    kind: str = "python",
) -> list[dict[str, Any]]:
    """Every protocol and scenario against one server (``workers`` processes; ``kind`` native: embserve-server),
    over ``--channels`` connections."""
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", -1),
        ("grpc.use_local_subchannel_pool", 1),  # a connection each: the kernel spreads connections over workers
    ]
    channels = [grpc.insecure_channel(f"{HOST}:{port}", options) for _ in range(args.channels)]
    rows: list[dict[str, Any]] = []
    try:
        found: dict[str, float] = {}
        for protocol in args.protocols:
            name = args.model_name or artifact.name
            wire = make_wire(channels, protocol, args.method, queries, name, runtime.output_dim)
            logs = log_root / (f"workers-{workers}" if kind == "python" else kind)
            case = Case(plan, wire, runtime, queries, logs, runtime.output_dim, server_pid)
            for scenario in args.scenarios:
                if scenario == "server":
                    row = case.server()
                    found[protocol] = float(row["qps"])
                else:
                    row = case.offline(found.get(protocol, 0.0))
                row = with_baseline(row | {"server": kind, "workers": workers, "channels": args.channels}, baseline)
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        for channel in channels:
            channel.close()
    return rows


def compare_native(rows: Sequence[dict[str, Any]], workers: int) -> list[dict[str, Any]]:
    """Per protocol and scenario, embserve-server against the Python server (``workers`` processes), same run."""
    base = {(r["protocol"], r["scenario"]): r for r in rows if r["server"] == "python" and r["workers"] == workers}
    compared = []
    for row in rows:
        python = base.get((row["protocol"], row["scenario"]))
        if row["server"] != "native" or python is None:
            continue
        compared.append(
            {
                "bench": "loadgen_native",
                "method": row.get("method"),
                "protocol": row["protocol"],
                "scenario": row["scenario"],
                "native_qps": row["qps"],
                "python_qps": python["qps"],
                "qps_ratio": round(row["qps"] / python["qps"], 3) if python["qps"] else None,
                "native_valid": row["valid"],
                "python_valid": python["valid"],
                "native_ratio_to_ceiling": row.get("ratio_to_ceiling"),
                "python_ratio_to_ceiling": python.get("ratio_to_ceiling"),
                "native_server_cpu_ms_per_query": row.get("server_cpu_ms_per_query"),
                "python_server_cpu_ms_per_query": python.get("server_cpu_ms_per_query"),
                "load_avg": [round(x, 2) for x in os.getloadavg()],
            }
        )
    return compared


def compare_workers(rows: Sequence[dict[str, Any]], counts: Sequence[int]) -> list[dict[str, Any]]:
    """Per protocol and scenario, N server processes against the first count, same run."""
    base = {(r["protocol"], r["scenario"]): r for r in rows if r["workers"] == counts[0]}
    compared = []
    for row in rows:
        first = base.get((row["protocol"], row["scenario"]))
        if row["workers"] == counts[0] or first is None:
            continue
        compared.append(
            {
                "bench": "loadgen_workers",
                "protocol": row["protocol"],
                "scenario": row["scenario"],
                "workers": row["workers"],
                "baseline_workers": counts[0],
                "qps": row["qps"],
                "baseline_qps": first["qps"],
                "qps_ratio": round(row["qps"] / first["qps"], 3) if first["qps"] else None,
                "valid": row["valid"],
                "baseline_valid": first["valid"],
                "ratio_to_ceiling": row.get("ratio_to_ceiling"),
                "baseline_ratio_to_ceiling": first.get("ratio_to_ceiling"),
                "server_cpu_ms_per_query": row.get("server_cpu_ms_per_query"),
                "baseline_server_cpu_ms_per_query": first.get("server_cpu_ms_per_query"),
                "load_avg": [round(x, 2) for x in os.getloadavg()],
            }
        )
    return compared


if __name__ == "__main__":
    sys.exit(main())
