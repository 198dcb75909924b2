# ruff: noqa: E402
"""Fuzzed Open Inference Protocol REST against the sanitizer build of the native server (embserve-server-asan).

A small exported model (three features on two tables, a dense part) is served by ``embserve serve --native`` with
``EMBSERVE_SERVER_BIN`` pointing at the AddressSanitizer + UndefinedBehaviorSanitizer build. Seeded mutations of
valid ``/v2`` requests go to it over several keep-alive connections: JSON bodies with wrong types, shapes, ids
out of range, huge or negative lengths, syntax errors and deep nesting; binary-tensor bodies with bad
``Inference-Header-Content-Length`` and ``binary_data_size``; bad framing (Content-Length, chunked, encodings),
truncated and oversized bodies, bad request lines and headers, bad paths and methods, pipelined requests (only the
first answer is read: cpp-httplib 0.11 drops the bytes of a pipelined request past the first; the client waits for
its keep-alive timeout).

Every answer must be a well-formed HTTP/1.1 response (status line, headers, a body of its Content-Length; an
error's body ``{"error": "..."}``) with a status of its input class (``CLASSES``), never a 5xx; every 200 to a
valid request must carry the outputs an in-process ``Runtime`` computes for it (embeddings bit-equal, scores to
float rounding). A sample of the cases also goes to the Python server (``embserve serve``) on the same model: its
status family (2xx, 4xx, 5xx, closed) must equal the native one, case by case, except in ``LENIENT`` classes
(where the two HTTP readers differ by design); exact status differences are counted too. At the end the native
server must still answer a valid request correctly, exit 0 on SIGTERM, and its stderr must hold no sanitizer report.

Prints one JSON line per input class (requests, native status histogram, the Python sample's, mismatches) and a
summary line (requests, req/s, sanitizer reports, failures, load average).

    python bench/rest_fuzz.py                        # 100,000 requests, 8 connections, 3,000 compared
    python bench/rest_fuzz.py --requests 500 --compare 200 --binary cpp_loader/build/server/embserve-server-asan
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import numpy as np
import torch

from bench.served import HOST, ServedProcess, free_port
from infer.artifact.export import export
from infer.artifact.load import load
from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.demo import DemoOverArch
from infer.features import SparseFeatures
from infer.quant.quantize import quantize
from infer.weights import random_weights

MODEL = "fuzz"  # the artifact's folder name, the model's name on both servers
NUM_DENSE = 4
MAX_BATCH = 32  # --max-batch-size of both servers
MAX_BODY = 1 << 20  # --max-message-mb 1
HEADER_LENGTH = "Inference-Header-Content-Length"
SANITIZER_REPORT = re.compile(
    r"ERROR: AddressSanitizer|ERROR: LeakSanitizer|AddressSanitizer:DEADLYSIGNAL|runtime error:|"
    r"UndefinedBehaviorSanitizer"
)
SANITIZER_ENV = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}
BUILT = Path(__file__).resolve().parents[1] / "cpp_loader" / "build" / "server" / "embserve-server-asan"
FAILED = -2  # the status of a case whose answer failed a check before its status was read
NO_LENGTH = "none"  # http(length=NO_LENGTH): no Content-Length header
CLOSED = 0  # the status of a case the server answered by closing the connection

# the statuses each input class may get (CLOSED: no answer, the connection closed)
CLASSES: dict[str, frozenset[int]] = {
    "valid_infer": frozenset({200}),
    "valid_get": frozenset({200}),
    "pipelined": frozenset({200}),
    "wrong_type": frozenset({200, 400}),  # a wrong type where any value passes (an id, a flag) is still valid
    "bad_shape": frozenset({200, 400}),  # a shape of as many elements in another nesting passes
    "id_out_of_range": frozenset({400}),
    "bad_lengths": frozenset({400}),
    "bad_batch": frozenset({400}),
    "bad_names": frozenset({400}),
    "json_syntax": frozenset({200, 400}),  # a flipped byte can leave valid JSON
    "deep_nesting": frozenset({400}),
    "binary_header": frozenset({400}),
    "framing": frozenset({400, 411, 413, 415, CLOSED}),
    "truncated_body": frozenset({400, CLOSED}),
    "oversized_body": frozenset({413, CLOSED}),
    "bad_path": frozenset({200, 400, 404}),  # a path can name a route another way (?query, %31 for version 1)
    "bad_method": frozenset({400, 404, 405}),
    "bad_http": frozenset({200, 400, 431, CLOSED}),  # a header value of odd bytes is still a header
    "lenient_http": frozenset({200, 400, 404}),
    "long_lines": frozenset({200, 400, 404, 414, CLOSED}),
    "json_extensions": frozenset({200, 400}),
}
# Classes whose status families are not compared, each for a difference between the HTTP readers (cpp-httplib 0.11
# in the native server, the Python server's own): a HEAD is a GET without the body in httplib and no route in
# Python (which also writes the 404's body after a HEAD); a lower-case method is refused by httplib and upper-cased
# by Python; a header line without a colon, or folded, is skipped by httplib and refused by Python; bare-LF line
# ends are refused by httplib and taken by Python; lines past 8 KiB are refused by httplib (414, 400) and taken by
# Python up to 64 KiB (past it the connection closes); NaN, Infinity and numbers past a double (RFC 8259 has none)
# are refused by nlohmann's parser and taken by Python's json (as NaN or infinity).
LENIENT = frozenset({"lenient_http", "long_lines", "json_extensions"})


# ------------------------------------------------------------------------------------------ model
def fuzz_spec() -> ModelSpec:
    tables = (
        TableConfig("t_ab", 100, 16, ("fa", "fb"), PoolingType.SUM, DataType.INT8),
        TableConfig("t_c", 50, 8, ("fc",), PoolingType.MEAN, DataType.FP16),
    )
    with torch.random.fork_rng():
        torch.manual_seed(1)
        arch = DemoOverArch(NUM_DENSE, 16 * 2 + 8, hidden=8).eval()
    return ModelSpec(tables, NUM_DENSE, arch)


@dataclass(frozen=True)
class Example:
    """A valid batch and the outputs the in-process runtime computes for it."""

    features: dict[str, tuple[list[int], list[int]]]  # feature -> (ids, lengths)
    weights: dict[str, list[float]] | None
    dense: list[list[float]]
    embeddings: np.ndarray  # float32 [B, D]
    scores: np.ndarray  # float32 [B]


def make_pool(runtime, spec: ModelSpec, size: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    rows = {f: t.num_embeddings for t in spec.tables for f in t.feature_names}
    pool = []
    for index in range(size):
        batch = rng.randint(1, 8)
        features = {}
        for name in spec.feature_names:
            lengths = [rng.randint(0, 4) for _ in range(batch)]
            features[name] = ([rng.randrange(rows[name]) for _ in range(sum(lengths))], lengths)
        weighted = index % 4 == 3
        weights = (
            {n: [round(rng.uniform(0.0, 2.0), 3) for _ in ids] for n, (ids, _) in features.items()}
            if weighted
            else None
        )
        dense = [[round(rng.gauss(0, 1), 4) for _ in range(NUM_DENSE)] for _ in range(batch)]
        names = spec.feature_names
        values = torch.tensor([i for n in names for i in features[n][0]], dtype=torch.int64)
        lengths = torch.tensor([x for n in names for x in features[n][1]], dtype=torch.int32)
        weight = torch.tensor([w for n in names for w in weights[n]], dtype=torch.float32) if weights else None
        sparse = SparseFeatures(names, values, lengths, weight)
        dense_tensor = torch.tensor(dense, dtype=torch.float32)
        pool.append(
            Example(
                features,
                weights,
                dense,
                runtime.lookup(sparse).numpy().astype(np.float32),
                runtime.predict(sparse, dense_tensor).numpy().astype(np.float32),
            )
        )
    return pool


# ------------------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    kind: str  # an input class of CLASSES
    wire: bytes  # every byte sent
    answers: int = 1  # requests in ``wire`` (pipelined); only the first one's answer is read (see drive)
    example: int | None = None  # the pool example a 200 must answer (valid infer requests)
    head: bool = False  # a HEAD request: its answer has no body
    half_close: bool = False  # the client shuts its side after sending (a body that never comes)


def http(
    method: str,
    path: str,
    body: bytes = b"",
    headers: tuple[tuple[str, str], ...] = (),
    length: str | None = None,
    version: str = "HTTP/1.1",
) -> bytes:
    """A request's bytes; ``length``: the Content-Length to claim (None: the body's, absent for no body)."""
    lines = [f"{method} {path} {version}", f"Host: {HOST}"]
    lines += [f"{name}: {value}" for name, value in headers]
    if length == NO_LENGTH:
        pass
    elif length is not None:
        lines.append(f"Content-Length: {length}")
    elif body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class Draft:
    """A valid infer request being built and mutated: its JSON header and binary tensors (input order)."""

    doc: dict
    blobs: list[bytes] = field(default_factory=list)

    def body(self) -> tuple[bytes, tuple[tuple[str, str], ...]]:
        header = json.dumps(self.doc, separators=(",", ":")).encode()
        if not self.blobs:
            return header, ()
        return header + b"".join(self.blobs), ((HEADER_LENGTH, str(len(header))),)


_NUMPY = {"INT64": np.int64, "INT32": np.int32, "FP32": np.float32}


def encode(rng: random.Random, example: Example, binary: bool) -> Draft:
    """A valid request for ``example``: per-feature values and lengths or offsets (INT32 or INT64), optional
    weights and dense features, in a shuffled order; outputs asked for in one of the ways the protocol allows."""
    tensors: list[tuple[str, str, list, list]] = []  # name, datatype, shape, flat data
    for name, (ids, lengths) in example.features.items():
        tensors.append((f"{name}__values", rng.choice(("INT64", "INT32")), [len(ids)], ids))
        if rng.random() < 0.3:
            offsets = [0]
            for n in lengths:
                offsets.append(offsets[-1] + n)
            tensors.append((f"{name}__offsets", rng.choice(("INT64", "INT32")), [len(offsets)], offsets))
        else:
            tensors.append((f"{name}__lengths", rng.choice(("INT64", "INT32")), [len(lengths)], lengths))
        if example.weights is not None:
            tensors.append((f"{name}__weights", "FP32", [len(ids)], example.weights[name]))
    want = rng.choice(("default", "embeddings", "scores", "both"))
    if want != "embeddings" or rng.random() < 0.5:
        flat = [x for row in example.dense for x in row]
        tensors.append(("dense_features", "FP32", [len(example.dense), NUM_DENSE], flat))
    elif want == "default":
        want = "embeddings"
    rng.shuffle(tensors)
    inputs, blobs = [], []
    for name, datatype, shape, data in tensors:
        item: dict = {"name": name, "datatype": datatype, "shape": shape}
        if binary:
            raw = np.asarray(data, dtype=_NUMPY[datatype]).tobytes()
            item["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        elif len(shape) == 2 and rng.random() < 0.5:
            item["data"] = [data[i : i + shape[1]] for i in range(0, len(data), shape[1])]  # nested rows
        else:
            item["data"] = list(data)  # a copy: mutations must leave the pool alone
        inputs.append(item)
    doc: dict = {"inputs": inputs}
    if rng.random() < 0.3:
        doc["id"] = f"req-{rng.randrange(10**6)}"
    parameters: dict = {}
    if rng.random() < 0.3:
        parameters["binary_data_output"] = True
    if want != "scores" and rng.random() < 0.2:
        parameters["output_fp16"] = True
    if parameters:
        doc["parameters"] = parameters
    names = {"embeddings": ["embeddings"], "scores": ["scores"], "both": ["embeddings", "scores"]}.get(want, [])
    if names:
        outputs = []
        for name in rng.sample(names, len(names)):
            out: dict = {"name": name}
            if rng.random() < 0.4:
                out["parameters"] = {"binary_data": rng.random() < 0.5}
            outputs.append(out)
        doc["outputs"] = outputs
    return Draft(doc, blobs)


def infer_path(rng: random.Random) -> str:
    return rng.choice((f"/v2/models/{MODEL}/infer", f"/v2/models/{MODEL}/versions/1/infer"))


def post(draft: Draft, rng: random.Random, extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    body, headers = draft.body()
    return http("POST", infer_path(rng), body, headers + extra)


_ODD_VALUES: tuple = (None, True, False, 0, -1, 1.5, -7, "x", "", [], {}, [[1]], {"a": 1}, 2**64, -(2**63) - 1, 1e308)


def _inputs(draft: Draft) -> list[dict]:
    return draft.doc["inputs"]


def _pick_input(rng: random.Random, draft: Draft, suffix: str = "") -> dict:
    candidates = [i for i in _inputs(draft) if i["name"].endswith(suffix)]
    return rng.choice(candidates or _inputs(draft))


def _set_data(draft: Draft, item: dict, data: list, datatype: str | None = None) -> None:
    """Replace an input's data (JSON or binary form), keeping its shape."""
    datatype = datatype or item["datatype"]
    if "data" in item:
        item["data"] = data
        return
    index = _inputs(draft).index(item)
    raw = np.asarray(data, dtype=_NUMPY.get(datatype, np.int64)).tobytes()
    draft.blobs[index] = raw
    item["parameters"]["binary_data_size"] = len(raw)


