"""The Open Inference Protocol over HTTP/REST (``--http-port``): a small HTTP/1.1 server on asyncio.

It runs on the gRPC server's event loop and calls the same ``OpenInference`` (validation, batchers,
metrics), so REST and gRPC answer alike. Besides JSON tensors it speaks the binary tensor data
extension that tritonclient.http uses by default: the body is a JSON header of
``Inference-Header-Content-Length`` bytes followed by the raw tensors, each sized by its
``binary_data_size`` parameter. Only the standard library: no web framework to pin.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import ssl
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import grpc

from infer.errors import EmbserveError, RequestError
from server.adapters.oip import codec as oc
from server.adapters.oip.core import OpenInference
from server.pipeline import REJECTIONS, Failure, bounded, rejection
from server.ports import Port, bind_error

logger = logging.getLogger(__name__)

HEADER_LENGTH = "inference-header-content-length"
_MAX_HEADER_LINES = 100
_MAX_LINE = 64 * 1024
_MODEL_PATH = re.compile(
    r"^/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?(?P<action>/ready|/infer|/config|/stats)?$"
)
_REPOSITORY_PATH = re.compile(r"^/v2/repository/models/(?P<name>[^/]+)/(?P<action>load|unload)$")
_MAX_JSON_DEPTH = 100  # embserve-server's kMaxJsonDepth
_LINGER_POLL_S = 0.01  # how often a stop looks again at the connections it waits on
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"?', re.S)
_JSON_BRACKET = re.compile(rb"[\[\]{}]")
_OPEN_PATHS = ("/v2/health/",)  # probes work without the token, as on gRPC
_HTTP_STATUS = {
    grpc.StatusCode.OK: HTTPStatus.OK,
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.FAILED_PRECONDITION: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.TOO_MANY_REQUESTS,
    grpc.StatusCode.UNAUTHENTICATED: HTTPStatus.UNAUTHORIZED,
    grpc.StatusCode.DEADLINE_EXCEEDED: HTTPStatus.GATEWAY_TIMEOUT,
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.INTERNAL: HTTPStatus.INTERNAL_SERVER_ERROR,
}


class HttpError(EmbserveError):
    """A request that breaks HTTP itself (size, framing): answered, then the connection closes."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    headers: Mapping[str, str]  # lower-case names
    body: bytes

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"


@dataclass(frozen=True)
class HttpResponse:
    status: HTTPStatus
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()


def _json_response(payload: Any, status: HTTPStatus = HTTPStatus.OK) -> HttpResponse:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return HttpResponse(status, body, (("Content-Type", "application/json"),))


def _error_response(code: grpc.StatusCode, message: str) -> HttpResponse:
    return _json_response({"error": message}, _HTTP_STATUS.get(code, HTTPStatus.INTERNAL_SERVER_ERROR))


async def read_request(
    reader: asyncio.StreamReader, max_body: int, begun: Callable[[], object] | None = None
) -> HttpRequest | None:
    """One HTTP/1.1 request, or None when the client closed the connection between requests; ``begun`` is
    called once its first line has come (the rest may take a while: a large body)."""
    line = await reader.readline()
    if not line:
        return None
    if begun is not None:
        begun()
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(HTTPStatus.BAD_REQUEST, f"malformed request line {line[:100]!r}")
    method, target, _version = parts
    headers: dict[str, str] = {}
    for _ in range(_MAX_HEADER_LINES):
        header = await reader.readline()
        if header in (b"\r\n", b"\n", b""):
            break
        name, separator, value = header.decode("latin-1").partition(":")
        if not separator:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"malformed header line {header[:100]!r}")
        key = name.strip().lower()
        if key == "content-length" and headers.get(key, value.strip()) != value.strip():
            # two lengths that disagree frame the body two ways (RFC 9112 6.3)
            raise HttpError(HTTPStatus.BAD_REQUEST, "Content-Length is given twice with different values")
        headers[key] = value.strip()
    else:
        raise HttpError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"more than {_MAX_HEADER_LINES} header lines")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise HttpError(HTTPStatus.LENGTH_REQUIRED, "chunked request bodies are not supported; send Content-Length")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise HttpError(HTTPStatus.BAD_REQUEST, "Content-Length is not a number") from None
    if length < 0 or length > max_body:
        raise HttpError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"request body of {length} bytes exceeds the server's limit of {max_body} bytes (--max-message-mb)",
        )
    body = await reader.readexactly(length) if length else b""
    encoding = headers.get("content-encoding", "").lower()
    if encoding in ("gzip", "deflate"):
        body = _inflate(body, encoding, max_body)
    elif encoding not in ("", "identity"):
        raise HttpError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"Content-Encoding {encoding!r} is not supported")
    path = target.split("#", 1)[0].split("?", 1)[0]  # a fragment is no part of the path (nor sent by clients)
    return HttpRequest(method.upper(), path, headers, body)


