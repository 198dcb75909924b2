"""Clients racing a server's stop: N threads send (embserve.v1 Lookup, OIP ModelInfer over gRPC, OIP REST
infer) back to back, the server gets SIGTERM, and every thread keeps sending until the process has exited.

Every call's outcome is classified (OK, a gRPC status, an HTTP status, connection refused or reset); an
answer is compared with an in-process reference on the same batch. What a stopping server may answer is
``OK`` or a refusal a retry policy retries (``UNAVAILABLE``, a refused connection, HTTP 503); everything
else counts as ``lost``. Used by ``tests/server/test_stop_race.py``, ``tests/distributed/test_serving.py``
(rank 0 of a group) and ``bench/soak.py --stop-rounds``.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from infer.config import ModelSpec
from infer.features import SparseFeatures
from server.adapters.oip import codec as oc
from server.adapters.v1 import codec
from server.app import SERVING_LINE
from server.oip_client import infer_request
from server.proto import inference_pb2 as pb
from server.proto import inference_pb2_grpc as pb_grpc
from server.proto import open_inference_grpc_pb2 as oip_pb
from server.proto import open_inference_grpc_pb2_grpc as oip_pb_grpc
from tests.conftest import sanitizer_reported

PROTOCOLS = ("v1", "oip", "rest")
# outcomes a retry policy handles: the call was answered, or refused before the server accepted it
RETRYABLE = ("UNAVAILABLE", "HTTP 503", "connection refused")
CALL_TIMEOUT = 30.0  # a bound on a hang; a call that times out is lost


@dataclass
class RoundResult:
    """One round: outcomes by protocol (``"v1 OK"``, ``"rest HTTP 503"``, ...), the exit code, the log."""

    outcomes: Counter[str] = field(default_factory=Counter)
    exit_code: int | None = None
    stop_seconds: float | None = None  # from SIGTERM to the process's exit
    first_lost: list[str] = field(default_factory=list)
    log: str = ""

    @property
    def lost(self) -> int:
        """Calls that ended neither OK nor with a retryable refusal (CANCELLED, INTERNAL, a reset, a hang)."""
        return sum(n for key, n in self.outcomes.items() if not _acceptable(key))

    @property
    def cancelled(self) -> int:
        return sum(n for key, n in self.outcomes.items() if key.endswith(" CANCELLED"))

    def summary(self) -> dict[str, object]:
        by_outcome: Counter[str] = Counter()
        for key, n in self.outcomes.items():
            by_outcome[key.split(" ", 1)[1]] += n
        return {
            "calls": sum(self.outcomes.values()),
            "ok": by_outcome["OK"],
            "refused": sum(by_outcome[k] for k in RETRYABLE),
            "cancelled": self.cancelled,
            "lost": self.lost,
            "exit_code": self.exit_code,
            "stop_seconds": None if self.stop_seconds is None else round(self.stop_seconds, 3),
            "by_outcome": dict(sorted(self.outcomes.items())),
            "first_lost": self.first_lost[:5],
        }


def _acceptable(key: str) -> bool:
    outcome = key.split(" ", 1)[1]
    return outcome == "OK" or outcome in RETRYABLE


@dataclass(frozen=True)
class Case:
    features: SparseFeatures
    expected: torch.Tensor


def cases(spec: ModelSpec, lookup: Callable[[SparseFeatures], torch.Tensor], count: int = 8) -> list[Case]:
    """Small batches with their answers from ``lookup``, an in-process reference of the served model."""
    batches = [SparseFeatures.random(spec, batch_size=1 + i, ids_per_bag=1 + i % 5, seed=i) for i in range(count)]
    return [Case(b, lookup(b)) for b in batches]


@dataclass(frozen=True)
class Server:
    """A started ``embserve serve`` process (rank 0 of a group) and what its clients need."""

    process: subprocess.Popen[str]
    port: int
    http_port: int
    model: str  # the OIP model name
    log: Path  # its stderr


class _Client:
    """One thread's connection of one protocol; ``call`` sends one case and returns its outcome."""

    def __init__(self, protocol: str, port: int, http_port: int, model: str) -> None:
        self.protocol = protocol
        self.model = model
        self.http_port = http_port
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.v1 = pb_grpc.InferenceServiceStub(self.channel)
        self.oip = oip_pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.http: http.client.HTTPConnection | None = None

    def close(self) -> None:
        self.channel.close()
        if self.http is not None:
            self.http.close()

    def call(self, case: Case) -> tuple[str, str]:
        """(outcome, detail) of one call."""
        try:
            if self.protocol == "v1":
                response = self.v1.Lookup(
                    pb.LookupRequest(sparse=codec.encode_packed(case.features)), timeout=CALL_TIMEOUT
                )
                got = codec.decode_embeddings(response)
            elif self.protocol == "oip":
                answer = self.oip.ModelInfer(infer_request(self.model, "", case.features), timeout=CALL_TIMEOUT)
                got = _oip_embeddings(answer)
            else:
                return self._rest(case)
        except grpc.RpcError as err:
            return err.code().name, (err.details() or "")[:160]
        return ("OK", "") if torch.equal(got, case.expected) else ("wrong answer", "")

    def _rest(self, case: Case) -> tuple[str, str]:
        if self.http is None:
            self.http = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=CALL_TIMEOUT)
        try:
            self.http.request("POST", f"/v2/models/{self.model}/infer", body=_rest_body(case.features))
            response = self.http.getresponse()
            body = response.read()
        except ConnectionRefusedError:
            self._reconnect()
            return "connection refused", ""
        except http.client.IncompleteRead as err:
            self._reconnect()
            return "reset mid-response", repr(err)[:160]
        except (ConnectionError, http.client.HTTPException, OSError) as err:
            # the server closed the connection before answering (or the socket broke): the request is lost
            self._reconnect()
            return "connection reset", repr(err)[:160]
        if response.getheader("connection", "").lower() == "close":
            self._reconnect()
        if response.status != 200:
            return f"HTTP {response.status}", body[:160].decode("latin-1")
        output = json.loads(body)["outputs"][0]
        got = torch.tensor(output["data"], dtype=torch.float32).reshape(output["shape"])
        return ("OK", "") if torch.equal(got, case.expected) else ("wrong answer", "")

    def _reconnect(self) -> None:
        if self.http is not None:
            self.http.close()
        self.http = None