def _flat(item: dict, draft: Draft) -> list:
    if "data" in item:
        data = item["data"]
        return [x for row in data for x in row] if data and isinstance(data[0], list) else list(data)
    raw = draft.blobs[_inputs(draft).index(item)]
    return np.frombuffer(raw, dtype=_NUMPY[item["datatype"]]).tolist()


def mutate_wrong_type(rng: random.Random, draft: Draft) -> None:
    odd = rng.choice(_ODD_VALUES)
    item = _pick_input(rng, draft)
    where = rng.choice(("inputs", "input", "name", "datatype", "shape", "dim", "data", "datum", "parameters",
                        "input_parameters", "size", "outputs", "output", "output_name"))  # fmt: skip
    if where == "inputs":
        draft.doc["inputs"] = odd
    elif where == "input":
        _inputs(draft)[_inputs(draft).index(item)] = odd
    elif where in ("name", "datatype", "shape", "parameters"):
        (item if where != "parameters" else draft.doc)[where] = odd
    elif where == "dim" and item["shape"]:
        item["shape"][rng.randrange(len(item["shape"]))] = odd
    elif where == "data" and "data" in item:
        item["data"] = odd
    elif where == "datum" and "data" in item and item["data"]:
        item["data"][rng.randrange(len(item["data"]))] = odd
    elif where == "input_parameters":
        item["parameters"] = odd
    elif where == "size" and "parameters" in item:
        item["parameters"]["binary_data_size"] = odd
    elif where == "outputs":
        draft.doc["outputs"] = odd
    elif where == "output":
        draft.doc["outputs"] = [odd]
    else:
        draft.doc["outputs"] = [{"name": odd}]