def _inflate(body: bytes, encoding: str, max_body: int) -> bytes:
    """A gzip or deflate body, inflated to at most ``max_body`` bytes (a small bomb must not fill the memory)."""
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        inflated = inflater.decompress(body, max_body + 1)
    except zlib.error:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"the request body is not valid {encoding} data") from None
    if len(inflated) > max_body:
        raise HttpError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"request body inflates past the server's limit of {max_body} bytes (--max-message-mb)",
        )
    return inflated


def _serialize(response: HttpResponse, keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {response.status.value} {response.status.phrase}"]
    lines += [f"{name}: {value}" for name, value in response.headers]
    lines.append(f"Content-Length: {len(response.body)}")
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + response.body


# ------------------------------------------------------------------------------------------ infer body
def check_json_depth(raw: bytes) -> None:
    """Refuse a JSON text nested deeper than ``_MAX_JSON_DEPTH`` before parsing it (json.loads would recurse
    until RecursionError, a 500); brackets inside strings do not count. embserve-server applies the same rule."""
    if raw.count(b"[") + raw.count(b"{") <= _MAX_JSON_DEPTH:
        return
    depth = 0
    for bracket in _JSON_BRACKET.findall(_JSON_STRING.sub(b"", raw)):
        depth += 1 if bracket in b"[{" else -1
        if depth > _MAX_JSON_DEPTH:
            raise RequestError(f"the request nests JSON deeper than {_MAX_JSON_DEPTH} levels")


def parse_infer_body(
    body: bytes, header_length: str | None
) -> tuple[dict[str, Any], list[oc.InputTensor], list[oc.RequestedOutput], bool, bool]:
    """JSON header (+ binary tensors) -> (request, inputs, requested outputs, binary by default, fp16)."""
    if header_length is not None:
        try:
            split = int(header_length)
        except ValueError:
            raise RequestError("Inference-Header-Content-Length is not a number") from None
        if not 0 <= split <= len(body):
            raise RequestError(f"Inference-Header-Content-Length {split} exceeds the body's {len(body)} bytes")
        header, binary = body[:split], memoryview(body)[split:]
    else:
        header, binary = body, memoryview(b"")
    check_json_depth(header)
    try:
        request = json.loads(header)
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(f"the request is not valid JSON: {err}") from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise RequestError("the request must be a JSON object with an 'inputs' list")
    parameters = request.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise RequestError("'parameters' must be a JSON object")
    inputs = []
    offset = 0
    for index, item in enumerate(request["inputs"]):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise RequestError(f"input #{index} must be an object with a 'name'")
        name, datatype, shape = item["name"], item.get("datatype", ""), item.get("shape")
        if not isinstance(datatype, str):  # named in the refusal of an unknown datatype
            datatype = str(datatype)
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise RequestError(f"input {name!r}: 'shape' must be a list of integers")
        input_parameters = item.get("parameters")
        size = input_parameters.get("binary_data_size") if isinstance(input_parameters, dict) else None
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise RequestError(f"input {name!r}: binary_data_size {size} runs past the request's binary data")
            inputs.append(oc.tensor_from_raw(name, datatype, shape, binary[offset : offset + size]))
            offset += size
        elif "data" in item:
            inputs.append(oc.tensor_from_values(name, datatype, shape, item["data"]))
        else:
            raise RequestError(f"input {name!r} carries no 'data' and no binary_data_size")
    if offset != len(binary):
        raise RequestError(f"{len(binary) - offset} bytes of binary data belong to no input")
    binary_default = oc.parameter_flag(parameters, "binary_data_output")
    fp16 = oc.parameter_flag(parameters, oc.FP16_PARAMETER)
    requested = []
    binary_of: dict[str, bool] = {}
    outputs = request.get("outputs") or []
    if not isinstance(outputs, list):  # a number is no list of outputs (it was a TypeError: a 500)
        raise RequestError("output #0 must be an object with a 'name'")
    for index, item in enumerate(outputs):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise RequestError(f"output #{index} must be an object with a 'name'")
        output_parameters = item.get("parameters")
        if not isinstance(output_parameters, dict):  # as embserve-server: no parameters
            output_parameters = {}
        requested.append(oc.RequestedOutput(item["name"], fp16 or oc.parameter_flag(output_parameters, "output_fp16")))
        if "binary_data" in output_parameters:
            binary_of[item["name"]] = oc.parameter_flag(output_parameters, "binary_data")
    request["_binary_of"] = binary_of
    return request, inputs, requested, binary_default, fp16


def infer_response(request: dict[str, Any], result: Any, binary_default: bool) -> HttpResponse:
    binary_of = request["_binary_of"]
    outputs, blobs = [], []
    for output in result.outputs:
        entry: dict[str, Any] = {"name": output.name, "datatype": output.datatype, "shape": list(output.shape)}
        if binary_of.get(output.name, binary_default):
            raw = output.raw()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = output.data.float().reshape(-1).tolist()
        outputs.append(entry)
    payload: dict[str, Any] = {"model_name": result.model.name, "model_version": result.model.version}
    if "id" in request:
        payload["id"] = request["id"]
    payload["outputs"] = outputs
    header = json.dumps(payload, separators=(",", ":")).encode()
    if not blobs:
        return HttpResponse(HTTPStatus.OK, header, (("Content-Type", "application/json"),))
    return HttpResponse(
        HTTPStatus.OK,
        header + b"".join(blobs),
        (("Content-Type", "application/octet-stream"), ("Inference-Header-Content-Length", str(len(header)))),
    )


# ------------------------------------------------------------------------------------------ server
class RestServer:
    """``/v2`` health, metadata, infer and repository routes over HTTP/1.1 (keep-alive), TLS optional."""

    def __init__(self, oip: OpenInference, config: Any) -> None:
        self.oip = oip
        self.metrics = oip.metrics
        self.max_body = int(config.max_message_bytes)
        self._expected = f"Bearer {config.auth_token}".encode() if config.auth_token else None
        self._ssl: ssl.SSLContext | None = None
        if config.tls_cert and config.tls_key:
            self._ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._ssl.load_cert_chain(config.tls_cert, config.tls_key)
        # a worker of a multi-process instance shares the instance's REST port (server/workers.py holds it)
        self._reuse_port = config.processes > 1
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._connections: set[asyncio.Task[None]] = set()
        # connection -> when it began waiting for its next request (accepted, or answered with keep-alive)
        self._waiting: dict[asyncio.StreamWriter, float] = {}
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.last_arrival = 0.0  # time.monotonic() of the latest request (a drain's grace waits for quiet)
        self.closing = False  # set by stop_accepting: every answer from then on closes its connection

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); a port in use is a ``ConfigError`` naming it."""
        try:
            self._server = await asyncio.start_server(
                self._connection, host, port, ssl=self._ssl, limit=_MAX_LINE, reuse_port=self._reuse_port
            )
        except OSError as err:
            raise bind_error(Port("HTTP", host, port, "--http-port"), err) from None
        bound = int(self._server.sockets[0].getsockname()[1])
        logger.info("Open Inference Protocol REST on port %d", bound)
        return bound

    def stop_accepting(self) -> None:
        """The first step of a stop: the listening socket closes (a new connection is refused) and every
        answer from now on says ``Connection: close`` and closes its connection, so a client's next request
        goes to a closed port (connection refused, which clients retry) instead of racing our close."""
        self.closing = True
        if self._server is not None:
            self._server.close()

    async def wait_answered(self) -> None:
        """Return once no request is being answered (its response written)."""
        while self._in_flight:
            await self._idle.wait()

    async def close(self, grace: float | None = None, linger_s: float = 0.0) -> None:
        """Stop accepting; let requests in flight finish (up to ``grace`` s); then close each connection once
        its client cannot be sending on it: a connection whose last answer kept it alive (sent before the stop)
        stays open until its next request is answered (with ``Connection: close``) or it went unused for
        ``linger_s``. Closing it sooner races a client that is sending its next request right then: the
        request meets a reset, which no client can tell from a lost call (a refused connection or a 503 it
        retries). What is still open at ``grace`` closes."""
        if self._server is None:
            return
        self.stop_accepting()
        deadline = time.monotonic() + (grace or 0.0)
        try:
            await asyncio.wait_for(self.wait_answered(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            pass
        while self._writers and time.monotonic() < deadline:
            now = time.monotonic()
            unused = [writer for writer, since in self._waiting.items() if now - since >= linger_s]
            for writer in unused:
                del self._waiting[writer]
                writer.close()
            if len(unused) == len(self._writers):
                break
            waits = [since + linger_s - now for since in self._waiting.values()]
            await asyncio.sleep(min([_LINGER_POLL_S, *waits, max(0.0, deadline - time.monotonic())]))
        for writer in list(self._writers):
            writer.close()
        if self._connections:  # each one flushes what it wrote and closes its socket
            await asyncio.wait(set(self._connections), timeout=max(1.0, deadline - time.monotonic()))
        self._server = None

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        self._writers.add(writer)
        self._waiting[writer] = time.monotonic()
        try:
            await self._serve_connection(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass  # the client went away, or sent a line past the limit: nothing left to answer
        finally:
            self._writers.discard(writer)
            self._waiting.pop(writer, None)
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass
            if task is not None:
                self._connections.discard(task)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                request = await read_request(reader, self.max_body, lambda: self._waiting.pop(writer, None))
            except HttpError as err:
                writer.write(_serialize(_json_response({"error": str(err)}, err.status), keep_alive=False))
                await writer.drain()
                return
            if request is None:
                return
            self._in_flight += 1
            self._idle.clear()
            self.last_arrival = time.monotonic()
            try:
                response = await self._respond(request)
                keep_alive = request.keep_alive and not self.closing
                writer.write(_serialize(response, keep_alive))
                await writer.drain()  # in flight until written: a stop waits for the whole answer
            finally:
                self._in_flight -= 1
                if not self._in_flight:
                    self._idle.set()
            if not keep_alive:
                return
            self._waiting[writer] = time.monotonic()

    def _authorized(self, request: HttpRequest) -> bool:
        if self._expected is None or request.path.startswith(_OPEN_PATHS):
            return True
        given = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(given, self._expected)

    async def _respond(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        operation, code, reason = "REST", grpc.StatusCode.OK, ""
        try:
            if not self._authorized(request):
                code = grpc.StatusCode.UNAUTHENTICATED
                return _error_response(code, "missing or wrong bearer token (header 'Authorization')")
            operation, work = self._route(request)
            return await work
        except REJECTIONS as err:
            code, message, reason = rejection(err)
        except Exception as err:  # noqa: BLE001 - the client gets 500 and a request id, the log gets the traceback
            request_id = uuid.uuid4().hex[:12]
            self.oip.pipeline.log_internal(operation, err, request_id)  # once per kind, then at powers of ten
            code, message = grpc.StatusCode.INTERNAL, f"internal error (request id {request_id}); see the server log"
            reason = "internal"
        finally:
            if reason:
                self.metrics.rejected.labels(reason).inc()
            self.metrics.requests.labels(operation, code.name).inc()
            self.metrics.latency.labels(operation).observe(time.perf_counter() - started)
        return _error_response(code, bounded(message))

    def _route(self, request: HttpRequest) -> tuple[str, Any]:
        """(metrics label, coroutine answering the request) of a path; NOT_FOUND for anything else."""
        path, method = request.path.rstrip("/") or "/", request.method
        if method == "GET" and path in ("/v2/health/live", "/v2/health/ready"):
            ok = path.endswith("live") or self.oip.is_ready
            return "REST health", _done(HttpResponse(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE))
        if method == "GET" and path == "/v2":
            return "REST ServerMetadata", _done(_json_response(self.oip.server_metadata()))
        if method == "GET" and path == "/v2/models/stats":  # every model's (Triton's route; no model "stats")
            return "REST ModelStatistics", self._answer(self.oip.model_statistics, "", "")
        match = _MODEL_PATH.match(path)
        if match is not None:
            name, version, action = unquote(match["name"]), unquote(match["version"] or ""), match["action"]
            if method == "GET" and action is None:
                return "REST ModelMetadata", self._answer(self.oip.model_metadata, name, version)
            if method == "GET" and action == "/config":
                return "REST ModelConfig", self._answer(self.oip.model_config, name, version)
            if method == "GET" and action == "/stats":
                return "REST ModelStatistics", self._answer(self.oip.model_statistics, name, version)
            if method == "GET" and action == "/ready":
                ready = self.oip.model_ready(name, version)
                return "REST ModelReady", _done(HttpResponse(HTTPStatus.OK if ready else HTTPStatus.BAD_REQUEST))
            if method == "POST" and action == "/infer":
                return "REST ModelInfer", self._infer(name, version, request)
        if method == "POST" and path == "/v2/repository/index":
            return "REST RepositoryIndex", self._index(request.body)
        match = _REPOSITORY_PATH.match(path)
        if match is not None and method == "POST":
            name = unquote(match["name"])
            if match["action"] == "load":
                return "REST RepositoryModelLoad", self._repository(self.oip.models.load(name))
            return "REST RepositoryModelUnload", self._repository(self.oip.models.unload(name))
        raise Failure(
            grpc.StatusCode.NOT_FOUND, f"no route {method} {request.path}; see the /v2 routes in the README", "no_route"
        )

    async def _answer(self, call: Any, name: str, version: str) -> HttpResponse:
        """A GET of one of the protocol's JSON documents (metadata, configuration, statistics)."""
        return _json_response(call(name, version))

    async def _index(self, body: bytes) -> HttpResponse:
        """Triton's ``POST /v2/repository/index``: an optional body ``{"ready": true}``; a JSON list back."""
        check_json_depth(body)
        try:
            options = json.loads(body) if body.strip() else {}
        except (ValueError, UnicodeDecodeError) as err:
            raise RequestError(f"the repository index request is not valid JSON: {err}") from None
        if not isinstance(options, dict) or not isinstance(options.get("ready", False), bool):
            raise RequestError('the repository index request must be a JSON object like {"ready": true}')
        return _json_response(self.oip.repository_index(options.get("ready", False)))

    async def _repository(self, work: Any) -> HttpResponse:
        await work
        return _json_response({})

    async def _infer(self, name: str, version: str, request: HttpRequest) -> HttpResponse:
        parsed, inputs, requested, binary_default, fp16 = parse_infer_body(
            request.body, request.headers.get(HEADER_LENGTH)
        )
        result = await self.oip.infer(name, version, lambda: inputs, requested, fp16)
        return infer_response(parsed, result, binary_default)


async def _done(response: HttpResponse) -> HttpResponse:
    return response