def _oip_embeddings(answer: oip_pb.ModelInferResponse) -> torch.Tensor:
    output = answer.outputs[0]
    raw = bytearray(answer.raw_output_contents[0])
    return torch.frombuffer(raw, dtype=torch.float32).reshape(list(output.shape))


def _rest_body(features: SparseFeatures) -> bytes:
    batch, inputs, position = features.batch_size, [], 0
    for index, key in enumerate(features.keys):
        lengths = features.lengths[index * batch : (index + 1) * batch]
        count = int(lengths.sum())
        values = features.values[position : position + count].tolist()
        inputs.append({"name": f"{key}__values", "datatype": "INT64", "shape": [count], "data": values})
        inputs.append({"name": f"{key}__lengths", "datatype": "INT32", "shape": [batch], "data": lengths.tolist()})
        position += count
    outputs = [{"name": oc.EMBEDDINGS, "parameters": {"binary_data": False}}]
    return json.dumps({"inputs": inputs, "outputs": outputs}).encode()


def start_server(artifact: Path, log: Path, *options: str) -> Server:
    """``embserve serve`` with gRPC and REST on free loopback ports, once it serves."""
    command = [sys.executable, "-m", "infer.cli", "serve", str(artifact), "--host", "127.0.0.1", "--port", "0"]
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [*command, "--http-port", "0", *options], stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith(SERVING_LINE):
        process.kill()
        process.wait()
        raise AssertionError(f"the server did not start (it printed {line!r}):\n{log.read_text()}")
    return Server(process, int(line.rsplit(" ", 1)[1]), rest_port(log), artifact.name, log)


def rest_port(log: Path) -> int:
    """The REST port a server logged (before it printed its serving line): the Python server's words, or
    embserve-server's ("..., HTTP on port N")."""
    text = log.read_text()
    for words in ("Open Inference Protocol REST on port ", ", HTTP on port "):
        if words in text:
            return int(text.split(words)[1].split()[0].rstrip(")"))
    raise AssertionError(f"the server logged no REST port:\n{text}")


def race_stop(
    server: Server, pool: list[Case], clients: int = 16, on_signal: Callable[[], None] | None = None
) -> RoundResult:
    """One round: ``clients`` threads (protocols in turn) send until every one has had an answer, SIGTERM,
    the threads keep sending until the process has exited (and one call after)."""
    process = server.process
    result = RoundResult()
    lock = threading.Lock()
    answered = threading.Barrier(clients + 1)
    exited = threading.Event()

    def client(index: int) -> None:
        protocol = PROTOCOLS[index % len(PROTOCOLS)]
        connection = _Client(protocol, server.port, server.http_port, server.model)
        first = True
        try:
            while True:
                done = exited.is_set()  # read before the call: a call sent after the exit ends the loop
                outcome, detail = connection.call(pool[index % len(pool)])
                with lock:
                    result.outcomes[f"{protocol} {outcome}"] += 1
                    if not _acceptable(f"{protocol} {outcome}") and len(result.first_lost) < 20:
                        result.first_lost.append(f"{protocol} {outcome}: {detail}")
                if first:
                    first = False
                    answered.wait(CALL_TIMEOUT)
                if done:
                    return
        finally:
            connection.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    try:
        for thread in threads:
            thread.start()
        answered.wait(CALL_TIMEOUT)  # observed: every client has had one answer (the server serves them all)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        if on_signal is not None:
            on_signal()
        result.exit_code = process.wait(timeout=120)
        result.stop_seconds = time.monotonic() - signalled
        exited.set()
        for thread in threads:
            thread.join(2 * CALL_TIMEOUT)
    finally:
        exited.set()
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
    result.log = server.log.read_text()
    return result


def check_round(result: RoundResult, label: str, drain_seconds: float | None = None) -> None:
    """The acceptance of a round: 0 calls CANCELLED, 0 lost, exit 0, and every protocol served before the stop
    (the race was real); with ``drain_seconds`` (the server's --drain-seconds, long), the stop did not wait it out:
    clients that keep calling must not hold the process (embserve-server waited for them to go quiet, which
    clients that retry at once never do, and exited only at its --drain-seconds)."""
    summary = result.summary()
    assert not sanitizer_reported(result.log), result.log[-6000:]
    assert result.exit_code == 0, (label, summary, result.log[-3000:])
    assert result.cancelled == 0 and result.lost == 0, (label, summary)
    if drain_seconds is not None:
        assert result.stop_seconds is not None and result.stop_seconds < drain_seconds / 2, (label, summary)
    for protocol in PROTOCOLS:
        assert result.outcomes[f"{protocol} OK"] > 0, (label, summary)
    assert "Traceback" not in result.log, result.log[-3000:]