def mutate_shape(rng: random.Random, draft: Draft) -> None:
    item = _pick_input(rng, draft)
    shape = item["shape"]
    how = rng.randrange(7)
    if how == 0 and shape:
        shape[0] += rng.choice((-1, 1, 2))
    elif how == 1:
        shape.append(rng.choice((1, 2, 0)))
    elif how == 2:
        item["shape"] = []
    elif how == 3:
        item["shape"] = [-rng.randint(1, 5)] + shape[1:]
    elif how == 4:
        item["shape"] = [rng.choice((2**31, 2**40, 2**62, 2**63 - 1))] + shape[1:]
    elif how == 5:
        item["shape"] = [2**40, 2**40, 2**40]  # a product past int64
    elif "data" in item:
        item["data"] = [item["data"]]  # one more level of nesting


def mutate_ids(rng: random.Random, draft: Draft, rows: dict[str, int]) -> None:
    item = _pick_input(rng, draft, "__values")
    feature = item["name"].split("__")[0]
    ids = _flat(item, draft)
    if not ids:
        ids = [0]
        item["shape"] = [1]
        length_item = next((i for i in _inputs(draft) if i["name"] == f"{feature}__lengths"), None)
        if length_item is None:  # offsets: make it a one-id batch's
            length_item = next(i for i in _inputs(draft) if i["name"] == f"{feature}__offsets")
            data = _flat(length_item, draft)
            _set_data(draft, length_item, data[:-1] + [data[-1] + 1])
        else:
            lengths = _flat(length_item, draft)
            _set_data(draft, length_item, [lengths[0] + 1] + lengths[1:])
    bad = rng.choice((rows[feature], rows[feature] + rng.randint(1, 1000), -1, -rng.randint(2, 2**31), 2**31 - 1))
    if item["datatype"] == "INT64":
        bad = rng.choice((bad, 2**63 - 1, -(2**63), 2**40))
    ids[rng.randrange(len(ids))] = bad
    _set_data(draft, item, ids)


def mutate_lengths(rng: random.Random, draft: Draft) -> None:
    candidates = [i for i in _inputs(draft) if i["name"].endswith(("__lengths", "__offsets"))]
    item = rng.choice(candidates)
    data = _flat(item, draft)
    wide = item["datatype"] == "INT64"
    how = rng.randrange(5)
    position = rng.randrange(len(data))
    if how == 0:
        data[position] = -rng.choice((1, 2, 2**31 - 1))
    elif how == 1:
        data[position] = rng.choice((2**31 - 1, 2**40 if wide else 2**31 - 1, 10**6))
    elif how == 2:
        data[-1 if item["name"].endswith("__offsets") else position] += rng.choice((1, 2))  # past the feature's ids
    elif how == 3 and item["name"].endswith("__offsets"):
        data[0] = 1  # offsets that do not start at 0
    else:
        data = data + [1]  # one more bag than the batch
        item["shape"] = [len(data)]
    _set_data(draft, item, data)


def mutate_batch(rng: random.Random, draft: Draft, example: Example) -> None:
    how = rng.randrange(3)
    dense = next((i for i in _inputs(draft) if i["name"] == "dense_features"), None)
    if how == 0 or dense is None:
        # every feature MAX_BATCH + k bags (all empty), past the server's --max-batch-size
        batch = MAX_BATCH + rng.randint(1, 100)
        draft.doc = {"inputs": []}
        draft.blobs = []
        for name in example.features:
            draft.doc["inputs"].append({"name": f"{name}__values", "datatype": "INT64", "shape": [0], "data": []})
            draft.doc["inputs"].append(
                {"name": f"{name}__lengths", "datatype": "INT32", "shape": [batch], "data": [0] * batch}
            )
    elif how == 1:
        flat = _flat(dense, draft)
        dense["shape"] = [dense["shape"][0], NUM_DENSE + 1]
        _set_data(draft, dense, flat + [0.5] * dense["shape"][0], "FP32")
    else:
        batch = dense["shape"][0] + 1
        dense["shape"] = [batch, NUM_DENSE]
        _set_data(draft, dense, [0.25] * (batch * NUM_DENSE), "FP32")
        draft.doc["outputs"] = [{"name": "scores"}]


def mutate_names(rng: random.Random, draft: Draft) -> None:
    how = rng.randrange(6)
    item = _pick_input(rng, draft)
    if how == 0:
        item["name"] = rng.choice(("bogus", "fa__ids", "fz__values", "__values", "fa__", "dense", "fa__values\x00"))
    elif how == 1:  # a feature's values or lengths missing
        roles = [i for i in _inputs(draft) if i["name"].endswith(("__values", "__lengths", "__offsets"))]
        index = _inputs(draft).index(rng.choice(roles))
        del _inputs(draft)[index]
        if draft.blobs:
            del draft.blobs[index]
    elif how == 2:  # an input twice
        index = _inputs(draft).index(item)
        _inputs(draft).append(json.loads(json.dumps(item)))
        if draft.blobs:
            draft.blobs.append(draft.blobs[index])
    elif how == 3:
        draft.doc["outputs"] = [{"name": rng.choice(("zzz", "EMBEDDINGS", "", "scores\x00"))}]
    elif how == 4:
        draft.doc["outputs"] = [{"name": "embeddings"}, {"name": "embeddings"}]
    else:
        item["datatype"] = rng.choice(("INT8", "UINT64", "FP16", "FP64", "BYTES", "BOOL", "", "int64"))


def json_syntax(rng: random.Random, draft: Draft) -> bytes:
    body, headers = Draft(draft.doc).body()
    how = rng.randrange(7)
    if how == 0:
        body = body[: rng.randrange(len(body))]  # a strict prefix of an object is never JSON
    elif how == 1:
        position = rng.randrange(len(body))
        body = body[:position] + bytes([rng.randrange(256)]) + body[position + 1 :]
    elif how == 2:
        body = body.replace(b'"inputs"', b'"inputs":[],"inputs"', 1)  # a key twice
    elif how == 3:
        body = body[:-1] + rng.choice((b",}", b"}}", b"} x", b"\x00}"))
    elif how == 4:
        body = rng.choice((b"", b" ", b"null", b"[]", b'"x"', b"1", b"{", b"\xff\xfe", b'{"inputs":{}}'))
    elif how == 5:
        body = body.replace(b'"name":"', b'"name":"\xc3\x28', 1)  # invalid UTF-8 in a string
    else:
        body = body[:-1] + rng.choice((b',"x":[1,2]}', b',"x":"y"}', b',"outputs":""}', b',"parameters":""}'))
    return http("POST", infer_path(rng), body, headers)


def json_extensions(rng: random.Random, draft: Draft) -> bytes:
    """Numbers RFC 8259 has not (see LENIENT)."""
    body, headers = Draft(draft.doc).body()
    if rng.random() < 0.5:
        body = body[:-1] + rng.choice((b',"x":NaN}', b',"x":1e400}', b',"x":-Infinity}'))
    else:
        body = body.replace(b"[", rng.choice((b"[NaN,", b"[Infinity,", b"[-1e999,", b"[1e400,")), 1)
    return http("POST", infer_path(rng), body, headers)


def deep_nesting(rng: random.Random, draft: Draft) -> bytes:
    depth = rng.choice((200, 1000, 5000, 50_000, 300_000))
    opener, closer = rng.choice(((b"[", b"]"), (b'{"a":', b"}")))
    depth = min(depth, (MAX_BODY - 200) // (2 * (len(opener) + len(closer))))  # the last form nests 1.5 times
    nest = opener * depth + b"1" + closer * depth
    where = rng.randrange(5)
    if where == 0:
        body = nest
    elif where == 1:  # an input's data
        body = b'{"inputs":[{"name":"fa__values","datatype":"INT64","shape":[1],"data":' + nest + b"}]}"
    elif where == 2:  # a datatype that is no string (its words print it)
        body = b'{"inputs":[{"name":"fa__values","datatype":' + nest + b',"shape":[1],"data":[1]}]}'
    elif where == 3:
        body = b'{"inputs":[],"parameters":' + nest + b"}"
    else:
        body = b'{"inputs":[],"id":' + nest + b',"outputs":[{"name":' + nest[: len(nest) // 2] + b"}]}"
    return http("POST", infer_path(rng), body)


def binary_header(rng: random.Random, draft: Draft) -> bytes:
    if not draft.blobs:
        raise ValueError("a binary draft")
    body, headers = draft.body()
    header_size = int(headers[0][1])
    how = rng.randrange(8)
    if how == 0:
        value = rng.choice(("x", "", "-1", "1e3", "0x10", " ", "99999999999999999999999", "+-3", "٣"))
        headers = ((HEADER_LENGTH, value),)
    elif how == 1:
        headers = ((HEADER_LENGTH, str(len(body) + rng.randint(1, 10**6))),)
    elif how == 2:
        headers = ((HEADER_LENGTH, str(rng.randrange(header_size))),)  # cuts the JSON
    elif how == 3:
        item = rng.choice(_inputs(draft))
        item["parameters"]["binary_data_size"] += rng.choice((-1, 1, 7, 10**9, -(10**9)))
        body, headers = draft.body()
    elif how == 4:
        item = rng.choice(_inputs(draft))
        item["parameters"]["binary_data_size"] = rng.choice((2**63 - 1, 2**64, -(2**63), 1.0, "8", True))
        body, headers = draft.body()
    elif how == 5:
        body = body[: header_size + rng.randrange(max(1, len(body) - header_size))]  # binary part cut short
    elif how == 6:
        body = body + bytes(rng.randint(1, 64))  # bytes that belong to no input
    else:
        headers = ((HEADER_LENGTH, str(header_size)), (HEADER_LENGTH, str(header_size + 1)))
    return http("POST", infer_path(rng), body, headers)


def framing(rng: random.Random, draft: Draft) -> bytes:
    body, headers = draft.body()
    how = rng.randrange(8)
    if how == 0:
        return http("POST", infer_path(rng), body, headers, length=rng.choice(("x", "", "1e3", "0x10", "١", "5 5")))
    if how == 1:
        return http(
            "POST", infer_path(rng), body[:10], headers, length=str(rng.choice((-1, MAX_BODY + 1, 2**62, 10**30)))
        )
    if how == 2:
        chunk = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        return http("POST", infer_path(rng), chunk, headers + (("Transfer-Encoding", "chunked"),), length=NO_LENGTH)
    if how == 3:
        return http("POST", infer_path(rng), body, headers + (("Content-Encoding", rng.choice(("br", "zstd", "x"))),))
    if how == 4:
        return http("POST", infer_path(rng), b"\x1f\x8b\x08garbage", headers + (("Content-Encoding", "gzip"),))
    if how == 5:  # a gzip bomb: 1 KiB that inflates to 4 MiB (past the body bound)
        return http("POST", infer_path(rng), _BOMB, headers + (("Content-Encoding", "gzip"),))
    if how == 6:  # two Content-Lengths that disagree
        return http("POST", infer_path(rng), body, headers + (("Content-Length", str(len(body) + 5)),))
    return http("POST", infer_path(rng), body, headers, length=f"{len(body)}, {len(body)}")


_BOMB = gzip.compress(b" " * (4 * MAX_BODY))


def bad_path(rng: random.Random) -> bytes:
    pieces = ("v2", "models", MODEL, "versions", "1", "2", "infer", "ready", "config", "stats", "repository",
              "index", "health", "live", "..", ".", "%2e%2e", "%00", "%zz", "%", "nobody", "x" * 300,
              "\xe9")  # fmt: skip
    how = rng.randrange(5)
    if how == 0:
        path = "/" + "/".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
    elif how == 1:
        path = f"/v2/models/{rng.choice(pieces)}" + rng.choice(("", "/infer", "/ready", "/config", "/stats"))
    elif how == 2:
        path = f"/v2/models/{MODEL}/versions/{rng.choice(('0', '2', '-1', '1.0', '99999999999999999999', '%31'))}"
        path += rng.choice(("", "/ready", "/config", "/stats"))
    elif how == 3:
        path = "/v2/" + "a" * 1000
    else:
        path = rng.choice(("*", "v2", "http://x/v2", "//v2", "/v2//models", "/v2?x=1", "/v2#x", "/%76%32"))
    method = "GET" if how != 1 or rng.random() < 0.5 else "POST"
    return http(method, path, b"{}" if method == "POST" else b"")


VALID_GETS = (
    "/v2", "/v2/", "/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/ready",
    f"/v2/models/{MODEL}/config", f"/v2/models/{MODEL}/stats", "/v2/models/stats", f"/v2/models/{MODEL}/versions/1",
    f"/v2/models/{MODEL}/versions/1/ready", "/v2/health/live?x=1",
)  # fmt: skip


def bad_method(rng: random.Random) -> tuple[bytes, bool]:
    method = rng.choice(("PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO", "POST"))
    path = rng.choice(VALID_GETS[:4] + (f"/v2/models/{MODEL}/infer", f"/v2/models/{MODEL}/config"))
    if method == "POST" and path.endswith("infer"):
        method = "GET"
    return http(method, path, b"{}" if method in ("PUT", "PATCH", "POST") else b""), False


def lenient_http(rng: random.Random) -> tuple[bytes, bool]:
    """Requests the two servers' HTTP readers take differently (see LENIENT); the second item: a HEAD."""
    how = rng.randrange(5)
    if how == 0:
        return http("HEAD", rng.choice(VALID_GETS[:4])), True
    if how == 1:
        return http("get", rng.choice(VALID_GETS[:4])), False
    if how == 2:
        return b"GET /v2 HTTP/1.1\r\nno colon here\r\n\r\n", False
    if how == 3:
        return b"GET /v2 HTTP/1.1\r\n Folded: header\r\n\r\n", False
    return b"POST /v2/models/" + MODEL.encode() + b"/infer HTTP/1.1\nContent-Length: 2\n\n{}", False  # bare LFs


def bad_http(rng: random.Random) -> bytes:
    how = rng.choice((0, 2, 4, 5))
    if how == 0:
        return rng.choice((b"\x00\x01\x02\r\n\r\n", b"GET\r\n\r\n", b"GET /v2\r\n\r\n", b"GET /v2 HTTP/2.0\r\n\r\n",
                           b"GET  /v2  HTTP/1.1\r\n\r\n", b"\r\n\r\n", b"GET /v2 HTTP/1.1 extra\r\n\r\n"))  # fmt: skip
    if how == 2:
        return b"GET /v2 HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(rng.choice((101, 500)))) + b"\r\n"
    if how == 4:
        return b"GET /v2 HTTP/1.1\r\nX: \x00\xff\r\n" + b"Content-Length: 2\r\n\r\n{}x"  # then a stray byte
    return bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))) + b"\r\n\r\n"


def make_case(rng: random.Random, kind: str, pool: list[Example], rows: dict[str, int]) -> Case:
    index = rng.randrange(len(pool))
    example = pool[index]
    binary = rng.random() < 0.5
    draft = encode(rng, example, binary)
    if kind == "valid_infer":
        close = (("Connection", "close"),) if rng.random() < 0.02 else ()
        return Case(kind, post(draft, rng, close), example=index)
    if kind == "valid_get":
        if rng.random() < 0.1:
            return Case(kind, http("POST", "/v2/repository/index", rng.choice((b"", b"{}", b'{"ready":true}'))))
        return Case(kind, http("GET", rng.choice(VALID_GETS)))
    if kind == "pipelined":
        count = rng.randint(2, 4)
        wire = b"".join(http("GET", rng.choice(VALID_GETS)) for _ in range(count - 1)) + post(draft, rng)
        return Case(kind, wire, answers=count)
    if kind == "wrong_type":
        mutate_wrong_type(rng, draft)
    elif kind == "bad_shape":
        mutate_shape(rng, draft)
    elif kind == "id_out_of_range":
        mutate_ids(rng, draft, rows)
    elif kind == "bad_lengths":
        mutate_lengths(rng, draft)
    elif kind == "bad_batch":
        mutate_batch(rng, draft, example)
    elif kind == "bad_names":
        mutate_names(rng, draft)
    elif kind == "json_syntax":
        return Case(kind, json_syntax(rng, draft))
    elif kind == "json_extensions":
        return Case(kind, json_extensions(rng, draft))
    elif kind == "deep_nesting":
        return Case(kind, deep_nesting(rng, draft))
    elif kind == "binary_header":
        return Case(kind, binary_header(rng, draft if binary else encode(rng, example, True)))
    elif kind == "framing":
        return Case(kind, framing(rng, draft))
    elif kind == "truncated_body":
        body, headers = draft.body()
        wire = http("POST", infer_path(rng), body, headers)
        return Case(kind, wire[: len(wire) - rng.randint(1, len(body))], half_close=True)
    elif kind == "oversized_body":
        if rng.random() < 0.1:  # the whole body sent
            return Case(kind, http("POST", infer_path(rng), b" " * (MAX_BODY + 1)))
        return Case(kind, http("POST", infer_path(rng), b"{", length=str(MAX_BODY + rng.randint(1, 10**9))))
    elif kind == "bad_path":
        return Case(kind, bad_path(rng))
    elif kind == "bad_method":
        wire, head = bad_method(rng)
        return Case(kind, wire, head=head)
    elif kind == "bad_http":
        return Case(kind, bad_http(rng))
    elif kind == "long_lines":
        if rng.random() < 0.5:
            return Case(kind, http("GET", "/v2/" + "a" * rng.choice((9000, 70_000))))
        return Case(kind, b"GET /v2 HTTP/1.1\r\nX-Long: " + b"y" * rng.choice((9000, 70_000)) + b"\r\n\r\n")
    elif kind == "lenient_http":
        wire, head = lenient_http(rng)
        return Case(kind, wire, head=head)
    return Case(kind, post(draft, rng))


# the share of each class in the mix (valid requests a fifth: the batcher also merges good and bad neighbours)
WEIGHTS = {
    "valid_infer": 16, "valid_get": 4, "pipelined": 2, "wrong_type": 12, "bad_shape": 8, "id_out_of_range": 8,
    "bad_lengths": 8, "bad_batch": 4, "bad_names": 6, "json_syntax": 8, "deep_nesting": 2, "binary_header": 8,
    "framing": 4, "truncated_body": 2, "oversized_body": 2, "bad_path": 4, "bad_method": 2, "bad_http": 2,
    "lenient_http": 1, "long_lines": 1, "json_extensions": 1,
}  # fmt: skip


def make_cases(count: int, seed: int, pool: list[Example], rows: dict[str, int]) -> list[Case]:
    rng = random.Random(seed)
    kinds = list(WEIGHTS)
    weights = [WEIGHTS[k] for k in kinds]
    return [make_case(rng, kind, pool, rows) for kind in rng.choices(kinds, weights, k=count)]


# ------------------------------------------------------------------------------------------ client
class Malformed(Exception):
    """An answer that is no well-formed HTTP/1.1 response."""


@dataclass(frozen=True)
class Answer:
    status: int  # CLOSED: none, the connection closed
    headers: dict[str, str]
    body: bytes

    @property
    def closes(self) -> bool:
        return self.status == CLOSED or self.headers.get("connection", "").lower() == "close"


_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-5]\d\d)(?: [^\r\n]*)?")


class Connection:
    """A raw keep-alive connection: sends any bytes, reads answers strictly."""

    def __init__(self, port: int, timeout: float) -> None:
        self.port = port
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.buffer = b""

    def open(self) -> None:
        self.close()
        self.sock = socket.create_connection((HOST, self.port), timeout=self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _fill(self) -> bool:
        assert self.sock is not None
        try:
            data = self.sock.recv(1 << 16)
        except ConnectionResetError:
            data = b""
        self.buffer += data
        return bool(data)

    def send(self, wire: bytes, half_close: bool) -> None:
        if self.sock is None:
            self.open()
        assert self.sock is not None
        try:
            self.sock.sendall(wire)
            if half_close:
                self.sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before all was sent: its answer is read below

    def read(self, head: bool = False) -> Answer:
        """One answer; CLOSED when the connection ends before its first byte."""
        while b"\r\n\r\n" not in self.buffer:
            if len(self.buffer) > 1 << 16:
                raise Malformed(f"headers past 64 KiB: {self.buffer[:200]!r}")
            if not self._fill():
                if self.buffer:
                    raise Malformed(f"the connection closed inside an answer's headers: {self.buffer[:200]!r}")
                self.close()
                return Answer(CLOSED, {}, b"")
        head_bytes, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        lines = head_bytes.split(b"\r\n")
        match = _STATUS_LINE.fullmatch(lines[0])
        if match is None:
            raise Malformed(f"status line {lines[0][:200]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise Malformed(f"header line {line[:200]!r}")
            headers[name.decode("latin-1").lower()] = value.decode("latin-1").strip()
        status = int(match.group(1))
        if head or status in (204, 304):
            return Answer(status, headers, b"")
        if "content-length" not in headers:
            raise Malformed(f"an answer without Content-Length: {head_bytes[:200]!r}")
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            if not self._fill():
                raise Malformed(f"the body closed at {len(self.buffer)} of {length} bytes")
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return Answer(status, headers, body)


# ------------------------------------------------------------------------------------------ checks
def check(case: Case, answer: Answer, pool: list[Example]) -> str | None:
    """What is wrong with an answer (None: nothing)."""
    if answer.status not in CLASSES[case.kind]:
        return f"status {answer.status} for a {case.kind} case"
    if answer.status >= 400 and answer.body:
        try:
            error = json.loads(answer.body)
        except ValueError:
            return f"an error body that is not JSON: {answer.body[:200]!r}"
        if not isinstance(error, dict) or not isinstance(error.get("error"), str) or len(error) != 1:
            return f"an error body that is not {{'error': words}}: {answer.body[:200]!r}"
    if (
        answer.status == 200
        and case.example is not None
        and answer.headers.get("content-type", "").endswith(("json", "octet-stream"))
    ):
        if b"outputs" in answer.body[:4096]:
            return check_outputs(answer, pool[case.example])
    return None


def check_outputs(answer: Answer, example: Example) -> str | None:
    split = int(answer.headers.get(HEADER_LENGTH.lower(), len(answer.body)))
    header, blobs = json.loads(answer.body[:split]), answer.body[split:]
    batch = len(example.dense)
    offset = 0
    for output in header["outputs"]:
        name, datatype, shape = output["name"], output["datatype"], output["shape"]
        dtype = {"FP32": np.float32, "FP16": np.float16}[datatype]
        if "data" in output:
            got = np.asarray(output["data"], dtype=np.float64)
        else:
            size = output["parameters"]["binary_data_size"]
            got = np.frombuffer(blobs[offset : offset + size], dtype=dtype).astype(np.float64)
            offset += size
        if name == "embeddings":
            want = example.embeddings.astype(dtype).astype(np.float64)
            if shape != list(example.embeddings.shape) or not np.array_equal(got.reshape(shape), want):
                worst = float(np.abs(got - want.reshape(-1)).max()) if got.size == want.size else float("nan")
                return f"embeddings {datatype} {shape} differ from the runtime's (by up to {worst:.3g})"
        elif name == "scores":
            if shape != [batch] or not np.allclose(got, example.scores, rtol=1e-5, atol=1e-6):
                worst = float(np.abs(got - example.scores).max()) if got.size == batch else float("nan")
                return f"scores {shape} differ from the runtime's (by up to {worst:.3g})"
        else:
            return f"an output {name!r}"
    return None


@dataclass
class Tally:
    statuses: list[int]  # per case, the last answer's status (-1: not sent)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, text: str) -> None:
        with self.lock:
            self.failures.append(text)


CLOSING = frozenset({"bad_http", "lenient_http", "long_lines", "framing", "oversized_body"})


def drive(
    port: int, cases: list[Case], indices: list[int], connections: int, pool: list[Example], timeout: float
) -> Tally:
    """Send ``cases[i]`` for i in ``indices`` over ``connections`` keep-alive connections (one thread each)."""
    tally = Tally([-1] * len(cases))

    def worker(mine: list[int]) -> None:
        connection = Connection(port, timeout)
        for i in mine:
            case = cases[i]
            try:
                connection.send(case.wire, case.half_close)
                answer = connection.read(case.head)
                problem = check(case, answer, pool)
                if problem:
                    tally.fail(f"case {i} ({case.kind}): {problem}; sent {case.wire[:300]!r}")
                tally.statuses[i] = answer.status
                if case.half_close or case.head or case.answers > 1 or answer.closes or case.kind in CLOSING:
                    # the rest of what was sent, if any, is no request; pipelined requests past the first go
                    # unanswered by cpp-httplib 0.11 (a stream per request drops the bytes read past it)
                    connection.close()
            except Exception as err:  # noqa: BLE001 - a malformed answer, a timeout, a refused connection: counted
                tally.fail(f"case {i} ({case.kind}): {type(err).__name__}: {err}; sent {case.wire[:300]!r}")
                tally.statuses[i] = FAILED
                connection.close()
        connection.close()

    threads = [threading.Thread(target=worker, args=(indices[k::connections],)) for k in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tally


# ------------------------------------------------------------------------------------------ servers
class Server(ServedProcess):
    """``embserve serve`` (``binary``: ``--native`` on that embserve-server build) with REST on ``http_port``."""

    def __init__(self, artifact: Path, binary: Path | None, log: Path) -> None:
        self.http_port = free_port()
        command = [
            sys.executable, "-m", "infer.cli", "serve", str(artifact), "--host", HOST, "--port", "0",
            "--metrics-port", "0", "--http-port", str(self.http_port), "--max-message-mb", "1",
            "--max-batch-size", str(MAX_BATCH), "--intra-op-threads", "1", "--drain-seconds", "5",
        ]  # fmt: skip
        env = dict(os.environ)
        if binary is not None:
            command.append("--native")
            env.update(SANITIZER_ENV, EMBSERVE_SERVER_BIN=str(binary))
        else:
            command.append("--python")
        super().__init__(command, log, env)
        self.wait_ready(300)

    def reports(self) -> list[str]:
        return [
            line for line in self.log_path.read_text(errors="replace").splitlines() if SANITIZER_REPORT.search(line)
        ]


def final_check(port: int, pool: list[Example]) -> bool:
    """The server still answers a valid JSON and a valid binary request with the runtime's outputs."""
    rng = random.Random(12345)
    connection = Connection(port, 60.0)
    good = True
    for binary in (False, True):
        case = Case("valid_infer", post(encode(rng, pool[0], binary), rng), example=0)
        connection.send(case.wire, False)
        answer = connection.read()
        good = good and answer.status == 200 and check(case, answer, pool) is None
    connection.close()
    return good


def family(status: int) -> str:
    """2xx, 4xx, 5xx, closed (no answer), failed (an answer that failed a check)."""
    return _label(status) if status <= 0 else f"{status // 100}xx"


def _label(status: int) -> str:
    return {CLOSED: "closed", FAILED: "failed", -1: "unsent"}.get(status, str(status))


def histogram(statuses: list[int], indices: list[int] | range) -> dict[str, int]:
    counts = Counter(statuses[i] for i in indices)
    return {_label(s): n for s, n in sorted(counts.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000, help="fuzzed requests to the native server")
    parser.add_argument("--compare", type=int, default=3000, help="of them, how many also go to the Python server")
    parser.add_argument("--connections", type=int, default=8, help="client threads, one keep-alive connection each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for one answer")
    parser.add_argument("--binary", type=Path, default=BUILT, help="the sanitizer build of embserve-server")
    parser.add_argument("--logs", type=Path, default=None, help="keep both servers' stderr in this folder")
    parser.add_argument("--show", type=int, default=10, help="failures and mismatches printed to stderr")
    args = parser.parse_args()
    if not os.access(args.binary, os.X_OK):
        print(f"no {args.binary}: cmake --build cpp_loader/build --target embserve-server-asan", file=sys.stderr)
        return 2

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="embserve-bench-rest-fuzz-") as tmp:
        spec = fuzz_spec()
        artifact = export(quantize(spec, random_weights(spec, seed=0)), Path(tmp) / MODEL)
        pool = make_pool(load(artifact), spec, 32, args.seed)
        rows = {f: t.num_embeddings for t in spec.tables for f in t.feature_names}
        made = time.perf_counter()
        cases = make_cases(args.requests, args.seed, pool, rows)
        make_s = time.perf_counter() - made
        sample = sorted(random.Random(args.seed + 1).sample(range(len(cases)), min(args.compare, len(cases))))

        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        native = Server(artifact, args.binary, logs / "native.log")
        try:
            started = time.perf_counter()
            got = drive(native.http_port, cases, list(range(len(cases))), args.connections, pool, args.timeout)
            seconds = time.perf_counter() - started
            alive = native.alive()
            answers_after = alive and final_check(native.http_port, pool)
        finally:
            code = native.stop()
        reports = native.reports()
        python = Server(artifact, None, logs / "python.log")
        try:
            reference = drive(python.http_port, cases, sample, args.connections, pool, args.timeout)
        finally:
            python.stop()
        if reports:
            print("\n".join((logs / "native.log").read_text(errors="replace").splitlines()[-80:]), file=sys.stderr)

    mismatches = [
        i for i in sample if cases[i].kind not in LENIENT and family(got.statuses[i]) != family(reference.statuses[i])
    ]
    differ = [i for i in sample if got.statuses[i] != reference.statuses[i]]
    mismatch_set = set(mismatches)
    for kind in CLASSES:
        mine = [i for i, c in enumerate(cases) if c.kind == kind]
        compared = [i for i in sample if cases[i].kind == kind]
        print(
            json.dumps(
                {
                    "bench": "rest_fuzz_class",
                    "class": kind,
                    "requests": len(mine),
                    "native": histogram(got.statuses, mine),
                    "allowed": [_label(s) for s in sorted(CLASSES[kind])],
                    "compared": len(compared),
                    "python": histogram(reference.statuses, compared),
                    "family_mismatches": sum(1 for i in compared if i in mismatch_set),
                    "status_differences": sum(1 for i in compared if got.statuses[i] != reference.statuses[i]),
                    "families_compared": kind not in LENIENT,
                }
            )
        )
    for i in mismatches[: args.show]:
        print(f"family mismatch: case {i} ({cases[i].kind}) native {got.statuses[i]} python {reference.statuses[i]}: "
              f"{cases[i].wire[:300]!r}", file=sys.stderr)  # fmt: skip
    for i in [i for i in differ if i not in mismatch_set][: args.show]:
        print(f"status difference: case {i} ({cases[i].kind}) native {got.statuses[i]} python {reference.statuses[i]}: "
              f"{cases[i].wire[:200]!r}", file=sys.stderr)  # fmt: skip
    for text in got.failures[: args.show]:
        print(f"failure: {text}", file=sys.stderr)
    for text in reference.failures[: args.show]:
        print(f"python failure: {text}", file=sys.stderr)
    server_errors = sum(1 for s in got.statuses if s >= 500)
    ok = alive and answers_after and code == 0 and not reports and not got.failures and not mismatches
    print(
        json.dumps(
            {
                "bench": "rest_fuzz",
                "requests": len(cases),
                "connections": args.connections,
                "seconds": round(seconds, 1),
                "requests_per_s": round(len(cases) / seconds, 1),
                "native": histogram(got.statuses, range(len(cases))),
                "sanitizer_reports": len(reports),
                "failures": len(got.failures),
                "server_errors_5xx": server_errors,
                "compared_with_python": len(sample),
                "family_mismatches": len(mismatches),
                "status_differences": len(differ),
                "python_failures": len(reference.failures),
                "alive_at_end": alive,
                "valid_request_after": answers_after,
                "exit_code": code,
                "case_generation_s": round(make_s, 1),
                "target_requests": 100_000,
                "meets_target": ok and len(cases) >= 100_000,
                "loadavg": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
